"""The memory model (dflash_fast/train/memory.py) against what a CPU step allocates, term by term, within 10%.

The step runs the fused kernels (under TRITON_INTERPRET=1) in fp32 at small shapes; `LiveBytes` counts the bytes
of every tensor storage created inside it while it is alive, as torch.cuda.max_memory_allocated would on a GPU
without its caching. The Triton interpreter's host copies of a launch's arguments (a GPU launch makes none) are
in-place copies into storages created outside torch's dispatch, so they are not counted. Each term is compared
with the measurement it predicts, so that dropping any one of them from the model fails a check here.
"""
import dataclasses
import math
import os
import re
import weakref

import numpy as np
import pytest
import torch
from test_store import write_store
from test_trainer import TINY_YAML, losses, run, settings, tiny  # noqa: F401 (tiny is a fixture)
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_fast.data.batches import collate_rows, pack_rows, row_fields, sample_anchors
from dflash_fast.drafter import backbone as drafter_module
from dflash_fast.drafter import ops
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.drafter.weights import trainable_parameters, trainable_shapes
from dflash_fast.store.format import Layout
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.train import trainer
from dflash_fast.train.data import to_device
from dflash_fast.train.memory import (
    OnlineTarget,
    Setup,
    Step,
    batch_bytes,
    largest,
    layer_backward_bytes,
    layer_block_bytes,
    layer_context_bytes,
    loss_workspace,
    online_forward_bytes,
    step_memory,
    training_states,
)

H, V, K, B, T, A, INTER = 64, 256, 3, 4, 64, 8, 160
TOPK = 8
# The interpreter's chunk budget and row alignment of the loss kernel (kernels/lm_head_loss.py off the GPU).
SETUP = Setup(dtype_bytes=4, store=Layout(K, H, TOPK, "float32", has_last=True), zero_stage=0,
              loss_chunk_bytes=1 << 16, loss_row_align=16)
STATES = ("weights", "gradients", "optimizer states", "frozen embedding + lm_head", "micro-batch")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode and still referenced, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs = {}  # storage pointer -> [live tensors, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ARG002 (the protocol's signature)
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if ptr in self._refs:
                self._refs[ptr][0] += 1
            elif ptr in inputs or size == 0:  # a view, an in-place or out= op: nothing allocated
                continue
            else:
                self._refs[ptr] = [1, size]
                self.live += size
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, ptr)
        return out

    def _release(self, ptr: int) -> None:
        ref = self._refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[ptr]
            self.live -= ref[1]


def config(layers: int) -> DrafterConfig:
    return DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=INTER, vocab_size=V, layer_ids=[0, 1, 2], target_num_layers=4,
                         target_hidden_size=H, mask_token_id=V - 1, num_layers=layers, block_size=B)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    loss_mask, doc = torch.ones(T, dtype=torch.bool), torch.zeros(T, dtype=torch.long)
    anchors, valid = sample_anchors(loss_mask, doc, A, g)
    logits = torch.randn(1, T, V, generator=g)
    top = logits.topk(TOPK, -1)
    return dict(input_ids=torch.randint(0, V - 1, (1, T), generator=g), loss_mask=loss_mask[None],
                document_ids=doc[None], position_ids=torch.arange(T)[None],
                hidden=torch.randn(1, T, K, H, generator=g), last=torch.randn(1, T, H, generator=g),
                teacher_topk_ids=top.indices, teacher_topk_logits=top.values, teacher_lse=logits.logsumexp(-1),
                anchors=anchors[None], anchor_valid=valid[None])


def drafter(layers: int, checkpointing: bool = False) -> DFlashDrafter:
    torch.manual_seed(0)
    d = DFlashDrafter(config(layers))
    d.set_frozen(torch.randn(V, H), torch.randn(V, H), torch.ones(H))
    d.checkpoint_layers = checkpointing
    for p in d.parameters():
        p.grad = torch.zeros_like(p)  # a later step's gradients: there before the forward
    return d


@dataclasses.dataclass
class Measured:
    forward_end: int  # live after the forward: what the backward needs
    forward_peak: int
    backward_peak: int  # the most the backward holds beyond forward_end
    step_peak: int


