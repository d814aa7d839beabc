"""The embedded target's next-token loss by position: what it knows past the 256 tokens it was trained on.

The target was trained on 256-token windows (dflash_fast/assets/target/train_report.json) but accepts
max_position_embeddings = 2048. This reads held-out stdlib files (never trained on) from their start, keeps the
first --seq-len tokens of each file that long, and prints the mean next-token loss in the context buckets of
`dflash-fast eval` (a token at position p is predicted from a context of p tokens), as JSON.

    python scripts/target_loss_by_position.py --seq-len 2048 --files 40
"""
import argparse
import json
from pathlib import Path
from typing import Dict, List

import torch
from train_embedded_target import file_split, read_texts, stdlib_files, stdlib_root

from dflash_fast.evaluate.report import context_bucket

TARGET = Path(__file__).resolve().parents[1] / "dflash_fast" / "assets" / "target"


@torch.no_grad()
def loss_by_position(model, windows: torch.Tensor) -> List[Dict]:
    """windows [n, T] -> per context bucket [lo, hi): {"context", "tokens", "loss"} (mean nats/token over every
    token at positions lo..hi-1 of every window, position p predicted from positions 0..p-1)."""
    nll = torch.cat([  # [n, T-1], 4 windows a forward: 4 x T x V logits
        torch.nn.functional.cross_entropy(model(input_ids=w).logits[:, :-1].float().transpose(1, 2), w[:, 1:],
                                          reduction="none")
        for w in windows.split(4)])
    buckets: Dict[int, List[float]] = {}
    for p in range(1, windows.shape[1]):
        lo, _ = context_bucket(p)
        total = buckets.setdefault(lo, [0.0, 0])
        total[0] += float(nll[:, p - 1].sum())
        total[1] += windows.shape[0]
    return [{"context": f"{lo}-{context_bucket(lo)[1] - 1}", "tokens": n, "loss": s / n}
            for lo, (s, n) in sorted(buckets.items())]


def heldout_windows(tokenizer, seq_len: int, files: int) -> torch.Tensor:
    """[n, seq_len]: the first seq_len tokens of up to `files` held-out stdlib files at least that long."""
    root = stdlib_root()
    texts = read_texts(root, [r for r in stdlib_files(root) if file_split(r) == "heldout"])
    rows = [enc.ids[:seq_len] for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
            if len(enc.ids) >= seq_len]
    if not rows:
        raise ValueError(f"no held-out stdlib file has {seq_len} tokens; lower --seq-len")
    return torch.tensor(rows[:files], dtype=torch.long)


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048, help="tokens read from the start of each file")
    p.add_argument("--files", type=int, default=40, help="held-out files read (those with --seq-len tokens)")
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET).eval()
    windows = heldout_windows(tokenizer, args.seq_len, args.files)
    report = {"files": windows.shape[0], "seq_len": args.seq_len, "by_context": loss_by_position(model, windows)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
