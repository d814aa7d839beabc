"""The memory of one training step, per rank, before anything is allocated: what `train.py --plan` prints and
what a run checks against its GPU before step 1 (docs/memory.md).

    DrafterConfig + Step (T, A, R) + Setup (dtype, ZeRO stage, optimizer, world size, ...) ──step_memory──▶ Plan
    Plan.peak = sum(resident terms) + max(transient terms)

Resident terms live through the whole forward and backward: the drafter's weights, gradients and optimizer
states (split over the ranks by the ZeRO stage), the frozen embedding and lm_head, the micro-batch, the context
features and every tensor autograd saves for the backward. Transient terms come and go at one moment each: the
fused loss's chunk buffers (at the end of the forward) and the gradient temporaries of one drafter layer (in the
backward); the peak holds the larger of them. With the target online its forward runs beside the step (on a side
thread, on the same GPU), so its weights and its forward's activations are resident too; with data.source=vllm in
this process, so are the device share vLLM reserves (vllm_extract.GPU_MEMORY_UTILIZATION of the device), the
lm_head our side loads and vLLM's capture copied in; an fp8 source's quantisation is one of the forward's moments.

Saved activations are those of the fused kernels (kernels/): the anchored attention saves q, k, v of the context
and of the blocks, its output and lse (no T x T mask, no [Q, T] scores), fc-concat its pre-norm output and rstd,
and the loss kernel computes d loss / d h in its forward (no [N, V] logits are kept, only a chunk of them at a
time: kernels/lm_head_loss.py `chunk_rows`). Everything else is plain torch, whose saved tensors are counted
here op by op (Q = R*A*B block rows, e = the compute dtype's bytes):

    RMSNorm (eager.rms_norm)   fp32 copy of its input (4) + the normalised rows in the input dtype (e), fp32 rstd
    q / k norms                the same on [Q, Hq*D], [Q, Hkv*D] and the context's [R*T, Hkv*D]
    RoPE                       nothing per layer (the cos/sin tables are shared by every layer)
    attention                  q, out [Q, Hq*D]; k, v of the blocks [Q, Hkv*D] and of the context [R*T, Hkv*D]
    SwiGLU MLP                 gate, silu(gate), up and their product [Q, I]

DFlash2 (spec.md §9, dflash_fast/drafter/dflash2.py) adds, per layer, the convolutions around both sublayers as the
fused path runs them (kernels/grouped_dynamic_conv.py): per sublayer, conv_in's kernel saves the normed input (the
kernel projection's input too), the sublayer's projections save conv_in's output, conv_out's kernel saves its input,
and the kernel projection's output [Q, 2 taps H / group] (both convolutions' coefficients, read in place) is kept:
4 [Q, H] saved a layer, and 6 [Q, H] live at the forward's end as measured (tests/test_memory_dflash2.py; the
other two are not attributed), plus the two projection outputs. (The torch twin saves per tap the shifted input and
the broadcast coefficients: (8 taps + 2) [Q, H] a layer, not planned.)
[Q, H] a layer. Its selector, after the loss (the fused path): the Triton norm of the final states (its
input rows, kept for its backward, the normed rows the selector reads and their rstd), the candidates' ids and
[Q, K, r] successor codes (their unary logits come from the lm_head pass and their gradient through one
embedding_bag: no [Q, K, H] gather), the [Q, r] predecessor codes, projection and their product, the K-way
log-softmax; in the backward the two codebooks' [V, r] index gradients at once (transient).

LiLiCorr (docs/lilicorr.md, dflash_fast/drafter/lilicorr.py) runs its lattice transformer over L = (B - 1) K rows
per block, Q (B - 1) K / B rows in all, of width h (lilicorr_hidden_size, 0 = H), MLP width m = int(h mlp_ratio),
factor width F: `lattice_bytes`: the slots' norm(x) [Q, H] it reads, per lattice row the candidate's target
embedding [H] and its five features, the input sum, per layer the two norms' copies, qkv [3h], the attention's
output and the log-sum-exp of its rows, the MLP's [m] twice and the residual stream; then output_norm, the factor
input [3h] and hidden [h], the out / in vectors [F] before and after normalising. The attention with its learned
bias runs as torch's math kernel where no fused kernel takes an additive mask: its [heads, L, L] probabilities per
block and layer are counted (tests/test_memory_lilicorr.py: within 10% of a CPU step). Transient
(w_pen > 0): the teacher's logits at the candidates from their [Q, K, H] lm_head rows.

With activation checkpointing (model.activation_checkpointing) a layer keeps only its input [Q, H]; the layer
the backward is in recomputes its saved tensors, so one layer's worth of them is resident at a time.

The model is checked against the bytes a CPU step allocates (tests/test_memory.py) and is a model, not a
measurement of a GPU: the CUDA caching allocator's fragmentation, NCCL's buffers and the CUDA context (~0.5-1 GB)
are not in it: a plan within a few GiB of the device may still run out.
"""
import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch

from dflash_fast.data.batches import COMPUTE_DTYPE_FIELDS, INT64_FIELDS
from dflash_fast.data.config import OnlineConfig
from dflash_fast.data.source import Source
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.losses import needs_last
from dflash_fast.drafter.weights import trainable_shapes
from dflash_fast.errors import UserError
from dflash_fast.extract.capture import LOGIT_CHUNK
from dflash_fast.extract.vllm_runner import GPU_MEMORY_UTILIZATION
from dflash_fast.kernels.lm_head_loss import GPU_CHUNK_BYTES, GPU_ROW_ALIGN, chunk_rows
from dflash_fast.store.format import Layout, normalise_dtype
from dflash_fast.store.fp8 import FP8, SCALE_FIELDS
from dflash_fast.target.load import device_memory, weight_bytes
from dflash_fast.train.config import TrainConfig
from dflash_fast.train.optim import takes_muon

GIB = 1 << 30
ZERO_STAGES = (0, 1, 2, 3)
# Bytes per parameter of the optimizer's states: an fp32 master copy when the weights are 16-bit, then AdamW's
# two moments, or Muon's one momentum on the matrices (its auxiliary AdamW keeps two moments for the norms).
ADAM_MOMENTS = 8
MUON_MOMENTUM = 4


@dataclasses.dataclass(frozen=True)
class Step:
    """One micro-batch: R rows of T tokens, A anchors per row."""

    seq_len: int
    num_anchors: int
    batch_rows: int = 1


@dataclasses.dataclass(frozen=True)
class OnlineTarget:
    """The sizes of a target that runs in the job (data.source=online)."""

    weight_bytes: int  # its weights as loaded (target.weight_bytes)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    forward_tokens: int  # padded tokens of one forward (data.online: max(batch_tokens, max_seq_len))
    num_tapped: int  # K, the layer ids the forward keeps
    engine: str = "hf"  # hf: the whole target runs here; vllm (vllm_serve: served elsewhere): vLLM runs it, we hold
    # its lm_head and the capture
    fp8: bool = False  # the taps are quantised to fp8 (data.online.dtype=fp8), through fp32 copies
    engine_bytes: int = 0  # vllm: the device share vLLM takes (gpu_memory_utilization of the device's bytes)


@dataclasses.dataclass(frozen=True)
class Setup:
    """How the step runs: everything but the drafter's sizes and the step's shape."""

    dtype_bytes: int = 2  # the compute dtype: 2 (bf16), 4 (fp32)
    # The store's fields (Layout.from_manifest): the micro-batch's and the teacher's top-k; a step needs it.
    store: Optional[Layout] = None
    zero_stage: int = 2
    world_size: int = 1
    optimizer: str = "adamw"  # adamw | muon
    dense_teacher: bool = True  # the loss reads `last` (kl and the other dense kinds), else the stored top-k
    checkpointing: bool = False  # activation checkpointing of the drafter layers
    bucket_elements: int = 0  # DeepSpeed's reduce bucket (ZeRO-1/2), in elements of the compute dtype
    tied_embeddings: bool = False  # the target's lm_head is its embedding (one [V, H] tensor)
    online: Optional[OnlineTarget] = None
    loss_chunk_bytes: int = GPU_CHUNK_BYTES  # the loss kernel's chunk budget (kernels/lm_head_loss.py)
    loss_row_align: int = GPU_ROW_ALIGN


