"""Extraction: what lands in the store is exactly what the target computes (spec.md §1-2).

Targets are tiny random models built in code (tests/tiny_targets.py), run in
fp32 and stored in fp32 so that "equal" means bit-equal where the forward is
the same.
"""
import functools
import json
import os
import re
import shutil
import threading

import numpy as np
import pytest
import torch
from tiny_targets import make_tiny_target, make_tokenizer, sample_records, write_jsonl

from dflash_fast import cli
from dflash_fast.data.batches import make_loader
from dflash_fast.data.config import DataConfig
from dflash_fast.errors import UserError
from dflash_fast.extract import capture as capture_module
from dflash_fast.extract import extract as extract_module
from dflash_fast.extract import runners as runners_module
from dflash_fast.extract.extract import extract
from dflash_fast.store.format import MANIFEST, Layout
from dflash_fast.store.fp8 import dequantize_fp8
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.store.writer import ShardWriter
from dflash_fast.target import load as target_module
from dflash_fast.target.norm import final_norm_weight, rms_norm
from dflash_fast.target.records import ChatTokenizer, Example, read_examples

NUM_LAYERS = 6
LAYER_IDS = [0, 2, 4, 5]  # includes the first and the last decoder layer
# The extraction contract holds for every architecture docs/targets.md lists as tested.
CONTRACT_ARCHS = ["qwen3", "llama", "qwen3_5", "qwen3_moe", "gpt_oss", "qwen3_vl", "qwen3_5_vl"]


class Targets(dict):
    """arch -> a tiny saved target, built on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        self[arch] = make_tiny_target(self.root / arch, arch, num_layers=NUM_LAYERS)
        return self[arch]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return Targets(tmp_path_factory.mktemp("targets"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "mixed.jsonl", sample_records(10))


def run_extract(target, data, out, **kw):
    kw = {"layer_ids": LAYER_IDS, "dtype": "fp32", "progress": False, **kw}
    return extract(target, data, out, **kw)


@functools.lru_cache(maxsize=4)
def reference_model(target, tie_last=True):
    """The plain HF model of `target`; a multimodal checkpoint as shipped: the whole `...ForConditionalGeneration`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(target)
    config.tie_last_hidden_states = config.get_text_config().tie_last_hidden_states = tie_last
    multimodal = config.architectures[0].endswith("ForConditionalGeneration")
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(target, config=config, dtype=torch.float32).eval()


def hf_forward(target, input_ids, tie_last=True):
    """Reference: the plain HF forward of one unpadded sequence (text only) -> (hidden_states, logits, model)."""
    model = reference_model(str(target), tie_last)
    with torch.no_grad():
        out = model(input_ids=input_ids.long()[None], output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], out.logits[0], model


def decoder(model):
    """The decoder (embeddings, layers, final norm) of a causal LM or of a multimodal model."""
    return getattr(model.model, "language_model", model.model)


