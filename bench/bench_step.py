"""One full DFlash drafter training step: our Triton path vs our eager path vs vllm-project/speculators.

    python bench/bench_step.py [--loss KIND] [--impls triton,eager,liger,speculators] [--out DIR]
    python bench/bench_step.py --shape smollm2-135m   # the real target's drafter (SmolLM2-135M-Instruct)
    python bench/bench_step.py --smoke        # CPU: tiny fp32 shapes, Triton interpreter (CI only)

A step is fc-concat, the drafter layers, norm + lm_head + loss, backward, gradient
clipping at 1.0 and torch AdamW, at the Qwen3-8B drafter shapes (H = H_t = 4096,
32/8 heads, D = 128, I = 12288, V = 151936, K = 5 tapped layers, 5 drafter layers,
B = 16, A = 512 sorted anchors, T = 3072, one row, bf16), random weights and one
synthetic row of a few documents (the first eighth of each is prompt, loss_mask 0).

Contenders (every one is timed on the same row, after the same warm-up):
  triton       ops.set_backend("triton"): fc-concat, anchored attention, lm_head loss as Triton kernels
  eager        ops.set_backend("eager"): the eager twins (dense mask, materialised logits); an OOM is recorded
  liger        triton, with each layer's RMSNorms and SwiGLU swapped for liger-kernel's at run time
  speculators  its DFlashDraftModel as its trainer runs it: fp32 weights under bf16 autocast, torch.compile'd
               forward, FlexAttention with a compiled create_block_mask every step (also timed alone:
               mask_ms), its fused Triton loss on materialised logits, its own anchor sampling
Ours keep bf16 weights and fp32 master copies for AdamW (DeepSpeed's bf16 scheme, as our
trainer runs), so every contender holds fp32 weights and fp32 Adam moments.

FLOPs of one step, per row (Q = A*B draft slots, L drafter layers):
  layers     6 * P * L * Q          P = H*Hq*D + 2*H*Hkv*D + Hq*D*H + 3*H*I   (fwd 2PQ + bwd 4PQ)
  ctx k/v    6 * 2*H*Hkv*D * L * T  (fwd + input and weight grads: ctx trains fc)
  fc         4 * K*H_t*H * T        (fwd + weight grad; hidden states are data)
  lm_head    4 * H*V * Q            (fwd + input grad; the head is frozen)
  teacher    2 * H*V * Q            (kl, and always for speculators; 0 for ce / kl_topk, read from the store)
  attention  14 * D*Hq * S * L      S = visible (query, key) pairs per head: fwd 4, bwd 10 FLOPs per pair and channel
MFU = FLOPs / step time / dense bf16 peak (datasheet: 989 TFLOP/s for H100/H200 SXM);
of_matmul = the same against the 8192^3 bf16 matmul rate measured in this run.
peak_gb is the whole peak of a step (weights, optimizer states, and the shared batch and frozen
tensors, shared_gb); step_extra_gb what a step adds to what stays allocated.
--family lilicorr: LiLiCorr's lattice head on the same drafter (K = 8, lattice width H / 8, 2 layers), its lattice
loss beside the backbone's (speculators trains no LiLiCorr: its row says so).
--shape smollm2-135m: the same contenders at the real target's drafter (H = H_t = 576, 9/3 heads, D = 64, I = 1536,
V = 49152, K = 5, 5 drafter layers; docs/real-target.md).
Results: <out>/step_<loss>[_<shape>].{json,md,png} (+ _smoke with --smoke). CPU times are no claim.
"""
import argparse
import gc
import math
import os
import sys
import time
import traceback
from typing import Optional

import torch

if "--smoke" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import peak_memory_mb, time_calls_ms, time_ms, write_results  # noqa: E402
from dflash_fast.data.batches import sample_anchors  # noqa: E402
from dflash_fast.drafter import ops  # noqa: E402
from dflash_fast.drafter.config import DrafterConfig  # noqa: E402
from dflash_fast.drafter.losses import LOSS_KINDS, needs_last  # noqa: E402
from dflash_fast.drafter.model import DFlashDrafter  # noqa: E402
from dflash_fast.serve.layouts import qwen3_layer  # noqa: E402
from dflash_fast.train.config import LossConfig  # noqa: E402
from dflash_fast.train.model import resolve_loss_kind  # noqa: E402

