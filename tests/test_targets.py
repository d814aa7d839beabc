"""The targets users have beyond dense Qwen3 / Llama (docs/targets.md): MoE, gpt-oss and multimodal checkpoints
train end to end, and a target the HF path cannot serve is refused before it loads, with the reason.

The extraction contract itself (stored hidden == HF hidden_states[id + 1], `last`, teacher top-k / lse) runs over
every architecture in tests/test_extract.py."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_targets import make_tiny_target, make_tokenizer, sample_records, write_jsonl

from dflash_fast import cli
from dflash_fast.errors import UserError
from dflash_fast.evaluate.evaluate import evaluate
from dflash_fast.extract.extract import extract
from dflash_fast.target import load as target_module
from dflash_fast.target.load import load_target, weight_bytes
from dflash_fast.target.records import ChatTokenizer, read_examples
from dflash_fast.train.config import load_config
from dflash_fast.train.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["def parse_args(self, args=None):", "the drafter reads the hidden state of"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_vl"])
def test_train_export_eval_end_to_end_is_greedy_exact(tmp_path, arch):
    """extract -> train (4 steps) -> export -> real speculative decoding: the target's own greedy output."""
    target = make_tiny_target(tmp_path / "target", arch, num_layers=4, hidden_size=32)
    data = write_jsonl(tmp_path / "data.jsonl", sample_records(16))
    extract(target, data, tmp_path / "store", layer_ids=[1, 3], dtype="fp32", max_seq_len=64, progress=False)
    out = tmp_path / "run"
    overrides = {
        "data.store": tmp_path / "store", "output_dir": out, "model.target": target, "model.mask_token_id": 0,
        "model.num_layers": 1, "model.block_size": 4, "data.seq_len": 64, "data.num_anchors": 8,
        "data.batch_rows": 2, "data.val_fraction": 0.0, "validation.every": 0, "logging.every": 1,
        "logging.progress": False, "checkpoint.every": 0, "schedule.steps": 4, "optimizer.kind": "adamw",
        "loss.weighting": "decay",
        "deepspeed": os.path.join(REPO, "configs", "ds_zero1.json"),
    }
    result = train(load_config(os.path.join(REPO, "configs", "tiny.yaml"), [f"{k}={v}" for k, v in overrides.items()]))
    assert not result["interrupted"]
    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"conversations": [{"role": "user", "content": p}]} for p in PROMPTS])
    report = evaluate(target, str(prompts), result["export"], max_new_tokens=16, offline=False, progress=False)
    assert report["prompts"] == 2 and report["greedy_mismatches"] == 0 and report["new_tokens"] > 0
    assert json.loads((out / "export" / "config.json").read_text())["aux_hidden_state_layer_ids"] == [2, 4]


# ---------------------------------------------------------------- what the HF path refuses, before loading


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3"), "qwen3", num_layers=2, hidden_size=32)


def no_load(monkeypatch):
    """Make any transformers model load fail the test."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        monkeypatch.setattr(auto, "from_pretrained", lambda *_a, **_k: pytest.fail("the model must not load"))


def test_a_target_bigger_than_its_device_is_refused_before_loading_naming_both_sizes(qwen3, tmp_path, monkeypatch,
                                                                                     capsys):
    needed = weight_bytes(qwen3, torch.float32)
    monkeypatch.setattr(target_module, "device_memory", lambda _device: needed - 1)
    no_load(monkeypatch)
    data = write_jsonl(tmp_path / "d.jsonl", sample_records(3))
    argv = ["extract", "--target", qwen3, "--data", str(data), "--out", str(tmp_path / "out"), "--layer-ids", "0,1"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: target {qwen3}: its weights take {needed:,} bytes") and err.count("\n") == 1
    assert f"in float32 but cpu has {needed - 1:,} bytes" in err
    assert "`dflash-fast extract --engine vllm --tensor-parallel-size N` (docs/engine-target.md)" in err
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_vl"])
def test_the_size_check_counts_the_weights_the_model_loads(tmp_path, arch):
    """In the compute dtype, from the safetensors headers; Qwen3.5's vision tower stays on disk and does not count."""
    target = make_tiny_target(tmp_path, arch, num_layers=2, hidden_size=32)
    model = load_target(target, torch.device("cpu"), torch.float32)
    params = sum(p.numel() for p in model.parameters())
    skipped = type(model)._keys_to_ignore_on_load_unexpected or ()
    assert weight_bytes(target, torch.float32, skipped) == 4 * params
    assert weight_bytes(target, torch.bfloat16, skipped) == 2 * params
    if arch == "qwen3_5_vl":
        assert weight_bytes(target, torch.float32) > 4 * params, "the checkpoint holds a vision tower"