@dataclasses.dataclass
class Plan:
    """Bytes per rank: `resident` terms add up, of the `transient` ones only the largest counts."""

    resident: Dict[str, int]
    transient: Dict[str, int]
    setup: Setup

    @property
    def peak(self) -> int:
        return sum(self.resident.values()) + max(self.transient.values(), default=0)

    def lines(self) -> str:
        width = max(len(name) for name in (*self.resident, *self.transient))
        rows = [f"  {name:<{width}}  {gib(b):>9}" for name, b in self.resident.items()]
        rows += [f"  {name:<{width}}  {gib(b):>9}  (transient)" for name, b in self.transient.items()]
        return "\n".join(rows + [f"  {'peak per rank':<{width}}  {gib(self.peak):>9}"])


def run_setup(cfg: TrainConfig, ds: Dict, world_size: int, dtype_bytes: int, dense_teacher: bool, store: Layout,
              online: Optional[OnlineTarget] = None) -> Setup:
    """The Setup of a training run: its config, its completed DeepSpeed JSON (optim.deepspeed_config), its world
    size and compute dtype, whether its loss reads `last`, its store's Layout."""
    zero = ds.get("zero_optimization", {})
    return Setup(dtype_bytes=dtype_bytes, store=store, zero_stage=zero.get("stage", 0), world_size=world_size,
                 optimizer=cfg.optimizer.kind, dense_teacher=dense_teacher,
                 checkpointing=cfg.model.activation_checkpointing,
                 bucket_elements=int(zero.get("reduce_bucket_size", 0)), online=online)


def gib(b: float) -> str:
    """Bytes in GiB (MiB below one GiB), for the plan's lines."""
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.2f} MiB"


