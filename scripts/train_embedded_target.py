"""Train the embedded default target: a small Qwen3 causal LM of the Python standard library.

Every machine with Python has the standard library's own `.py` sources, so the
whole pipeline can run on a real language model without a download. This
script trains, on one CPU thread and from a fixed seed:

* a byte-level BPE tokenizer with Qwen-style special tokens and a ChatML chat
  template (`<|mask|>` is the DFlash mask token);
* an 8-layer Qwen3 causal LM (Muon for the layers' matrices, AdamW for the
  rest) on a mix of plain source text and chat examples (user: the first lines
  of a snippet, assistant: the rest of that paragraph), so that a ChatML
  prompt is answered with a plausible continuation that ends;

then reports its loss on held-out stdlib files and saves everything with
`save_pretrained` (fp32 safetensors: CPU targets run in fp32, and
transformers loads a checkpoint in its stored dtype).

Files are split by a hash of their path, so the split of a file does not depend
on which other files an installation ships.

    python scripts/train_embedded_target.py --out dflash_fast/assets/target --seed 0 --threads 1 \
        --steps 1600 --max-minutes 28
"""
import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, MASK]

# Qwen's ChatML without tools or thinking. The generation block marks the
# assistant tokens for `apply_chat_template(return_assistant_tokens_mask=True)`.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('role ' + message['role'] + ' is not one of system, user, assistant') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Generated tables (encodings, pydoc topics), machine-specific build data and
# test suites (often not installed) are not the code a user writes.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                 "encodings", "pydoc_data", "lib-dynload"}
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")

# Qwen-style pre-tokenization: a newline never merges with the indentation
# after it, so the generation prompt's trailing "\n" is tokenized as it is
# inside a whole conversation, and an answer can start with its indentation.
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

HASH_BUCKETS = 20
SNIPPET_STARTS = ("def ", "async def ", "class ", "@")


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources."""
    return Path(os.path.dirname(os.__file__))


def stdlib_files(root: Path) -> List[str]:
    """Sorted POSIX paths, relative to `root`, of the stdlib `.py` files used as text."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith(EXCLUDED_PREFIXES) for part in rel.parts):
            continue
        found.append(rel.as_posix())
    if not found:
        raise FileNotFoundError(f"no Python sources under {root}: this interpreter ships no stdlib .py files")
    return sorted(found)


def _bucket(rel: str) -> int:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HASH_BUCKETS


def file_split(rel: str) -> str:
    """'heldout' for 2 in 20 files (never trained on, by target or tokenizer), else 'train'."""
    return "heldout" if _bucket(rel) < 2 else "train"


def prompt_split(rel: str) -> str:
    """Held-out files feed two disjoint prompt sets: 'eval' (bucket 0) and 'train' (bucket 1)."""
    if file_split(rel) != "heldout":
        raise ValueError(f"{rel} is a target training file; prompts come from held-out files only")
    return "eval" if _bucket(rel) == 0 else "train"


def read_texts(root: Path, rels: Sequence[str]) -> List[str]:
    """The files' text; undecodable bytes become U+FFFD so every installation reads the same way."""
    return [(root / rel).read_text(encoding="utf-8", errors="replace") for rel in rels]


def sample_snippet(lines: Sequence[str], rng: random.Random, n_user: int,
                   max_assistant: int = 24) -> Optional[Tuple[str, str]]:
    """(user, assistant): `n_user` lines of a file, then the rest of that paragraph.

    The assistant part runs up to the next blank line, so where an answer ends
    is predictable and a greedy answer stops. Half the snippets start at a
    def/class/decorator line, the rest at any non-blank line. None when the
    user part ends in a blank line, no line follows it, or the paragraph runs
    past `max_assistant` lines.
    """
    last_start = len(lines) - n_user - 1
    if last_start < 0:
        return None
    starts = [i for i in range(last_start + 1) if lines[i].lstrip().startswith(SNIPPET_STARTS)]
    if not starts or rng.random() < 0.5:
        starts = [i for i in range(last_start + 1) if lines[i].strip()]
    if not starts:
        return None
    s = rng.choice(starts)
    a = end = s + n_user
    while end < len(lines) and lines[end].strip() and end - a <= max_assistant:
        end += 1
    if end == a or end - a > max_assistant or not lines[a - 1].strip():
        return None
    return "\n".join(lines[s:a]).rstrip(), "\n".join(lines[a:end]).rstrip()