def all_files(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


# ---------------------------------------------------------------- what is stored

@pytest.mark.parametrize("arch", CONTRACT_ARCHS)
def test_stored_hidden_is_hf_hidden_states_at_id_plus_one(targets, data, tmp_path, arch):
    # batch_tokens=1: every sequence runs alone, unpadded, exactly like the reference forward.
    run_extract(targets[arch], data, tmp_path, batch_tokens=1)
    store = HiddenStateStore(tmp_path)
    assert store.manifest["layer_ids"] == LAYER_IDS and "hidden_states[l+1]" in store.manifest["layer_id_convention"]
    for i in (0, 3):
        item = store[i]
        states, _, _ = hf_forward(targets[arch], item["input_ids"])
        raw_states, _, _ = hf_forward(targets[arch], item["input_ids"], tie_last=False)
        for k, layer in enumerate(LAYER_IDS[:-1]):
            assert torch.equal(item["hidden"][:, k], states[layer + 1]), f"layer id {layer}"
        # Layer id L-1 is stored pre-norm: HF's hidden_states[L] has the final norm applied.
        assert torch.equal(item["hidden"][:, -1], raw_states[NUM_LAYERS])
        assert not torch.allclose(item["hidden"][:, -1], states[NUM_LAYERS], atol=1e-3)


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", "qwen3_vl"])
def test_last_is_the_pre_norm_residual_of_the_final_layer_not_an_intermediate_one(targets, data, tmp_path, arch):
    run_extract(targets[arch], data, tmp_path, batch_tokens=1)
    store = HiddenStateStore(tmp_path)
    assert store.manifest["last_is_pre_norm"] is True and store.manifest["has_last"] is True
    item = store[1]
    raw_states, logits, model = hf_forward(targets[arch], item["input_ids"], tie_last=False)
    assert torch.equal(item["last"], raw_states[NUM_LAYERS])
    assert not torch.allclose(item["last"], raw_states[NUM_LAYERS - 1], atol=1e-3)
    # The teacher is the last layer's: an intermediate layer through norm + lm_head predicts other tokens.
    with torch.no_grad():
        wrong = model.lm_head(decoder(model).norm(raw_states[NUM_LAYERS - 1]))
    assert torch.equal(item["teacher_topk_ids"][:, 0].long(), logits.argmax(-1))
    assert (wrong.argmax(-1) != logits.argmax(-1)).float().mean() > 0.2


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gpt_oss"])
def test_teacher_topk_and_lse_are_those_of_the_model_logits(targets, data, tmp_path, arch):
    run_extract(targets[arch], data, tmp_path, batch_tokens=1, topk=5)
    store = HiddenStateStore(tmp_path)
    for i in range(len(store)):
        item = store[i]
        _, logits, model = hf_forward(targets[arch], item["input_ids"])
        values, ids = logits.topk(5, dim=-1)
        assert torch.equal(item["teacher_topk_logits"], values)
        assert torch.equal(item["teacher_topk_ids"].long(), ids)
        assert torch.equal(item["teacher_lse"], torch.logsumexp(logits, dim=-1))
        assert (item["teacher_topk_logits"].diff(dim=-1) <= 0).all()


def test_a_forward_that_cannot_limit_its_logits_stores_the_same(targets, monkeypatch):
    """A target whose forward takes no logits_to_keep (remote code) computes every logit: the parity check reads
    its positions from them, and the store is the same."""
    monkeypatch.setattr(capture_module, "PARITY_POSITIONS", 8)  # fewer than the tokens: the logits are sliced
    model = reference_model(str(targets["qwen3"]))
    examples = [Example(np.arange(n, dtype=np.int32) * 7 % 300, np.ones(n, dtype=bool)) for n in (40, 23)]
    layout = Layout(len(LAYER_IDS), model.config.hidden_size, 4, "float32", True)
    limited = capture_module.TargetRunner(model, LAYER_IDS, layout, 0, parity_every=1)
    full = capture_module.TargetRunner(model, LAYER_IDS, layout, 0, parity_every=1)
    full._logits_to_keep = False
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(sorted(k)) or forward(*a, **k))
    for a, b in zip(limited(examples), full(examples)):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert "logits_to_keep" in calls[0] and "logits_to_keep" not in calls[1]


@pytest.mark.parametrize("arch, kind", [("qwen3", "rmsnorm"), ("qwen3_5", "rmsnorm_zero_centred"),
                                        ("qwen3_moe", "rmsnorm"), ("gpt_oss", "rmsnorm"), ("qwen3_vl", "rmsnorm"),
                                        ("qwen3_5_vl", "rmsnorm_zero_centred")])
def test_lm_head_of_final_norm_of_last_reproduces_the_logits(targets, data, tmp_path, arch, kind):
    run_extract(targets[arch], data, tmp_path)
    store = HiddenStateStore(tmp_path)
    norm = store.manifest["final_norm"]
    assert norm["kind"] == kind
    _, logits, model = hf_forward(targets[arch], store[2]["input_ids"])
    scale = final_norm_weight(decoder(model).norm.weight.detach(), norm["kind"])
    with torch.no_grad():
        recomputed = model.lm_head(rms_norm(store[2]["last"], scale, norm["eps"]))
    torch.testing.assert_close(recomputed, logits, rtol=1e-5, atol=1e-5)