def test_a_damaged_safetensors_header_is_named_not_a_traceback(qwen3, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(qwen3, damaged)
    (damaged / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file \(its header does not parse\)"):
        weight_bytes(str(damaged), torch.float32)


def test_a_target_whose_logits_are_not_lm_head_of_norm_is_refused_with_the_reason(qwen3, tmp_path, monkeypatch):
    capped = tmp_path / "capped"
    shutil.copytree(qwen3, capped)
    config = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    no_load(monkeypatch)
    reason = r"soft-caps its logits with tanh \(final_logit_softcapping = 30.0 in config.json\)"
    with pytest.raises(UserError, match=reason):
        load_target(str(capped), torch.device("cpu"), torch.float32)


def test_an_untied_checkpoint_without_its_lm_head_is_refused_not_initialised_at_random(qwen3, tmp_path):
    headless = tmp_path / "headless"
    shutil.copytree(qwen3, headless)
    weights = load_file(headless / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="checkpoint holds no lm_head.weight"):
        load_target(str(headless), torch.device("cpu"), torch.float32)


def test_a_moe_config_saved_with_router_logits_loads_without_them(tmp_path):
    target = make_tiny_target(tmp_path, "qwen3_moe", num_layers=2, hidden_size=32)
    assert json.loads((tmp_path / "config.json").read_text())["output_router_logits"] is True
    model = load_target(target, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = model(input_ids=torch.arange(12)[None], use_cache=False)
    assert out.router_logits is None and out.aux_loss is None


# ---------------------------------------------------------------- data


def test_image_inputs_are_refused_by_line_until_supported(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    image = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what is this"}]
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"text": "the anchor"},
        {"conversations": [{"role": "user", "content": image}, {"role": "assistant", "content": "a cat"}]},
        {"images": ["cat.png"], "conversations": [{"role": "user", "content": "a"},
                                                  {"role": "assistant", "content": "b"}]},
    ])
    chat = ChatTokenizer(tok, len(tok))
    with pytest.raises(ValueError, match=rf"{path}:2: turn 0 holds an image; image and video inputs are not supported"):
        read_examples(path, chat, 64)
    examples, stats, _ = read_examples(path, chat, 64, skip_bad=True)
    assert len(examples) == 1 and stats.bad_lines == 2


def trained_text(tok, example):
    return tok.decode([t for t, m in zip(example.input_ids.tolist(), example.loss_mask) if m])


def test_harmony_trains_what_gpt_oss_generates_after_the_generation_prompt(tmp_path):
    """gpt-oss at serving time: the prompt ends with `<|start|>assistant` and the engine drafts every token the target
    generates after it: the analysis channel, the final channel's header, the answer and `<|return|>`."""
    tok = make_tokenizer(tmp_path, chat_format="harmony")
    chat = ChatTokenizer(tok, len(tok))
    turns = [{"role": "system", "content": "the drafter"}, {"role": "user", "content": "hidden state"},
             {"role": "assistant", "thinking": "the token", "content": "anchor slot"}]
    ex = chat.conversation(turns)
    prompt = tok.apply_chat_template(turns[:2], add_generation_prompt=True, return_dict=False)
    assert tok.decode(prompt).endswith("<|start|>assistant")
    ids = ex.input_ids.tolist()
    assert ids[:len(prompt)] == prompt and not ex.loss_mask[:len(prompt)].any() and ex.loss_mask[len(prompt):].all()
    assert trained_text(tok, ex) == ("<|channel|>analysis<|message|>the token<|end|><|start|>assistant<|channel|>final"
                                     "<|message|>anchor slot<|return|>")
    # An earlier turn is rendered as the template keeps it in the history (final channel only, closed by <|end|>).
    turns += [{"role": "user", "content": "token layer"}, {"role": "assistant", "content": "block loss"}]
    assert trained_text(tok, chat.conversation(turns)) == (
        "<|channel|>final<|message|>anchor slot<|end|><|channel|>final<|message|>block loss<|return|>")
