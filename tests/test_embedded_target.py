"""The embedded default target is a real, offline-loadable Qwen3 language model of the stdlib."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflash_fast

ASSETS = Path(dflash_fast.__file__).resolve().parent / "assets"
TARGET = ASSETS / "target"
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded_target.py"


def _train_script():
    spec = importlib.util.spec_from_file_location("train_embedded_target", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _train_script()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TARGET, local_files_only=True).eval()


@pytest.fixture(scope="module")
def report():
    return json.loads((TARGET / "train_report.json").read_text())


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_target_loads_offline_as_8_layer_fp32_qwen3(model, tokenizer):
    assert model.config.model_type == "qwen3"
    assert model.config.num_hidden_layers == 8
    assert model.config.tie_word_embeddings
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.mask_token == "<|mask|>" and 0 <= tokenizer.mask_token_id < len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert set(model.generation_config.eos_token_id) == {tokenizer.eos_token_id, tokenizer.pad_token_id}


def test_target_files_stay_small():
    size = sum(p.stat().st_size for p in TARGET.iterdir())
    assert size < 16 * 2**20, f"embedded target is {size / 2**20:.1f} MiB; keep it a few MiB"


def test_report_names_the_command_and_a_trained_loss(report, tokenizer):
    assert report["command"].startswith("python ") and "train_embedded_target.py" in report["command"]
    assert isinstance(report["seed"], int) and report["steps"] > 0 and report["train_wall_seconds"] > 0
    assert report["heldout_loss"] < 0.5 * math.log(len(tokenizer))


def test_heldout_loss_recomputed_matches_a_trained_model(script, model, tokenizer, report):
    root = script.stdlib_root()
    rels = [r for r in script.stdlib_files(root) if script.file_split(r) == "heldout"]
    stream = script.token_stream(tokenizer, script.read_texts(root, rels))
    windows = script.heldout_windows(stream, 256, 8)
    loss = script.lm_loss(model, windows, batch_size=8)
    # A slice of 8 windows scatters around the full held-out mean; random
    # weights would sit near log(V) = 7.6 nats.
    assert loss < report["heldout_loss"] + 0.5
    assert loss < 0.5 * math.log(len(tokenizer))


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    masked = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    answer = [t for t, m in zip(masked["input_ids"], masked["assistant_masks"]) if m]
    assert tokenizer.decode(answer) == "A<|im_end|>"


def test_generation_prompt_tokens_prefix_the_whole_conversation(tokenizer):
    user = "def f(x):\n    if x:"
    answer = "        return x\n    return None"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    whole = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                           {"role": "assistant", "content": answer}], return_dict=True)["input_ids"]
    # The "\n" ending the prompt must not merge with the answer's indentation,
    # or the target never saw, in training, the token boundary it answers from.
    assert whole[:len(prompt)] == prompt
    assert tokenizer.decode(whole[len(prompt):]) == answer + "<|im_end|>\n"


def test_greedy_chat_answers_continue_the_code_and_end(model, tokenizer):
    # Measured: 5 of these 8 answers end within 200 tokens (19 of all 40); a
    # random-weight model practically never emits <|im_end|> as its argmax.
    ended = 0
    for record in _read_jsonl(ASSETS / "prompts_eval.jsonl")[:8]:
        ids = tokenizer.apply_chat_template(record["conversations"], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=200, do_sample=False)[0, ids.shape[1]:]
        assert tokenizer.decode(out, skip_special_tokens=True).strip(), "the answer is empty"
        ended += out[-1].item() == tokenizer.eos_token_id
    assert ended >= 3, f"only {ended} of 8 greedy answers ended with <|im_end|> within 200 tokens"


def test_prompts_come_from_disjoint_heldout_files(script):
    sources = {}
    for split in ("train", "eval"):
        records = _read_jsonl(ASSETS / f"prompts_{split}.jsonl")
        assert all(r["conversations"][0]["role"] == "user" and r["conversations"][0]["content"] for r in records)
        sources[split] = {r["source"] for r in records}
        assert all(script.file_split(s) == "heldout" and script.prompt_split(s) == split for s in sources[split])
    assert not sources["train"] & sources["eval"]


def test_loss_by_position_scores_each_token_in_the_bucket_of_its_context_length(model, monkeypatch):
    """scripts/target_loss_by_position.py (docs/long-context.md's target table): position p, predicted from p
    tokens, lands in eval's context bucket of p, and each bucket's loss is the mean over exactly its tokens."""
    monkeypatch.syspath_prepend(str(TRAIN_SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("target_loss_by_position",
                                                  TRAIN_SCRIPT.parent / "target_loss_by_position.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    windows = torch.randint(0, 2048, (5, 131), generator=torch.Generator().manual_seed(0))
    buckets = module.loss_by_position(model, windows)
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(input_ids=windows).logits[:, :-1].transpose(1, 2),
                                                windows[:, 1:], reduction="none")
    assert [(b["context"], b["tokens"]) for b in buckets] == [("0-63", 5 * 63), ("64-127", 5 * 64),
                                                              ("128-255", 5 * 3)]
    for b, (lo, hi) in zip(buckets, [(1, 64), (64, 128), (128, 131)]):
        assert math.isclose(b["loss"], float(nll[:, lo - 1 : hi - 1].mean()), rel_tol=1e-5)