def test_hybrid_qwen3_next_extracts_on_cpu(tmp_path, data):
    target = make_tiny_target(tmp_path / "target", "qwen3_next", num_layers=4)
    run_extract(target, data, tmp_path / "store", layer_ids=[1, 3])
    store = HiddenStateStore(tmp_path / "store")
    assert store.manifest["final_norm"]["kind"] == "rmsnorm_zero_centred"
    assert store.manifest["target"]["architectures"] == ["Qwen3NextForCausalLM"]
    item = store[0]
    states, logits, _ = hf_forward(target, item["input_ids"])
    torch.testing.assert_close(item["hidden"][:, 0], states[2], rtol=1e-5, atol=1e-5)
    assert torch.equal(item["teacher_topk_ids"][:, 0].long(), logits.argmax(-1))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_moe", "gpt_oss", "qwen3_vl"])
def test_batched_equals_one_by_one(targets, data, tmp_path, arch):
    run_extract(targets[arch], data, tmp_path / f"{arch}-single", batch_tokens=1)
    run_extract(targets[arch], data, tmp_path / f"{arch}-batched", batch_tokens=4096)
    single, batched = HiddenStateStore(tmp_path / f"{arch}-single"), HiddenStateStore(tmp_path / f"{arch}-batched")
    # gpt-oss's template closes earlier assistant turns otherwise than it generated them: its multi-turn records are
    # one row per assistant turn (records.ChatTokenizer.conversation_rows).
    assert len(single) == len(batched) == (14 if arch == "gpt_oss" else 10)
    for i in range(len(single)):
        a, b = single[i], batched[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("hidden", "last", "teacher_topk_logits", "teacher_lse"):
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=2e-5, msg=f"{arch} {name} item {i}")
        assert torch.equal(a["teacher_topk_ids"][:, 0], b["teacher_topk_ids"][:, 0])


def test_no_last_drops_last_only(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path, no_last=True)
    store = HiddenStateStore(tmp_path)
    assert store.manifest["has_last"] is False and "last" not in store[0]
    assert store[0]["hidden"].shape[1:] == (len(LAYER_IDS), 64)


def test_the_manifest_records_the_reasoning_mode_it_was_extracted_with(targets, data, tmp_path):
    """What the model card states of the data (serve/model_card.REASONING_LINES reads it through provenance)."""
    for mode in ("train", "mask"):
        run_extract(targets["qwen3"], data, tmp_path / mode, reasoning=mode)
        assert HiddenStateStore(tmp_path / mode).manifest["extraction"]["reasoning"] == mode


def test_default_dtype_is_bf16_bits_viewed_as_bf16(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path / "bf16", dtype="bf16")
    run_extract(targets["qwen3"], data, tmp_path / "fp32")
    bf16, fp32 = HiddenStateStore(tmp_path / "bf16"), HiddenStateStore(tmp_path / "fp32")
    assert bf16.hidden_dtype == torch.bfloat16 and bf16[0]["hidden"].dtype == torch.bfloat16
    assert torch.equal(bf16[0]["hidden"], fp32[0]["hidden"].to(torch.bfloat16))
    assert torch.equal(bf16[0]["teacher_lse"], fp32[0]["teacher_lse"])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_fp8_store_is_the_fp32_one_within_the_e4m3_bound_and_passes_parity(targets, data, tmp_path, arch):
    # parity_every=1: every batch checks lm_head(norm(last)) on the dequantised fp8 `last` too.
    run_extract(targets[arch], data, tmp_path / "fp8", dtype="fp8", parity_every=1, batch_tokens=256)
    run_extract(targets[arch], data, tmp_path / "fp32", batch_tokens=256)
    fp8, fp32 = HiddenStateStore(tmp_path / "fp8"), HiddenStateStore(tmp_path / "fp32")
    assert fp8.manifest["dtype"] == "float8_e4m3fn" and fp8.manifest["schema_version"] == 2
    for i in range(len(fp8)):
        a, b = fp8[i], fp32[i]
        for name in ("hidden", "last"):
            scale = a[f"{name}_scale"]
            torch.testing.assert_close(scale, b[name].abs().amax(-1) / 448, rtol=1e-6, atol=0)
            err = (dequantize_fp8(a[name], scale, torch.float32) - b[name]).abs()
            assert (err <= 2**-4 * b[name].abs() + 2**-10 * scale[..., None]).all(), f"{name} of item {i}"
        assert torch.equal(a["teacher_topk_ids"], b["teacher_topk_ids"]) and torch.equal(a["input_ids"], b["input_ids"])
    states = ("hidden", "last", "hidden_scale", "last_scale")
    disk = {
        d: sum(os.path.getsize(f) for f in (tmp_path / d / "shards").glob("*/*.bin") if f.stem in states)
        for d in ("fp8", "fp32")
    }
    # fp8 is a quarter of fp32 (half of bf16) plus 4 bytes of scale per token and layer.
    tokens, k, h = fp8.manifest["num_tokens"], len(LAYER_IDS), 64
    assert disk["fp8"] == tokens * ((k + 1) * h + 4 * (k + 1)) and disk["fp32"] == tokens * (k + 1) * h * 4