def measure(layers: int, checkpointing: bool = False) -> Measured:
    d, b = drafter(layers, checkpointing), batch()
    with ops.backend("triton"):
        live = LiveBytes()
        with live:
            out = d(b, loss_kind="kl")
            forward_end, forward_peak = live.live, live.peak
            live.peak = live.live
            out.loss.backward()
    return Measured(forward_end, forward_peak, live.peak - forward_end, max(forward_peak, live.peak))


@pytest.fixture(scope="module")
def one_layer():
    return measure(1)


@pytest.fixture(scope="module")
def two_layers():
    return measure(2)


def within(measured: float, modelled: float, what: str) -> None:
    assert abs(modelled - measured) <= 0.1 * measured, f"{what}: modelled {modelled:,} vs measured {measured:,}"


def test_saved_activations_of_one_layer_match_the_model(one_layer, two_layers):
    q = A * B
    within(two_layers.forward_end - one_layer.forward_end,
           layer_block_bytes(config(1), q, 4) + layer_context_bytes(config(1), T, 4), "one layer's saved tensors")


def test_what_the_layers_share_matches_the_model(one_layer):
    plan = step_memory(config(1), Step(T, A), SETUP)
    per_layer = ("saved activations, blocks", "saved activations, context k/v")
    shared = sum(v for k, v in plan.resident.items() if k not in STATES + per_layer)
    within(one_layer.forward_end - plan.resident["saved activations, blocks"]
           - plan.resident["saved activations, context k/v"], shared, "context, RoPE tables, the loss's d h")


def test_loss_kernel_workspace_matches_the_model(two_layers):
    within(two_layers.forward_peak - two_layers.forward_end,
           loss_workspace(config(2), A * B, T, SETUP), "the loss kernel's chunk buffers")


def test_one_layers_backward_matches_the_model(two_layers):
    within(two_layers.backward_peak, layer_backward_bytes(config(2), A * B, T, 4), "one layer's backward")


def test_step_peak_matches_the_model(two_layers):
    plan = step_memory(config(2), Step(T, A), SETUP)
    within(two_layers.step_peak, plan.peak - sum(plan.resident[k] for k in STATES), "the step's peak")


def test_checkpointing_keeps_one_input_per_layer():
    checkpointed = [measure(n, checkpointing=True) for n in (1, 2)]
    plans = [step_memory(config(n), Step(T, A), dataclasses.replace(SETUP, checkpointing=True)) for n in (1, 2)]
    within(checkpointed[1].forward_end - checkpointed[0].forward_end,
           plans[1].resident["layer inputs (checkpointed)"] - plans[0].resident["layer inputs (checkpointed)"],
           "a checkpointed layer")
    plan = plans[1]
    within(checkpointed[1].step_peak, plan.peak - sum(plan.resident[k] for k in STATES), "the checkpointed peak")


def test_batch_and_training_states_match_the_model():
    stored = sum(t.numel() * t.element_size() for t in batch().values())
    within(stored, batch_bytes(Step(T, A), SETUP), "the micro-batch")
    d = drafter(2)
    opt = torch.optim.AdamW(d.parameters())
    opt.step()
    states = training_states(config(2), SETUP)
    held = sum(s.numel() * s.element_size() for st in opt.state.values() for s in st.values() if s.dim())
    within(held, states["optimizer states"], "AdamW's states")
    within(sum(p.numel() * 4 for p in d.parameters()), states["weights"], "the weights")
    assert trainable_parameters(config(2)) * 4 == states["gradients"]


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_planned_micro_batch_is_the_collated_batch_for_every_store_dtype(store_dtype, tmp_path):
    """The plan's micro-batch is the bytes of the batch the trainer moves to its device, whatever the store's dtype
    (the teacher's top-k logits and lse stay float32) and the compute dtype."""
    write_store(tmp_path, Layout(num_tapped=3, hidden_size=16, topk=4, dtype=store_dtype, has_last=True))
    store = HiddenStateStore(str(tmp_path))
    seq_len, anchors = 8, 3
    rows = pack_rows(store.lengths, seq_len)[:2]
    for compute, with_last in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
        b = to_device(collate_rows(store, rows, [0, 1], seq_len, anchors, row_fields(store, with_last)), "cpu", compute)
        setup = Setup(dtype_bytes=compute.itemsize, store=Layout.from_manifest(store.manifest), dense_teacher=with_last)
        assert batch_bytes(Step(seq_len, anchors, len(rows)), setup) == sum(t.nbytes for t in b.values()), (
            compute, with_last)