FULL = dict(H=4096, Hq=32, Hkv=8, D=128, I=12288, V=151936, K=5, L=5, B=16, A=512, T=3072, docs=4)
# --shape: the Qwen3-8B drafter (the headline) or the real target's (SmolLM2-135M-Instruct: hidden 576, 9/3 heads of
# 64, intermediate 1536, vocabulary 49,152; the drafter docs/real-target.md sizes for a GPU)
SHAPES = {"qwen3-8b": FULL,
          "smollm2-135m": dict(H=576, Hq=9, Hkv=3, D=64, I=1536, V=49152, K=5, L=5, B=16, A=512, T=3072, docs=4)}
SMOKE = dict(H=32, Hq=2, Hkv=1, D=16, I=64, V=256, K=2, L=2, B=4, A=6, T=48, docs=3)
IMPLS = ("triton", "speculators", "liger", "eager")  # the headline pair first: a timeout keeps what ran
# The kinds the config's loss.kind accepts; `auto` is what it is on a store with `last` (the synthetic row has it).
LOSSES = ("auto",) + LOSS_KINDS
# speculators' name of each kind (speculators.losses); it has no loss on a stored top-k teacher (it always runs
# the full teacher lm_head) and none against the dataset's tokens (ce_data: no speculators row).
PEER_LOSS = {"kl": "kl_div", "ce": "ce", "kl_topk": "kl_div", "tv": "tv", "lk": "nla", "lk_hybrid": "lk_hybrid",
             "rkl": "rkl", "jsd": "jsd"}
GAMMA = 7.0
CLIP = 1.0
TOPK = 8
EPS = 1e-6
DATASHEET_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


