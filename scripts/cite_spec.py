"""Point every citation of the semantics at docs/spec.md, the copy in the repository.

The semantics used to live outside the repository (a SPEC.md beside the checkout), cited as `SPEC §5`,
`SPEC.md §1-2`, `../shared/SPEC.md` or plainly `the SPEC`. This rewrites each of those, in every file git tracks,
to the in-repository page: `spec.md §5`, `spec.md §1-2`, a relative path to docs/spec.md, `spec.md`. It is
idempotent: a second run changes nothing. tests/test_docs.py fails while any old citation is left.

    python scripts/cite_spec.py            # rewrite in place, print each file changed
    python scripts/cite_spec.py --check    # change nothing; exit 1 if a file would change

It prints each Python line the rewrite pushes past ruff's 120 characters, to be re-wrapped by hand."""
import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "docs/spec.md"
OUTSIDE_PATH = re.compile(r"(?:\.\./)+shared/SPEC\.md|/work/shared/SPEC\.md")
RULES = (
    (re.compile(r"\bSPEC(?:\.md)?(\s+)§"), r"spec.md\1§"),  # SPEC §5, SPEC.md §1-2 (also across a line break)
    (re.compile(r"\bSPEC\.md\b"), "spec.md"),
    (re.compile(r"\b(?:the )?SPEC's\b"), "spec.md's"),
    (re.compile(r"\bSPEC\b(?![_\w])"), "spec.md"),  # "against SPEC", "SPEC in plain torch"; not SPEC_WINDOW_GAP
)
LINE_LENGTH = 120


def rewrite(text: str, path: str) -> str:
    # a Markdown page links relative to itself; code and other text name the repository path
    spec = os.path.relpath(os.path.join(REPO, SPEC), os.path.dirname(os.path.join(REPO, path))) \
        if path.endswith(".md") else SPEC
    text = OUTSIDE_PATH.sub(spec, text)
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text


def tracked_files() -> list:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and p not in (SPEC, "scripts/cite_spec.py", "tests/test_docs.py")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    args = parser.parse_args(argv)
    changed = []
    for path in tracked_files():
        full = os.path.join(REPO, path)
        if not os.path.isfile(full):
            continue
        try:
            with open(full, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        new = rewrite(text, path)
        if new == text:
            continue
        changed.append(path)
        if not args.check:
            with open(full, "w", encoding="utf-8") as f:
                f.write(new)
        if path.endswith(".py"):
            for number, line in enumerate(new.splitlines(), 1):
                if len(line) > LINE_LENGTH and "spec.md" in line:
                    print(f"{path}:{number}: {len(line)} characters: re-wrap by hand", file=sys.stderr)
    for path in changed:
        print(path)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