def test_fp8_store_reads_back_as_bf16_batches_of_the_same_contract(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path / "fp8", dtype="fp8")
    run_extract(targets["qwen3"], data, tmp_path / "fp32")
    kw = dict(data=DataConfig(seq_len=64, num_anchors=4, batch_rows=2, num_workers=0), seed=1, with_last=True)
    a = next(iter(make_loader(HiddenStateStore(tmp_path / "fp8"), **kw)))
    b = next(iter(make_loader(HiddenStateStore(tmp_path / "fp32"), **kw)))
    assert a.keys() == b.keys() and "hidden_scale" not in a
    for key in a:
        assert a[key].shape == b[key].shape, key
        if key in ("hidden", "last"):
            assert a[key].dtype == torch.bfloat16
            # e4m3 (2^-4 relative, plus subnormals) then one bf16 rounding (2^-8)
            scale_floor = 2**-10 * b[key].abs().amax(-1, keepdim=True) / 448
            assert ((a[key].float() - b[key]).abs() <= 2**-3.9 * b[key].abs() + scale_floor).all(), key
        else:
            assert torch.equal(a[key], b[key]), key


def test_fp8_parity_checks_last_as_the_store_holds_it(targets, data, tmp_path, monkeypatch):
    # A quantiser that clips everything above absmax / 16 leaves the compute-dtype parity intact; the fp8 check
    # catches it. (A wrong per-token scale alone would not matter to the teacher: RMSNorm removes it.)
    real = capture_module.quantize_fp8

    def clipping(x):
        q, scale = real(x)
        return q.float().clamp(-28, 28).to(q.dtype), scale

    monkeypatch.setattr(capture_module, "quantize_fp8", clipping)
    with pytest.raises(RuntimeError, match=r"parity check failed: lm_head\(model.norm\(last as stored in fp8\)\)"):
        run_extract(targets["qwen3"], data, tmp_path, dtype="fp8")
    assert not os.path.exists(tmp_path / MANIFEST)


# ---------------------------------------------------------------- refusals

def test_parity_mismatch_aborts_before_writing_anything(targets, data, tmp_path, monkeypatch):
    # A mis-described final norm: the recomputed logits cannot match the model's.
    monkeypatch.setattr(capture_module, "detect_norm_kind", lambda _norm: ("rmsnorm_zero_centred", 1e-6))
    with pytest.raises(UserError, match="parity check failed"):  # one error line from the CLI, no traceback
        run_extract(targets["qwen3"], data, tmp_path)
    assert not os.path.exists(tmp_path / MANIFEST)
    assert os.listdir(tmp_path / "shards") == []


@pytest.mark.parametrize("ids, match", [([1, NUM_LAYERS], "hidden_states\\[i\\+1\\] is layer i"),
                                        ([-1, 2], "negative"), ([2, 2], "duplicates"), ([3, 1], "not sorted")])
def test_bad_layer_ids_are_refused_before_anything_runs(targets, data, tmp_path, ids, match):
    with pytest.raises(ValueError, match=match):
        run_extract(targets["qwen3"], data, tmp_path / "out", layer_ids=ids)
    assert not os.path.exists(tmp_path / "out")


def test_rerun_into_a_store_of_another_extraction_is_refused(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path)
    assert run_extract(targets["qwen3"], data, tmp_path)["skipped_shards"] is None  # same job: already complete
    with pytest.raises(ValueError, match="different extraction"):
        run_extract(targets["qwen3"], data, tmp_path, topk=3)


# ---------------------------------------------------------------- crash safety