def training_states(cfg: DrafterConfig, setup: Setup) -> Dict[str, int]:
    """The drafter's weights, gradients and optimizer states on one rank (ZeRO: stage 1 splits the optimizer
    states over the ranks, 2 the gradients too, 3 the weights too), and its frozen embedding and lm_head."""
    shapes = trainable_shapes(cfg)
    params = sum(math.prod(s) for s in shapes.values())
    # Muon takes every tensor of two or more dimensions but embeddings (DeepSpeed's use_muon, optim.takes_muon):
    # DFlash2's [2, taps, H] base kernels and [V, r] codebooks too, not LiLiCorr's slot and rank embeddings.
    matrices = sum(math.prod(s) for name, s in shapes.items() if takes_muon(name, s))
    e, w, stage = setup.dtype_bytes, setup.world_size, setup.zero_stage
    master = 4 * params if e < 4 else 0
    if setup.optimizer == "muon":
        moments = MUON_MOMENTUM * matrices + ADAM_MOMENTS * (params - matrices)
    else:
        moments = ADAM_MOMENTS * params
    split = lambda b, from_stage: -(-b // w) if stage >= from_stage else b  # noqa: E731
    h = cfg.hidden_size
    frozen = cfg.vocab_size * h * e * (1 if setup.tied_embeddings else 2) + 4 * h
    terms = {
        "weights": split(params * e, 3),
        "gradients": split(params * e, 2),
        "optimizer states": split(master + moments, 1),
        "frozen embedding + lm_head": frozen,
    }
    if stage in (1, 2) and setup.bucket_elements:
        terms["DeepSpeed reduce bucket"] = setup.bucket_elements * e
    return terms


def batch_bytes(step: Step, setup: Setup) -> int:
    """The micro-batch on the device (dflash_fast.data.batches, data.to_device): per token the store's fields
    (Layout.fields: the teacher's top-k logits and lse in float32 whatever the store's dtype) less the fp8 scales,
    the ids widened to int64, `hidden` and `last` (only when the loss reads it) in the compute dtype; and the
    document and position ids [R, T] int64, the anchors [R, A] int64 and their validity [R, A] bool, and the count of
    document pieces the loader dropped as non-finite [R] int64."""
    per_token = 8 + 8  # document_ids, position_ids
    for name, (_, shape, dtype) in setup.store.fields().items():
        if name in SCALE_FIELDS.values() or (name == "last" and not setup.dense_teacher):
            continue
        size = setup.dtype_bytes if name in COMPUTE_DTYPE_FIELDS else 8 if name in INT64_FIELDS else dtype.itemsize
        per_token += size * math.prod(shape)
    return step.batch_rows * (step.seq_len * per_token + step.num_anchors * 9 + 8)


def layer_block_bytes(cfg: DrafterConfig, q: int, e: int) -> int:
    """What one drafter layer saves for its backward over Q block rows (module docstring)."""
    h, qd, kvd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    norms = 2 * ((4 + e) * q * h + 4 * q)
    queries = (4 + e) * q * qd + 4 * q * cfg.num_attention_heads + 2 * e * q * qd + 4 * q * cfg.num_attention_heads
    keys = (4 + e) * q * kvd + 4 * q * cfg.num_key_value_heads + 2 * e * q * kvd
    mlp = 4 * e * q * cfg.intermediate_size
    taps = cfg.conv_kernel_size  # DFlash2's convolutions on the fused path (module docstring)
    conv = (6 * q * h + 2 * q * 2 * taps * (h // cfg.conv_group_size)) * e if taps else 0
    return norms + queries + keys + mlp + conv


def selector_bytes(cfg: DrafterConfig, q: int, e: int) -> int:
    """What DFlash2's candidate selector saves for the backward over Q block rows on the fused path (module
    docstring): the Triton norm's input rows (the final states, kept for its backward) and output (2e bytes an
    entry of [Q, H]) and rstd; per candidate its successor code [r]
    in the compute dtype, its id (int64) and log-softmax (fp32); the [Q, r] predecessor codes, hidden projection and
    their product; per row the previous token, the label's index and the draft (int64), recall and hit (bool), its
    weight (fp32). No [Q, K, H] rows: the candidates' unary logits come from the lm_head pass (CandidateUnary). 0
    without a selector."""
    if not cfg.selector_rank:
        return 0
    h, r, k = cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k
    return q * (2 * e * h + 4 + 3 * e * r + 3 * 8 + 2 + 4) + q * k * (r * e + 8 + 4)


def selector_backward_bytes(cfg: DrafterConfig, e: int) -> int:
    """The selector's backward (transient): the two codebooks' index gradients [V, r] at once (their whole shape,
    before they are added into the gradients); the [Q, K, r] and [Q, H] gradients before them are smaller and freed
    by then (a model of the peak, checked in tests/test_memory_dflash2.py)."""
    return 2 * e * cfg.selector_rank * cfg.vocab_size


def lattice_bytes(cfg: DrafterConfig, q: int, e: int) -> int:
    """What LiLiCorr's lattice saves for the backward over Q block rows (module docstring); 0 without it."""
    k = cfg.lilicorr_candidate_topk
    if not k:
        return 0
    blocks, h = q // cfg.block_size, cfg.lilicorr_hidden_size or cfg.hidden_size
    length = (cfg.block_size - 1) * k
    rows, m, f = blocks * length, int(h * cfg.lilicorr_mlp_ratio), cfg.lilicorr_factor_dim
    heads = cfg.lilicorr_num_heads
    per_layer = rows * (2 * (4 + e) * h + 8 + 3 * e * h + 2 * e * h + 4 * heads + 2 * e * m + e * h)
    per_layer += 4 * blocks * heads * length * length  # the biased attention's probabilities (math kernel)
    front = rows * (e * cfg.hidden_size + 4 * 5 * 2 + e * 2 * h + 8)
    back = rows * ((4 + e) * h + 3 * e * h + 2 * e * h + 4 * e * f)
    lattice_input = q * (e * cfg.hidden_size + 4)  # norm(x) of every slot (the head's pass_hidden) and its rstd
    return lattice_input + front + cfg.lilicorr_num_layers * per_layer + back


def lattice_transient_bytes(cfg: DrafterConfig, q: int, e: int) -> int:
    """LiLiCorr's distractor penalty: the candidates' [Q (B - 1) / B, K, H] lm_head rows it reads the teacher's logits
    from (freed before the backward); 0 without LiLiCorr."""
    k = cfg.lilicorr_candidate_topk
    return q * (cfg.block_size - 1) // cfg.block_size * k * cfg.hidden_size * e if k else 0


def layer_context_bytes(cfg: DrafterConfig, tokens: int, e: int) -> int:
    """What one drafter layer saves of the context keys and values over `tokens` = R*T positions: k_norm's input
    and output, k and v (the anchored attention's inputs)."""
    kvd = cfg.num_key_value_heads * cfg.head_dim
    return (4 + e) * tokens * kvd + 4 * tokens * cfg.num_key_value_heads + 2 * e * tokens * kvd


def loss_chunk(cfg: DrafterConfig, n: int, tokens: int, setup: Setup) -> Tuple[int, int]:
    """(drafter rows per chunk, teacher rows per chunk at most) of the fused loss over n block rows
    (kernels/lm_head_loss.py chunk_rows with the GPU's budget). A chunk's teacher rows are the distinct positions
    its rows' teachers sit at (chunk_plan): at most one per drafter row and per token; blocks that overlap (anchors
    closer than B) share them, so the kernel may allocate fewer."""
    rows = chunk_rows(n, cfg.vocab_size, setup.dtype_bytes, setup.dense_teacher, 1, setup.loss_chunk_bytes,
                      setup.loss_row_align)
    return rows, min(rows, tokens) if setup.dense_teacher else 0


def loss_kernel_bytes(cfg: DrafterConfig, n: int, tokens: int, setup: Setup, teacher_rows: Optional[int] = None) -> int:
    """The fused loss kernel's buffers over n block rows, beyond its inputs and outputs: one chunk's fp32 logits of
    its rows and teacher rows, their dlogits, the normed rows, their fp32 and input-dtype gradients, the vocabulary
    tiles' softmax partials (what bench/lm_head_model.py reports as the call's peak_extra). teacher_rows: the most
    distinct teacher rows of any chunk where known (chunk_plan of a sampled batch), else loss_chunk's bound."""
    rows, teacher = loss_chunk(cfg, n, tokens, setup)
    if teacher_rows is not None and setup.dense_teacher:
        teacher = teacher_rows
    v, h, e = cfg.vocab_size, cfg.hidden_size, setup.dtype_bytes
    tiles = -(-v // 128)
    logits = (rows + teacher) * v * 4 + rows * v * e
    acts = 2 * (rows + teacher) * h * e + rows * h * (4 + 2 * e)
    return logits + acts + 12 * tiles * (rows + teacher)


def loss_workspace(cfg: DrafterConfig, n: int, tokens: int, setup: Setup) -> int:
    """What the loss holds while it runs over n block rows (transient): the kernel's buffers, the final layer's
    output states [n, H] and the gathered stored top-k ids [n, k]."""
    return (loss_kernel_bytes(cfg, n, tokens, setup) + setup.dtype_bytes * n * cfg.hidden_size
            + 8 * setup.store.topk * n)


def layer_backward_bytes(cfg: DrafterConfig, q: int, tokens: int, e: int) -> int:
    """The gradient temporaries of one layer's backward (transient): the incoming gradient [Q, H], then the largest
    of the MLP's (d of the down projection's input [Q, I] with its weight gradient [H, I]; then d gate, d up and
    d product [Q, I]) and the attention's (dq, dk, dv of blocks and context)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    mlp = max(e * (q * i + i * h), 3 * e * q * i)
    attention = 2 * e * q * qd + 2 * e * (q + tokens) * kvd + 8 * q * cfg.num_attention_heads
    return e * q * h + max(mlp, attention)


def online_forward_bytes(target: OnlineTarget, e: int, chunk: int = LOGIT_CHUNK) -> int:
    """The online source's target forward over its forward_tokens positions (capture.TargetRunner), the largest of
    its moments: in a decoder layer, the K tapped layers kept so far (target.LayerTaps) beside the layer's working
    set (the embeddings, the layer's input, its residual and normed input [T, H], the MLP's gate, up and product
    [T, I]); then `last` [T, H] beside the teacher's chunk of `chunk` rows (capture.LOGIT_CHUNK) (fp32 logits and
    logsumexp's fp32 temporary, 8 bytes an entry; the tapped layers are on the host by then). No [T, V] logits and
    no other layer's hidden states are kept.

    engine=vllm (vllm_extract.VllmRunner): vLLM's forward is in its own share (engine_bytes); ours holds the capture
    copied in, its K + 1 aux layers [T, K+1, H] (`last` a view of them) and the K taps gathered out of them, then
    the aux layers beside the teacher's chunk.

    fp8 (fp8.quantize_fp8 of the taps [T, K, H], with the taps and `last` held): an fp32 copy of the taps (none
    when they are fp32 already), x / scale and its clamp, 12 (fp32: 8) bytes an entry beside them."""
    h, k, tokens = target.hidden_size, target.num_tapped, target.forward_tokens
    if target.engine in ("vllm", "vllm_serve"):
        held = tokens * (2 * k + 1) * h * e  # the aux layers and the taps gathered out of them
        forward, after = held, tokens * (k + 1) * h * e
    else:
        forward = tokens * (k * h + 4 * h + 3 * target.intermediate_size) * e
        held, after = tokens * (k + 1) * h * e, tokens * h * e
    teacher = after + min(chunk, tokens) * target.vocab_size * 8
    quantise = held + tokens * k * h * (12 if e < 4 else 8) if target.fp8 else 0
    return max(forward, teacher, quantise)


def step_memory(cfg: DrafterConfig, step: Step, setup: Setup) -> Plan:
    """The Plan of one training step of the drafter `cfg` on one rank (module docstring)."""
    e, r = setup.dtype_bytes, step.batch_rows
    tokens = r * step.seq_len
    q = r * step.num_anchors * cfg.block_size
    h, layers = cfg.hidden_size, cfg.num_layers
    rotary = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    resident = training_states(cfg, setup)
    resident["micro-batch"] = batch_bytes(step, setup)
    if setup.online is not None:
        if setup.online.engine_bytes:
            resident["vLLM engine (gpu_memory_utilization)"] = setup.online.engine_bytes
        resident["online target weights"] = setup.online.weight_bytes
        resident["online target forward"] = online_forward_bytes(setup.online, e)
    resident["context (fc-concat)"] = 2 * e * tokens * h + 4 * tokens
    resident["RoPE tables"] = 2 * e * (q + tokens) * rotary
    block, context = layer_block_bytes(cfg, q, e), layer_context_bytes(cfg, tokens, e)
    if setup.checkpointing:
        resident["layer inputs (checkpointed)"] = layers * e * q * h
        resident["saved activations, one layer"] = block + context
    else:
        resident["saved activations, blocks"] = layers * block
        resident["saved activations, context k/v"] = layers * context
    resident["loss: d h and per-slot rows"] = e * q * h + (69 + 8 * setup.store.topk) * q
    transient = {
        "loss kernel chunk": loss_workspace(cfg, q, tokens, setup),
        "one layer's backward": layer_backward_bytes(cfg, q, tokens, e),
    }
    if cfg.selector_rank:
        resident["DFlash2 selector (saved)"] = selector_bytes(cfg, q, e)
        transient["DFlash2 selector's backward"] = selector_backward_bytes(cfg, e)
    if cfg.lilicorr_candidate_topk:
        resident["LiLiCorr lattice (saved)"] = lattice_bytes(cfg, q, e)
        transient["LiLiCorr candidate rows"] = lattice_transient_bytes(cfg, q, e)
    return Plan(resident, transient, setup)


def largest(fits: Callable[[int], bool], low: int, high: int) -> Optional[int]:
    """The largest n in [low, high] with fits(n), for fits monotone (true then false); None if not even low."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def largest_fitting(cfg: DrafterConfig, step: Step, setup: Setup, room: int,
                    max_seq_len: int = 1 << 21) -> Tuple[Optional[int], Optional[int]]:
    """(largest T at the step's A, largest A at the step's T) whose peak fits `room` bytes; None where not even the
    least does (T = A + 1, A = 1)."""
    t = largest(lambda n: step_memory(cfg, dataclasses.replace(step, seq_len=n), setup).peak <= room,
                step.num_anchors + 1, max_seq_len)
    a = largest(lambda n: step_memory(cfg, dataclasses.replace(step, num_anchors=n), setup).peak <= room,
                1, step.seq_len - 1)
    return t, a


def step_of(cfg: TrainConfig) -> Step:
    """The micro-batch of a run's config: data.seq_len, data.num_anchors, data.batch_rows."""
    return Step(cfg.data.seq_len, cfg.data.num_anchors, cfg.data.batch_rows)


def online_target(target: str, dtype: torch.dtype, online: OnlineConfig, num_tapped: int, engine: str = "hf",
                  limit: Optional[int] = None) -> OnlineTarget:
    """The sizes of the target a data.source=online (engine hf) or vllm run holds on this device, from its
    config.json and safetensors headers, and the number of layer ids it taps. vllm: our side loads the lm_head
    alone ([V, H]; the final norm's [H] besides), and vLLM takes GPU_MEMORY_UTILIZATION of the device's `limit`
    bytes (none known: not counted)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, e = text.hidden_size, dtype.itemsize
    if engine in ("vllm", "vllm_serve"):  # vllm_serve: the engine is elsewhere, no share of this device
        loaded = (text.vocab_size + 1) * h * e
        share = int(GPU_MEMORY_UTILIZATION * (limit or 0)) if engine == "vllm" else 0
    else:
        loaded, share = weight_bytes(target, dtype) or 0, 0
    return OnlineTarget(loaded, text.num_hidden_layers, h, getattr(text, "intermediate_size", None) or 4 * h,
                        text.vocab_size, max(online.batch_tokens, online.max_seq_len), num_tapped, engine,
                        normalise_dtype(online.dtype) == FP8, share)


def run_plan(cfg: TrainConfig, drafter: DrafterConfig, ds: Dict, world_size: int, dtype: torch.dtype,
             loss_kind: str, manifest: Dict, target: str, limit: Optional[int] = None) -> Plan:
    """The Plan of a run's step: its config, drafter, completed DeepSpeed JSON (optim.deepspeed_config), world size,
    compute dtype, loss kind, and its store's manifest (or the online source's); `limit`, the device's bytes
    (None: no device), sizes the share an in-process vLLM takes (data.source=vllm)."""
    share = Source.of(cfg.data).device_share  # vLLM served elsewhere: nothing on this device
    online = None if share is None else online_target(target, dtype, cfg.data.online, len(manifest["layer_ids"]),
                                                      share, limit if share == "vllm" else None)
    setup = run_setup(cfg, ds, world_size, dtype.itemsize, needs_last(loss_kind, stored_labels=True),
                      Layout.from_manifest(manifest), online)
    return step_memory(drafter, step_of(cfg), setup)


def device_bytes() -> Optional[int]:
    """This rank's GPU memory in bytes; None without a GPU (a CPU run has no device limit to check)."""
    if not torch.cuda.is_available():
        return None
    return device_memory(torch.device("cuda", torch.cuda.current_device()))


def check_fits(plan: Plan, limit: Optional[int], cfg: TrainConfig) -> str:
    """Refuse, before anything is allocated, a run whose plan exceeds `limit` bytes per rank (default: the GPU's;
    a CPU has none), naming both; else the log line of the plan."""
    limit = device_bytes() if limit is None else limit
    if limit is None or plan.peak <= limit:
        return f"memory plan: {gib(plan.peak)} per rank at the peak of a step (train.py --plan shows its terms)"
    d = cfg.data
    raise UserError(
        f"the memory plan of this run needs {plan.peak:,} bytes ({gib(plan.peak)}) per rank at the peak of a step, "
        f"but the device has {limit:,} bytes ({gib(limit)}): lower data.seq_len={d.seq_len}, "
        f"data.num_anchors={d.num_anchors} or data.batch_rows={d.batch_rows}, set "
        f"model.activation_checkpointing=true, or use a higher ZeRO stage or more ranks; `train.py --plan` prints "
        f"the plan's terms and the largest data.seq_len and data.num_anchors that fit (docs/memory.md)"
    )