class SnippetSampler:
    """Snippets from a set of files, each file drawn in proportion to its line count."""

    def __init__(self, texts: Sequence[str], seed: int):
        self.lines = [t.splitlines() for t in texts]
        counts = [len(ls) for ls in self.lines]
        self.cum = [sum(counts[:i + 1]) for i in range(len(counts))]
        self.rng = random.Random(seed)

    def __call__(self, n_user: Tuple[int, int] = (4, 12)) -> Tuple[int, str, str]:
        """(file index, user, assistant); the user line count is drawn uniformly from the closed range."""
        while True:
            f = self.rng.choices(range(len(self.lines)), cum_weights=self.cum)[0]
            got = sample_snippet(self.lines[f], self.rng, self.rng.randint(*n_user))
            if got is not None:
                return (f, *got)


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` with the special tokens at ids 0..3."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, mask_token=MASK,
        extra_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE, model_max_length=2048,
        clean_up_tokenization_spaces=False)


def chat_text(tokenizer, user: str, assistant: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], tokenize=False)


def token_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """[N] int64: the texts' tokens, each text followed by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    ids: List[int] = []
    # The backend encoder: whole files exceed model_max_length, which is a limit on model inputs only.
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(stream: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """[n', seq_len]: up to `n` non-overlapping windows spread evenly over `stream`."""
    total = stream.numel() // seq_len
    if total == 0:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, fewer than seq_len={seq_len}")
    idx = torch.linspace(0, total - 1, min(n, total)).round().long()
    return stream[: total * seq_len].view(total, seq_len)[idx]


@torch.no_grad()
def lm_loss(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) of `model` over windows [n, T]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size]
        logits = model(input_ids=x).logits[:, :-1].float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def make_model(tokenizer, args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return Qwen3ForCausalLM(config)


class RowSampler:
    """Training rows [T]: plain source windows at random offsets, or packed chat examples.

    Chat rows start at an example's `<|im_start|>`, as a prompt does at
    inference; the next example follows directly, without <|endoftext|>, so
    a lone "\n" is never followed by <|endoftext|> inside a conversation.
    """

    def __init__(self, tokenizer, stream: torch.Tensor, snippets: SnippetSampler, seq_len: int,
                 chat_fraction: float, seed: int):
        self.tokenizer, self.stream, self.snippets = tokenizer, stream, snippets
        self.seq_len, self.chat_fraction = seq_len, chat_fraction
        self.rng = random.Random(seed)

    def chat_row(self) -> torch.Tensor:
        ids: List[int] = []
        while len(ids) < self.seq_len:
            _, user, assistant = self.snippets()
            text = chat_text(self.tokenizer, user, assistant)
            ids.extend(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return torch.tensor(ids[: self.seq_len], dtype=torch.long)

    def plain_row(self) -> torch.Tensor:
        start = self.rng.randrange(self.stream.numel() - self.seq_len)
        return self.stream[start : start + self.seq_len]

    def batch(self, batch_size: int) -> torch.Tensor:
        """[batch_size, T] int64."""
        return torch.stack(
            [self.chat_row() if self.rng.random() < self.chat_fraction else self.plain_row() for _ in range(batch_size)]
        )


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """g [m, n] -> approximately the nearest semi-orthogonal matrix (Newton-Schulz quintic iteration).

    Muon's update direction: every singular value of the momentum is pushed
    towards 1, so all directions of a weight matrix learn at the same rate.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x if wide else x.T


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al., 2024): Nesterov momentum with orthogonalized updates, for 2-D layer weights.

    In 150-CPU-second trials of this model it reached a held-out loss of 4.8
    where AdamW reached 5.4-5.7: the CPU budget buys few steps, so each must count.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = orthogonalize(p.grad.add(buf, alpha=group["momentum"]))
                p.add_(update, alpha=-group["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


def make_optimizers(model, args) -> List[torch.optim.Optimizer]:
    """Muon for the 2-D weights inside the decoder layers; AdamW for the (tied) embedding and the norms."""
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and ".layers." in n)]
    opts = [Muon(matrices, lr=args.muon_lr), torch.optim.AdamW(rest, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)]
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return opts


def lr_scale(step: int, args) -> float:
    """Multiplier of the peak learning rates: linear warm-up, then cosine decay to 0.1 at `args.steps`."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def chat_check(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> dict:
    """Greedy answers to held-out ChatML prompts: how many end with <|im_end|>, and one example."""
    model.eval()
    ended, lengths, example = 0, [], None
    for user in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :]
        done = bool((out == tokenizer.eos_token_id).any())
        ended += done
        lengths.append(int(out.numel()))
        if example is None:
            example = {"user": user, "assistant": tokenizer.decode(out, skip_special_tokens=True)}
    model.train()
    return {
        "prompts": len(prompts),
        "ended_with_im_end": ended,
        "max_new_tokens": max_new_tokens,
        "mean_new_tokens": sum(lengths) / len(lengths),
        "example": example,
    }


def save(model, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "dflash_fast/assets/target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch and tokenizer threads (the CPU is shared)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size, special tokens included")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1600, help="optimizer steps; the LR schedule spans them")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=28.0,
        help="stop early (and say so in the report) when training has run this long",
    )
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW peak LR: embedding and norms")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon peak LR: the layers' 2-D weights")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--chat-fraction", type=float, default=0.5, help="share of rows that are chat examples")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of seq-len tokens in the final loss")
    p.add_argument("--chat-prompts", type=int, default=20, help="held-out chat prompts in the final generation check")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(
            f"--hidden {args.hidden} must divide by --heads {args.heads}, which must divide by "
            f"--kv-heads {args.kv_heads}"
        )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    root = stdlib_root()
    rels = stdlib_files(root)
    train_rels = [r for r in rels if file_split(r) == "train"]
    heldout_rels = [r for r in rels if file_split(r) == "heldout"]
    train_texts, heldout_texts = read_texts(root, train_rels), read_texts(root, heldout_rels)
    print(
        f"stdlib {root}: {len(train_rels)} train files ({sum(map(len, train_texts))} chars), "
        f"{len(heldout_rels)} held-out files ({sum(map(len, heldout_texts))} chars)",
        flush=True,
    )

    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_stream, heldout_stream = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    print(
        f"tokenizer: {len(tokenizer)} tokens; {train_stream.numel()} train / {heldout_stream.numel()} held-out "
        f"tokens ({time.time() - t_start:.0f}s)",
        flush=True,
    )
    eval_small = heldout_windows(heldout_stream, args.seq_len, 16)
    eval_full = heldout_windows(heldout_stream, args.seq_len, args.eval_windows)

    model = make_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters; initial held-out loss {lm_loss(model, eval_small):.3f}", flush=True
    )
    opts = make_optimizers(model, args)
    rows = RowSampler(
        tokenizer, train_stream, SnippetSampler(train_texts, args.seed), args.seq_len, args.chat_fraction, args.seed
    )

    history, t_train, step = [], time.time(), 0
    model.train()
    while step < args.steps:
        if (time.time() - t_train) / 60 > args.max_minutes:
            print(f"--max-minutes {args.max_minutes} reached at step {step} of {args.steps}", flush=True)
            break
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * lr_scale(step, args)
        x = rows.batch(args.batch_size)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        if step % 20 == 0:
            print(
                f"step {step}/{args.steps} loss {loss.item():.3f} lr x{lr_scale(step, args):.2f} "
                f"{time.time() - t_train:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0:
            val = lm_loss(model, eval_small)
            history.append({"step": step, "train_loss": loss.item(), "heldout_loss_16": val})
            print(f"step {step}: held-out loss (16 windows) {val:.3f}", flush=True)
    train_seconds = time.time() - t_train

    heldout_loss = lm_loss(model, eval_full)
    heldout_prompts = SnippetSampler(heldout_texts, args.seed + 1)
    chat = chat_check(model, tokenizer, [heldout_prompts()[1] for _ in range(args.chat_prompts)], 200)
    print(
        f"held-out loss {heldout_loss:.4f} nats/token (ppl {math.exp(heldout_loss):.2f}) over "
        f"{eval_full.numel()} tokens; chat: {chat['ended_with_im_end']}/{chat['prompts']} answers end",
        flush=True,
    )

    save(model, tokenizer, args.out)
    report = {
        "command": "python "
        + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "data": {
            "source": "Python standard library .py files (stdlib_files in this script)",
            "stdlib_root": str(root),
            "train_files": len(train_rels),
            "heldout_files": len(heldout_rels),
            "train_tokens": train_stream.numel(),
            "heldout_tokens": heldout_stream.numel(),
            "heldout_file_list": heldout_rels,
        },
        "model": {
            "architecture": "Qwen3ForCausalLM",
            "parameters": n_params,
            "dtype": "float32",
            "vocab_size": len(tokenizer),
            "layers": args.layers,
            "hidden": args.hidden,
        },
        "steps": step,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "stopped_by_time_budget": step < args.steps,
        "train_wall_seconds": round(train_seconds, 1),
        "total_wall_seconds": round(time.time() - t_start, 1),
        "heldout_loss": heldout_loss,
        "heldout_perplexity": math.exp(heldout_loss),
        "heldout_eval_tokens": eval_full.numel(),
        "uniform_loss": math.log(len(tokenizer)),
        "history": history,
        "chat_check": chat,
    }
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved to {args.out} ({report['total_wall_seconds']:.0f}s total)", flush=True)
    return report


if __name__ == "__main__":
    main()
