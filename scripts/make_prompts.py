"""Write the embedded prompt sets: the first lines of snippets from held-out stdlib files.

Each line is `{"conversations": [{"role": "user", "content": ...}], "source": "<stdlib path>"}`;
`dflash-fast regenerate` lets the target write the assistant turns. Train and
eval prompts come from disjoint held-out files (`prompt_split` in
train_embedded_target.py), none of which the target was trained on.

    python scripts/make_prompts.py --out-dir dflash_fast/assets
"""
import argparse
import json
from pathlib import Path
from typing import Dict, List

from train_embedded_target import SnippetSampler, file_split, prompt_split, read_texts, stdlib_files, stdlib_root


def make_prompts(n: int, split: str, seed: int) -> List[Dict]:
    """`n` distinct prompt records from the held-out files of prompt split `split` ('train' | 'eval')."""
    root = stdlib_root()
    rels = [r for r in stdlib_files(root) if file_split(r) == "heldout" and prompt_split(r) == split]
    if not rels:
        raise FileNotFoundError(f"no held-out stdlib files of prompt split {split!r} under {root}")
    sample = SnippetSampler(read_texts(root, rels), seed)
    seen, records = set(), []
    for _ in range(100 * n):
        if len(records) == n:
            break
        f, user, _ = sample()
        if user not in seen:
            seen.add(user)
            records.append({"conversations": [{"role": "user", "content": user}], "source": rels[f]})
    if len(records) < n:
        raise ValueError(f"only {len(records)} distinct prompts in the {split!r} files; ask for fewer than {n}")
    return records


def write_jsonl(records: List[Dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "dflash_fast/assets")
    p.add_argument("--train", type=int, default=300, help="prompts in prompts_train.jsonl")
    p.add_argument("--eval", type=int, default=40, help="prompts in prompts_eval.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for split, n in (("train", args.train), ("eval", args.eval)):
        path = args.out_dir / f"prompts_{split}.jsonl"
        records = make_prompts(n, split, args.seed)
        write_jsonl(records, path)
        print(f"{path}: {len(records)} prompts from {len({r['source'] for r in records})} files")


if __name__ == "__main__":
    main()