def profiled_peak(fn) -> int:
    """The most bytes fn's own allocations hold at once, from torch's profiler memory events (they see the
    temporaries made inside one ATen op, logsumexp's for one, which LiveBytes does not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def online_forward_peak(monkeypatch, sizes, layer_ids, layout):
    """The profiled peak of one plain (non-parity) batch through the online source's target forward
    (capture.TargetRunner) on a seeded tiny Qwen3 of `sizes` = (hidden, inter, vocab, tokens, layers)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_fast.extract import capture
    from dflash_fast.target.records import Example

    hidden, inter, vocab, tokens, layers = sizes
    real = capture._to_numpy  # a GPU run's host copy is host memory; on the CPU it would be the tensor itself
    monkeypatch.setattr(capture, "_to_numpy", lambda t: real(t).copy())
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=hidden // 4, num_hidden_layers=layers)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    runner = capture.TargetRunner(target, layer_ids, layout, 0, parity_every=2)
    example = Example(np.arange(tokens, dtype=np.int32) % vocab, np.ones(tokens, dtype=bool))
    runner([example])  # the parity batch; the measured one is a plain batch
    return profiled_peak(lambda: runner([example]))


@pytest.mark.parametrize("hidden, inter, vocab, tokens, layers, chunk", [
    (128, 512, 384, 256, 12, 2048),  # the peak in a layer's MLP: 12 layers' states would be more
    (64, 128, 4096, 512, 4, 128),  # the peak in the teacher's chunk: [T, V] logits would be 4 times more
])
def test_online_target_forward_keeps_what_the_model_says(hidden, inter, vocab, tokens, layers, chunk, monkeypatch):
    """The online source's target forward (capture.TargetRunner, the one extraction runs) holds its tapped layers,
    one layer's working set, then `last` and one chunk of teacher logits: no [T, V] logits, no other layer's
    states, whatever T is."""
    from dflash_fast.extract import capture

    monkeypatch.setattr(capture, "LOGIT_CHUNK", chunk)
    layer_ids = [0, layers // 2, layers - 1]  # L-1: `last`
    measured = online_forward_peak(monkeypatch, (hidden, inter, vocab, tokens, layers), layer_ids,
                                   Layout(3, hidden, 4, "float32", True))
    modelled = online_forward_bytes(OnlineTarget(0, layers, hidden, inter, vocab, tokens, len(layer_ids)), 4, chunk)
    within(measured, modelled, "the online target's forward")


def test_16_bit_adamw_keeps_an_fp32_master_and_two_moments():
    """ZeRO's count for mixed-precision Adam (Rajbhandari et al. 2020): 2 + 2 + 12 bytes per parameter."""
    params = trainable_parameters(config(2))
    states = training_states(config(2), Setup(dtype_bytes=2, zero_stage=0))
    assert (states["weights"], states["gradients"], states["optimizer states"]) == (2 * params, 2 * params,
                                                                                  12 * params)
    assert training_states(config(2), Setup(dtype_bytes=4, zero_stage=0))["optimizer states"] == 8 * params


def test_zero_stages_split_states_over_the_ranks():
    cfg = config(2)
    whole = training_states(cfg, Setup(zero_stage=0, world_size=8))
    for stage, split in ((1, {"optimizer states"}), (2, {"optimizer states", "gradients"}),
                         (3, {"optimizer states", "gradients", "weights"})):
        part = training_states(cfg, Setup(zero_stage=stage, world_size=8))
        for key in ("weights", "gradients", "optimizer states"):
            assert part[key] == (-(-whole[key] // 8) if key in split else whole[key]), (stage, key)
    matrices = sum(math.prod(s) for s in trainable_shapes(cfg).values() if len(s) == 2)
    params = trainable_parameters(cfg)
    # Muon: the fp32 master, one momentum on the matrices, its auxiliary AdamW's two moments on the norms
    assert training_states(cfg, Setup(optimizer="muon"))["optimizer states"] == (4 * params + 4 * matrices
                                                                                 + 8 * (params - matrices))


def test_largest_finds_the_last_size_that_fits():
    assert largest(lambda n: n * n <= 1000, 1, 10**6) == 31
    assert largest(lambda n: n <= 0, 1, 10) is None


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_checkpointed_layers_give_the_same_loss_and_gradients(backend, monkeypatch):
    calls = []
    checkpoint = drafter_module.checkpoint
    monkeypatch.setattr(drafter_module, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    b = batch(seed=1)
    results = []
    for checkpointing in (False, True):
        d = drafter(2, checkpointing)
        with ops.backend(backend):
            loss = d(b, loss_kind="kl", noise_std=0.1, seed=3).loss
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}))
    assert len(calls) == 2  # the checkpointed forward went through torch.utils.checkpoint, once a layer
    (plain, plain_grads), (ckpt, ckpt_grads) = results
    torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, grad in plain_grads.items():
        assert grad.abs().sum() > 0 or name.startswith("layers.0.self_attn.k_norm"), name
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- train.py --plan and the refusal


def test_plan_prints_the_peak_and_the_largest_sizes_that_fit(tiny, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "run")
    trainer.main(["--config", TINY_YAML, "--plan", "--device-memory", "4e9", *settings(tiny, out)])
    text = capsys.readouterr().out
    assert "peak per rank" in text and "fits" in text
    longest = int(re.search(r"largest data\.seq_len at data\.num_anchors=8: (\d+)", text).group(1))
    most = int(re.search(r"largest data\.num_anchors at data\.seq_len=64: (\d+)", text).group(1))
    assert longest > 64 and most == 63  # the tiny drafter fits far longer rows; 63 anchors is all a row holds
    assert not os.path.exists(out)  # nothing trained, nothing written
    trainer.main(["--config", TINY_YAML, "--plan", *settings(tiny, out, model__activation_checkpointing="true")])
    assert "activation checkpointing on" in capsys.readouterr().out


def test_a_run_whose_plan_exceeds_the_device_refuses_to_start_naming_both(tiny, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        trainer.main(["--config", TINY_YAML, "--device-memory", "1000000", *settings(tiny, out)])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the memory plan of this run needs "), err
    assert "but the device has 1,000,000 bytes" in err[0] and "data.seq_len=64" in err[0]
    assert not os.path.exists(out)  # a run that cannot start creates no output_dir (the lock removes it)


def test_plan_of_an_online_run_holds_the_target(tiny, tmp_path, capsys):  # noqa: F811
    online = settings(tiny, str(tmp_path / "run"), data__source="online", data__jsonl=str(tiny.root / "data.jsonl"),
                      model__target=tiny.target, model__layer_ids="[1,2]", data__online__max_seq_len=64)
    trainer.main(["--config", TINY_YAML, "--plan", *online])
    text = capsys.readouterr().out
    assert float(re.search(r"online target weights\s+([\d.]+) [MG]iB", text).group(1)) > 0
    assert float(re.search(r"online target forward\s+([\d.]+) [MG]iB", text).group(1)) > 0


def test_activation_checkpointing_reaches_the_trained_drafter(tiny, tmp_path, monkeypatch):  # noqa: F811
    calls = []
    checkpoint = drafter_module.checkpoint
    monkeypatch.setattr(drafter_module, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    out = str(tmp_path / "checkpointed")
    run(tiny, out, schedule__steps=2, export="false", model__activation_checkpointing="true")
    assert len(calls) == 2 * 1 * 1  # 2 steps x 1 micro-batch x 1 layer (validation runs without gradients)
    assert len(losses(out)) == 2