def test_resume_after_a_crash_mid_shard_is_byte_identical_to_an_uninterrupted_run(
    targets, data, tmp_path, monkeypatch
):
    kw = dict(shard_tokens=400, batch_tokens=200)
    run_extract(targets["qwen3"], data, tmp_path / "clean", **kw)
    assert len(HiddenStateStore(tmp_path / "clean").manifest["shards"]) >= 3

    real_write, calls = ShardWriter.write, []

    def crashing_write(self, i, arrays):
        calls.append(i)
        if len(calls) == 5:  # in the middle of the second shard, after some of its sequences
            raise KeyboardInterrupt
        real_write(self, i, arrays)

    monkeypatch.setattr(ShardWriter, "write", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        run_extract(targets["qwen3"], data, tmp_path / "crashed", **kw)
    shards = sorted(os.listdir(tmp_path / "crashed" / "shards"))
    assert any(s.endswith(".tmp") for s in shards) and not os.path.exists(tmp_path / "crashed" / MANIFEST)
    with pytest.raises(FileNotFoundError, match="re-run the same command"):
        HiddenStateStore(tmp_path / "crashed")

    monkeypatch.setattr(ShardWriter, "write", real_write)
    summary = run_extract(targets["qwen3"], data, tmp_path / "crashed", **kw)
    assert summary["skipped_shards"] >= 1
    assert all_files(tmp_path / "crashed") == all_files(tmp_path / "clean")


def test_rerun_over_a_finished_store_with_a_lost_shard_redoes_it(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path / "a", shard_tokens=400)
    run_extract(targets["qwen3"], data, tmp_path / "b", shard_tokens=400)
    shutil.rmtree(tmp_path / "b" / "shards" / "rank00000-shard00001")
    with pytest.raises(FileNotFoundError, match="rank00000-shard00001: shard listed in the manifest is missing"):
        HiddenStateStore(tmp_path / "b")
    assert run_extract(targets["qwen3"], data, tmp_path / "b", shard_tokens=400)["tokens_run"] > 0
    assert all_files(tmp_path / "b") == all_files(tmp_path / "a")


def test_ranks_write_their_own_shards_and_one_manifest_describes_all(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path / "one", batch_tokens=1)
    errors = []

    def rank(r):
        try:
            run_extract(targets["qwen3"], data, tmp_path / "two", batch_tokens=1, rank=r, world_size=2)
        except Exception as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    one, two = HiddenStateStore(tmp_path / "one"), HiddenStateStore(tmp_path / "two")
    assert {s["name"].split("-")[0] for s in two.manifest["shards"]} == {"rank00000", "rank00001"}
    assert not os.path.exists(tmp_path / "two" / "ranks")
    by_ids = {tuple(one[i]["input_ids"].tolist()): one[i] for i in range(len(one))}
    assert len(two) == len(one) and two.manifest["num_tokens"] == one.manifest["num_tokens"]
    for i in range(len(two)):
        b = two[i]
        a = by_ids[tuple(b["input_ids"].tolist())]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_parallel_loads_leave_weight_tying_working():
    """from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it loads; loads racing in
    threads (ranks as threads, above) once left the no-op in place, and every later tied target of
    the process (the embedded one) kept its lm_head on the meta device. load_target serialises them."""
    from transformers import PreTrainedModel

    from dflash_fast.evaluate.quickstart import TARGET

    models, errors = [], []

    def load():
        try:
            models.append(target_module.load_target(TARGET, torch.device("cpu"), torch.float32))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(models) == 4
    assert PreTrainedModel.tie_weights.__name__ == "tie_weights"
    for m in models + [target_module.load_target(TARGET, torch.device("cpu"), torch.float32)]:
        assert m.lm_head.weight is m.model.embed_tokens.weight and not m.lm_head.weight.is_meta


def test_a_target_with_unloaded_weights_is_refused(targets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(targets["qwen3"], dtype=torch.float32)
    with torch.device("meta"):
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        target_module.check_materialised(model, "tiny")


# ---------------------------------------------------------------- input

def test_chat_loss_mask_covers_assistant_replies_only(tmp_path):
    tok = make_tokenizer(tmp_path)
    turns = [
        {"role": "system", "content": "the drafter"},
        {"role": "user", "content": "hidden state"},
        {"role": "assistant", "content": "anchor slot"},
        {"role": "user", "content": "token layer"},
        {"role": "assistant", "content": "block loss"},
    ]
    ex = ChatTokenizer(tok, len(tok)).conversation(turns)
    ids = ex.input_ids.tolist()
    trained = tok.decode([t for t, m in zip(ids, ex.loss_mask) if m])
    assert trained == "anchor slot<|im_end|>\nblock loss<|im_end|>\n"
    untrained = tok.decode([t for t, m in zip(ids, ex.loss_mask) if not m])
    assert "anchor" not in untrained and "assistant" in untrained and "hidden state" in untrained
    assert ids == tok.apply_chat_template(turns, tokenize=True, return_dict=False)


@pytest.mark.parametrize(
    "template, turns, expected",
    [
        # As Qwen3's template does: an earlier assistant turn is rendered without its <think> part.
        (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1].lstrip('\\n') }}"
            "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}",
            ["hidden", "<think>token</think>\nanchor slot", "layer", "<think>state</think>\nblock loss"],
            "anchor slot<|im_end|>\n<think>state</think>\nblock loss<|im_end|>\n",
        ),
        # This template marks the final turn, so rendered prefixes are not prefixes of the full text.
        (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} final{% endif %}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}",
            ["hidden", "anchor slot", "token", "block loss"],
            "anchor slot<|im_end|>\nblock loss<|im_end|>\n",
        ),
    ],
    ids=["drops_reasoning_from_earlier_turns", "rerenders_earlier_turns"],
)
def test_chat_loss_mask_survives_a_template_that_renders_earlier_turns_otherwise(tmp_path, template, turns, expected):
    tok = make_tokenizer(tmp_path)
    tok.chat_template = template + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    conversation = [{"role": role, "content": text} for role, text in zip(["user", "assistant"] * 2, turns)]
    ex = ChatTokenizer(tok, len(tok)).conversation(conversation)
    trained = tok.decode([t for t, m in zip(ex.input_ids.tolist(), ex.loss_mask) if m])
    assert trained == expected