# --family: the DFlash drafter, or LiLiCorr's lattice head on it (docs/lilicorr.md: K = 8 candidates a slot, a lattice
# width of H / 8, 2 layers: the design model's kl(LiLiCorr) case), trained with the loss config's default weights
FAMILIES = {"dflash": lambda _s: {},
            "lilicorr": lambda s: dict(lilicorr_candidate_topk=8, lilicorr_hidden_size=max(s["H"] // 8, 16),
                                       lilicorr_num_layers=2)}


def drafter_config(s, family="dflash") -> DrafterConfig:
    k = s["K"]
    return DrafterConfig(
        **FAMILIES[family](s),
        hidden_size=s["H"],
        num_attention_heads=s["Hq"],
        num_key_value_heads=s["Hkv"],
        head_dim=s["D"],
        intermediate_size=s["I"],
        vocab_size=s["V"],
        layer_ids=list(range(1, 1 + 8 * k, 8)),
        target_num_layers=8 * k + 4,
        target_hidden_size=s["H"],
        mask_token_id=s["V"] - 1,
        rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        num_layers=s["L"],
        block_size=s["B"],
    )


def make_batch(s, dtype, device, seed=0):
    """One synthetic row in the dflash_fast.data.batches layout (R = 1): `docs` documents of random
    lengths, each with a prompt (loss_mask 0) on its first eighth; A sorted anchors; hidden
    [1, T, K, H], last [1, T, H], a stored top-k teacher [1, T, k] with its lse [1, T]."""
    t, v = s["T"], s["V"]
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(t - 1, generator=gen)[: s["docs"] - 1].add(1).sort().values
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    lengths = torch.diff(torch.cat([starts, torch.tensor([t])]))
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    position_ids = torch.arange(t) - starts[document_ids]
    loss_mask = position_ids >= lengths[document_ids] // 8
    anchors, anchor_valid = sample_anchors(loss_mask, document_ids, s["A"], gen)
    base = torch.randint(0, v, (t, 1), generator=gen)
    topk_logits = (torch.randn(t, TOPK, generator=gen) * 2 + 4).sort(dim=-1, descending=True).values
    rest = torch.full((t, 1), math.log(v))  # the other V - k tokens carry about as much mass as logit 0 each
    batch = {
        "input_ids": torch.randint(0, v, (t,), generator=gen),
        "loss_mask": loss_mask,
        "document_ids": document_ids,
        "position_ids": position_ids,
        "hidden": torch.randn(t, s["K"], s["H"], generator=gen),
        "last": torch.randn(t, s["H"], generator=gen),
        "teacher_topk_ids": (base + torch.arange(TOPK) * (v // TOPK)) % v,
        "teacher_topk_logits": topk_logits,
        "teacher_lse": torch.logsumexp(torch.cat([topk_logits, rest], dim=-1), dim=-1),
        "anchors": anchors,
        "anchor_valid": anchor_valid,
    }
    floats = ("hidden", "last", "teacher_topk_logits", "teacher_lse")
    return {k: x[None].to(device=device, dtype=dtype if k in floats else x.dtype) for k, x in batch.items()}


def visible_pairs(batch, block_size: int) -> int:
    """Visible (query, key) pairs of one head (spec.md §4, bidirectional blocks): each valid anchor's
    B queries see its document's context before it (= the anchor's position id) and its B slots."""
    valid = batch["anchor_valid"]
    ctx = batch["position_ids"].gather(1, batch["anchors"])[valid].sum()
    return int(ctx) * block_size + int(valid.sum()) * block_size * block_size


def step_flops(s, pairs: int, teacher: bool) -> dict:
    """FLOPs of one training step by part (module docstring)."""
    h, hq, hkv, d, q = s["H"], s["Hq"], s["Hkv"], s["D"], s["A"] * s["B"]
    p = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * s["I"]
    parts = {
        "layers": 6 * p * s["L"] * q,
        "ctx_kv": 6 * 2 * h * hkv * d * s["L"] * s["T"],
        "fc": 4 * s["K"] * h * h * s["T"],
        "lm_head": 4 * h * s["V"] * q,
        "teacher": 2 * h * s["V"] * q if teacher else 0,
        "attention": 14 * d * hq * pairs * s["L"],
    }
    parts["total"] = sum(parts.values())
    return parts


def datasheet_bf16() -> Optional[float]:
    """Dense bf16 FLOP/s of this GPU by its datasheet; None when unknown (or on CPU)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((rate for key, rate in DATASHEET_BF16 if key in name), None)


def measured_matmul_rate() -> Optional[float]:
    """FLOP/s of one 8192^3 bf16 matmul on this GPU (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3)


class MasterAdamW:
    """torch AdamW on fp32 master copies of low-precision parameters, gradient norm clipped at CLIP.

    What DeepSpeed's bf16 mode does: the model computes in bf16, the optimizer updates
    fp32 masters and copies them back. fp32 parameters are their own masters.
    """

    def __init__(self, params, lr: float):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=self.params[0].is_cuda)

    def step(self):
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)


def frozen_tensors(s, dtype, device, seed=1):
    """The target's embedding, lm_head [V, H] and final norm [H]: random, shared by every contender."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    return {
        "embed_tokens": rand(s["V"], s["H"]).to(dtype),
        "lm_head": (rand(s["V"], s["H"]) * 2 / math.sqrt(s["H"])).to(dtype),
        "target_norm": torch.ones(s["H"], device=device, dtype=dtype),
    }


def use_liger(drafter: DFlashDrafter) -> None:
    """Swap each layer's RMSNorms for LigerRMSNorm (same weights) and its SwiGLU for Liger's fused
    silu(gate) * up. RoPE stays ours: Liger's kernel rotates a q and a k of one sequence with one
    cos/sin, while the drafter rotates block queries/keys and context keys at different positions."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers import LigerRMSNorm

    for layer in drafter.layers:
        for parent, name in (
            (layer, "input_layernorm"),
            (layer, "post_attention_layernorm"),
            (layer.self_attn, "q_norm"),
            (layer.self_attn, "k_norm"),
        ):
            old = getattr(parent, name)
            new = LigerRMSNorm(old.weight.shape[0], eps=old.eps)
            new.weight = old.weight
            setattr(parent, name, new)
        mlp = layer.mlp
        mlp.forward = lambda x, m=mlp: m.down_proj(LigerSiLUMulFunction.apply(m.gate_proj(x), m.up_proj(x)))


def build_ours(impl, s, frozen, dtype, device, lr, loss_kind, batch, family="dflash"):
    ops.set_backend("eager" if impl == "eager" else "triton")
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(drafter_config(s, family))
    drafter.to(dtype)
    drafter.set_frozen(**frozen)
    if impl == "liger":
        use_liger(drafter)
    opt = MasterAdamW(drafter.parameters(), lr)
    backends = ",".join(f"{op}={ops.backend_of(op)}" for op in ops.OPS)

    weights = LossConfig().family_weights()

    def step():
        loss = drafter(batch, loss_kind, GAMMA, **weights).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step, {"backends": backends}


def build_speculators(s, frozen, device, lr, loss_kind, batch, smoke):
    """speculators' DFlashDraftModel, built from code (no verifier on disk), trained as its Trainer does."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    cfg = drafter_config(s)
    # The layer config our speculators export writes for this drafter, read as speculators reads it.
    layer_config = Qwen3Config(**qwen3_layer(cfg))
    # On CPU FlexAttention has no backward: the smoke run uses its eager attention with a dense mask.
    layer_config._attn_implementation = "eager" if smoke else "simple_flex_attention"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=s["V"],
        block_size=s["B"],
        aux_hidden_state_layer_ids=[i + 1 for i in cfg.layer_ids],  # speculators numbers layer ids one higher
        mask_token_id=cfg.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=s["B"] - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(frozen["embed_tokens"])
        model.lm_head.weight.copy_(frozen["lm_head"])
        model.verifier_lm_head.weight.copy_(frozen["lm_head"])
        model.verifier_norm.weight.copy_(frozen["target_norm"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")
    t = s["T"]
    inputs = dict(
        hidden_states=batch["hidden"].reshape(1, t, -1),
        input_ids=batch["input_ids"],
        loss_mask=batch["loss_mask"].long(),
        verifier_last_hidden_states=batch["last"],
        document_ids=batch["document_ids"],
        position_ids=batch["position_ids"],
        loss_config=resolve_loss_config(PEER_LOSS[loss_kind], "eager" if smoke else "fused"),
        gamma=GAMMA,
        max_anchors=s["A"],
    )

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not smoke):
            _, loss, _ = model(**inputs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        return loss.detach()

    def build_mask():
        model._build_attention_mask(inputs["loss_mask"], s["A"], inputs["document_ids"], device)

    return step, {"build_mask": build_mask}


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def run_contender(build, reps):
    """Build, first step (one-off compile/autotune), second step, timed steps, peak memory -> row fields."""
    row = {}
    t0 = time.perf_counter()
    step, extra = build()
    row["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    row["loss"] = step().float().item()
    row["first_step_s"] = time.perf_counter() - t0
    row["loss_step2"] = step().float().item()
    times = time_calls_ms(step, **reps)
    row["step_ms"] = sorted(times)[len(times) // 2]
    row["step_ms_min"] = min(times)
    if torch.cuda.is_available():
        resident = torch.cuda.memory_allocated() / 2**20
        peak = peak_memory_mb(step, resident=True)
        row["peak_gb"] = peak / 1024
        row["step_extra_gb"] = (peak - resident) / 1024
    if "backends" in extra:
        row["backends"] = extra["backends"]
    if "build_mask" in extra:
        mask_times = time_calls_ms(extra["build_mask"], **reps)
        row["mask_ms"] = sorted(mask_times)[len(mask_times) // 2]
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny fp32 shapes on CPU through the Triton interpreter (CI only)"
    )
    p.add_argument("--loss", choices=LOSSES, default="kl", help="loss kind, as loss.kind (default kl: full teacher)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated contenders from {IMPLS}")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-8b", help="the drafter's shapes (GPU run)")
    p.add_argument("--family", choices=tuple(FAMILIES), default="dflash", help="the drafter family (default dflash)")
    p.add_argument("--seq-len", type=int, default=FULL["T"], help="T, tokens in the row (GPU run)")
    p.add_argument("--anchors", type=int, default=FULL["A"], help="A, anchors per row (GPU run)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    args = p.parse_args(argv)
    args.loss = resolve_loss_kind(args.loss, {"has_last": True})
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in args.impls if i not in IMPLS]
    if bad or not args.impls:
        p.error(f"--impls {bad or 'is empty'}: choose from {IMPLS}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        device, dtype, s, reps, lr = torch.device("cpu"), torch.float32, dict(SMOKE), dict(warmup=0, rep=1), 1e-2
    elif torch.cuda.is_available():
        device, dtype, reps, lr = torch.device("cuda"), torch.bfloat16, dict(warmup=1, rep=5), args.lr
        s = dict(SHAPES[args.shape], T=args.seq_len, A=args.anchors)
    else:
        sys.exit("the full benchmark needs a CUDA GPU; run with --smoke on CPU")
    batch = make_batch(s, dtype, device)
    frozen = frozen_tensors(s, dtype, device)
    pairs = visible_pairs(batch, s["B"])
    # The batch and the frozen tensors stay allocated for every contender, so every peak_gb includes them.
    shared_gb = sum(x.numel() * x.element_size() for x in [*batch.values(), *frozen.values()]) / 2**30
    n_anchors = int(batch["anchor_valid"].sum())
    peak_rate, matmul_rate = datasheet_bf16(), measured_matmul_rate()
    ours_teacher = needs_last(args.loss, stored_labels=True)  # the synthetic row stores the top-k teacher
    builders = {
        "triton": lambda: build_ours("triton", s, frozen, dtype, device, lr, args.loss, batch, args.family),
        "eager": lambda: build_ours("eager", s, frozen, dtype, device, lr, args.loss, batch, args.family),
        "liger": lambda: build_ours("liger", s, frozen, dtype, device, lr, args.loss, batch, args.family),
        "speculators": lambda: build_speculators(s, frozen, device, lr, args.loss, batch, args.smoke),
    }
    meta = {
        "drafter": args.shape,
        "family": args.family,
        "shape": ", ".join(f"{k}={v}" for k, v in s.items()),
        "valid_anchors": n_anchors,
        "visible_pairs_per_head": pairs,
        "flops_by_part": {k: f"{v:.4g}" for k, v in step_flops(s, pairs, ours_teacher).items()},
        "flop_formula": "6*P*L*Q + 12*H*Hkv*D*L*T + 4*K*H_t*H*T + 4*H*V*Q + [2*H*V*Q teacher] + 14*D*Hq*S*L, "
        "P = H*Hq*D + 2*H*Hkv*D + Hq*D*H + 3*H*I, Q = A*B, S = visible pairs per head",
        "mfu_peak_tflops": peak_rate and peak_rate / 1e12,
        "measured_matmul_tflops": matmul_rate and matmul_rate / 1e12,
        "shared_gb": shared_gb,
        "optimizer": "ours: bf16 weights + fp32 master AdamW; speculators: fp32 weights + bf16 autocast "
        "AdamW; clip 1.0",
    }
    shape = "" if args.shape == "qwen3-8b" else f"_{args.shape}"
    family = "" if args.family == "dflash" else f"_{args.family}"
    name = f"step_{args.loss}{shape}{family}" + ("_smoke" if args.smoke else "")
    rows = []
    for impl in args.impls:
        flops = step_flops(s, pairs, teacher=ours_teacher or impl == "speculators")
        row = {
            "impl": impl,
            "loss_kind": PEER_LOSS.get(args.loss) if impl == "speculators" else args.loss,
            "dtype": str(dtype).replace("torch.", ""),
            "tflop_per_step": flops["total"] / 1e12,
        }
        try:
            if row["loss_kind"] is None:
                row["note"] = f"speculators has no loss {args.loss!r}"
            elif impl == "speculators" and args.family != "dflash":
                row["note"] = f"speculators trains no {args.family}"
            else:
                row.update(run_contender(builders[impl], reps))
        except ImportError as err:
            row["note"] = f"not installed ({err})"
        except Exception as err:  # noqa: BLE001 -- on a GPU an OOM or a peer's API change is a result, not a crash
            if is_oom(err):
                row["note"] = "OOM"
            elif args.smoke and impl in ("triton", "eager"):
                raise
            else:
                traceback.print_exc()
                row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        finally:
            ops.set_backend("auto")
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "step_ms" in row:
            sec = row["step_ms"] / 1e3
            row["anchors_per_s"] = n_anchors / sec
            row["tflops"] = flops["total"] / sec / 1e12
            row["mfu"] = flops["total"] / sec / peak_rate if peak_rate else None
            row["of_matmul"] = flops["total"] / sec / matmul_rate if matmul_rate else None
        rows.append(row)
        compare(rows)
        # Written after every contender, so a run stopped by a timeout keeps what it measured.
        md = write_results(
            name, rows, args.out, plot={"x": "impl", "y": "anchors_per_s", "group": "loss_kind"}, meta=meta
        )
    print(md)


def compare(rows):
    """Side-by-side ratios: ours vs speculators (throughput, memory), liger vs triton."""
    by = {r["impl"]: r for r in rows if "step_ms" in r}
    peer = by.get("speculators")
    for r in by.values():
        if peer is not None and r is not peer:
            r["anchors_vs_speculators"] = r["anchors_per_s"] / peer["anchors_per_s"]
            if r.get("peak_gb") and peer.get("peak_gb"):
                r["peak_vs_speculators"] = r["peak_gb"] / peer["peak_gb"]
    if "liger" in by and "triton" in by:
        by["liger"]["speedup_vs_triton"] = by["triton"]["step_ms"] / by["liger"]["step_ms"]


if __name__ == "__main__":
    main()