def test_formats_and_skipped_records_are_counted_never_silent(targets, tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    records = [
        {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "the block"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "the slot"}]},
        {"text": "the anchor token"},
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]},
        {"conversations": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"conversations": [{"role": "user", "content": "only a question"}]},
        {"input_ids": [5, 6], "loss_mask": [0, 0]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    run_extract(targets["qwen3"], path, tmp_path / "out")
    store = HiddenStateStore(tmp_path / "out")
    counts = store.manifest["extraction"]["input"]
    assert len(store) == 4 and counts["lines"] == 7
    assert counts["skipped"] == {
        "unknown role 'narrator'": 1,
        "no assistant turn": 1,
        "no loss tokens (after truncation)": 1,
    }
    assert store[2]["loss_mask"].all() and store[2]["input_ids"].tolist() == tok("the anchor token")["input_ids"]
    assert store[3]["input_ids"].tolist() == [5, 6, 7, 8] and store[3]["loss_mask"].tolist() == [0, 1, 1, 0]


def test_over_long_sequences_are_truncated_and_counted(targets, data, tmp_path):
    run_extract(targets["qwen3"], data, tmp_path, max_seq_len=40)
    store = HiddenStateStore(tmp_path)
    assert store.lengths.max() == 40
    counts = store.manifest["extraction"]["input"]
    assert counts["truncated"] == 10  # every record is longer than 40 tokens
    # Conversations whose assistant reply starts after token 40 have nothing left to train: counted.
    assert len(store) + counts["skipped"]["no loss tokens (after truncation)"] == 10 and len(store) > 0


def test_a_malformed_jsonl_line_is_named_by_file_and_line(targets, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "the anchor"}\n\n{"text": "the block"\n{"text": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON.*--skip-bad"):
        run_extract(targets["qwen3"], path, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
    run_extract(targets["qwen3"], path, tmp_path / "out", skip_bad=True)
    store = HiddenStateStore(tmp_path / "out")
    assert len(store) == 1 and store.manifest["extraction"]["input"]["bad_lines"] == 2


def test_an_empty_file_is_refused(targets, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"{path} is empty"):
        run_extract(targets["qwen3"], path, tmp_path / "out")


def test_cli_rejects_non_integer_layer_ids(targets, data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(
            ["extract", "--target", targets["qwen3"], "--data", str(data), "--out", str(tmp_path), "--layer-ids", "1,x"]
        )
    assert "comma-separated integers" in capsys.readouterr().err


def test_cli_extract_writes_a_store(targets, data, tmp_path, capsys):
    rc = cli.main(
        [
            "extract",
            "--target",
            targets["llama"],
            "--data",
            str(data),
            "--out",
            str(tmp_path),
            "--layer-ids",
            "1,3",
            "--dtype",
            "fp16",
            "--topk",
            "2",
            "--shard-tokens",
            "500",
        ]
    )
    assert rc == 0
    store = HiddenStateStore(tmp_path)
    assert store.manifest["layer_ids"] == [1, 3] and store[0]["hidden"].dtype == torch.float16
    assert store[0]["teacher_topk_ids"].shape[1] == 2 and len(store.manifest["shards"]) > 1
    out = capsys.readouterr().out
    assert "10 sequences" in out and "GB/s" in out
    assert json.loads((tmp_path / MANIFEST).read_text())["num_sequences"] == 10


# ---------------------------------------------------------------- disk


def test_estimate_prints_the_exact_bytes_per_field_and_writes_nothing(targets, data, tmp_path, capsys):
    out = tmp_path / "store"
    args = ["extract", "--target", targets["qwen3"], "--data", str(data), "--out", str(out), "--layer-ids", "0,2,4",
            "--dtype", "fp8", "--shard-tokens", "500"]
    assert cli.main(args + ["--estimate"]) == 0
    report = capsys.readouterr().out
    assert not os.path.exists(out), "--estimate writes nothing"
    disk = extract_module.estimate(targets["qwen3"], data, out, layer_ids=[0, 2, 4], dtype="fp8", shard_tokens=500)
    tokens = disk["tokens"]
    assert disk["fields"]["hidden"] == {"dtype": "float8_e4m3fn", "shape": [3, 64], "bytes_per_token": 192,
                                        "bytes": 192 * tokens}
    assert disk["fields"]["hidden_scale"]["bytes_per_token"] == 12 and disk["fields"]["last_scale"]["shape"] == []
    for name, f in disk["fields"].items():
        assert f"{name:<20} {f['dtype']:<14} {str(f['shape']):<12} {f['bytes_per_token']:>11,}" in report, name
    assert "in another --dtype: bfloat16" in report and "(enough)" in report
    assert disk["per_dtype"]["bfloat16"] > disk["total"] == disk["remaining"] == disk["needed"]
    assert cli.main(args) == 0
    written = sum(os.path.getsize(f) for f in (out / "shards").glob("*/*.bin"))
    assert written == disk["total"], "the estimate is the bytes extraction writes"
    assert extract_module.estimate(targets["qwen3"], data, out, layer_ids=[0, 2, 4], dtype="fp8",
                                   shard_tokens=500)["remaining"] == 0, "complete shards need no more space"


def test_extraction_refuses_to_start_without_the_free_space_naming_both_numbers(targets, data, tmp_path, monkeypatch,
                                                                                capsys):
    out = tmp_path / "store"
    needed = extract_module.estimate(targets["qwen3"], data, out, layer_ids=LAYER_IDS, dtype="fp32")["needed"]
    monkeypatch.setattr(extract_module, "free_bytes", lambda _path: needed - 1)
    monkeypatch.setattr(runners_module, "load_target", lambda *_a, **_k: pytest.fail("the model must not load"))
    with pytest.raises(extract_module.NotEnoughDisk,
                       match=rf"store needs {needed:,} bytes .* has {needed - 1:,} bytes .* free"):
        run_extract(targets["qwen3"], data, out)
    args = ["extract", "--target", targets["qwen3"], "--data", str(data), "--out", str(out), "--layer-ids",
            ",".join(map(str, LAYER_IDS)), "--dtype", "fp32"]
    assert cli.main(args) == 1
    assert capsys.readouterr().err.startswith(f"error: {out}: the store needs {needed:,} bytes"), "one line, no trace"
    assert not os.path.exists(out), "nothing is written before the refusal"
    monkeypatch.undo()
    monkeypatch.setattr(extract_module, "free_bytes", lambda _path: needed)
    run_extract(targets["qwen3"], data, out)
    assert HiddenStateStore(out).manifest["num_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_gpu_bf16_extraction_passes_parity_and_tracks_fp32(tmp_path, data, arch):
    # On CUDA the target runs in bf16 (flash_attention_2 when installed): parity must hold at bf16 tolerance.
    target = make_tiny_target(tmp_path / "target", arch, num_layers=NUM_LAYERS, hidden_size=256)
    run_extract(target, data, tmp_path / "gpu", dtype="bf16", device="cuda", parity_every=1)
    run_extract(target, data, tmp_path / "cpu", device="cpu")
    gpu, cpu = HiddenStateStore(tmp_path / "gpu"), HiddenStateStore(tmp_path / "cpu")
    assert gpu.manifest["compute_dtype"] == "bfloat16" and gpu.hidden_dtype == torch.bfloat16
    for i in range(len(gpu)):
        a, b = gpu[i], cpu[i]
        for name in ("hidden", "last"):
            rel = (a[name].float() - b[name]).norm() / b[name].norm()
            assert rel < 5e-2, f"{name} item {i}: relative error {rel:.3g}"
        assert (a["teacher_lse"] - b["teacher_lse"]).abs().max() < 0.1


# ---------------------------------------------------------------- hostile input and damaged stores

def test_rerun_over_a_truncated_or_torn_shard_redoes_it_without_a_manual_delete(targets, data, tmp_path, capsys):
    run_extract(targets["qwen3"], data, tmp_path / "a", shard_tokens=400)
    run_extract(targets["qwen3"], data, tmp_path / "b", shard_tokens=400)
    truncated = tmp_path / "b" / "shards" / "rank00000-shard00001" / "hidden.bin"
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 3)
    (tmp_path / "b" / "shards" / "rank00000-shard00002" / "index.json").write_text("")  # torn by hand
    summary = run_extract(targets["qwen3"], data, tmp_path / "b", shard_tokens=400)
    assert summary["tokens_run"] > 0 and summary["skipped_shards"] >= 1
    err = capsys.readouterr().err
    assert "rank00000-shard00001 is damaged" in err and "rank00000-shard00002 is damaged" in err
    assert all_files(tmp_path / "b") == all_files(tmp_path / "a")


def test_records_the_template_or_tokenizer_cannot_take_are_bad_lines_named_and_skipped(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    # A template that refuses two user turns in a row, as many real ones do (raise_exception).
    tok.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    path = tmp_path / "hostile.jsonl"
    path.write_text(
        '{"text": "the anchor"}\n'
        '{"text": "\\ud800"}\n'  # valid JSON: a lone surrogate, which no tokenizer takes
        '{"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\\udfff"}]}\n'
        '{"conversations": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},'
        ' {"role": "assistant", "content": "c"}]}\n'
        '{"text": "the block"}\n'
        + "[" * 100_000 + "\n"  # parses only by recursion: deeper than Python's stack allows
    )
    chat = ChatTokenizer(tok, len(tok))
    where = re.escape(f"{path}:2: 'text' holds a lone surrogate U+D800 at character 0")
    with pytest.raises(ValueError, match=rf"^{where}.*--skip-bad"):
        read_examples(path, chat, 64)
    examples, stats, _ = read_examples(path, chat, 64, skip_bad=True)
    assert len(examples) == 2 and stats.bad_lines == 4 and stats.sequences == 2
    path.write_text('{"conversations": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
                    '{"role": "assistant", "content": "c"}]}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: the chat template failed on it (TemplateError: roles")):
        read_examples(path, chat, 64)


def test_cli_extract_names_the_line_of_a_lone_surrogate_in_one_error_line(targets, tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "the anchor"}\n{"conversations": [{"role": "user", "content": "\\ud800"}, '
                    '{"role": "assistant", "content": "b"}]}\n')
    argv = ["extract", "--target", targets["qwen3"], "--data", str(path), "--out", str(tmp_path / "out"),
            "--layer-ids", "1,3"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:2: the content of turn 0 holds a lone surrogate") and err.count("\n") == 1


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_target_that_does_not_exist_is_reported_as_such_without_the_hub(targets, data, tmp_path, monkeypatch,
                                                                          capsys, relative):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    target = "models/qwen3-typo" if relative else str(tmp_path / "no" / "such" / "target")
    assert cli.main(["extract", "--target", target, "--data", str(data), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"error: target {target} does not exist (no such directory)\n"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="offline mode .* allows no download"):
        target_module.check_target("some-org/some-model")  # a hub id, but offline and not in the cache
    assert target_module.check_target(targets["qwen3"]) == targets["qwen3"]
