"""Tiny random targets built in code: a byte-level BPE tokenizer and small Qwen3 /
Llama / Qwen3-Next / Qwen3.5 / Qwen3-MoE / gpt-oss causal LMs, and Qwen3-VL / Qwen3.5 multimodal checkpoints
(`...ForConditionalGeneration`, vision tower included), saved like a hub checkpoint.

Nothing is downloaded. Everything is seeded, so the same call writes the same
files. The models are small enough that extracting a few hundred tokens takes a
fraction of a second on one CPU core.
"""
import inspect
import json
import os
import random
import textwrap

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HARMONY_TOKENS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# gpt-oss's harmony format as its published chat template renders a conversation: a system message of metadata,
# the first system turn as the developer's instructions, the last assistant turn with its reasoning (`thinking`,
# analysis channel) and answer (final channel) ending in <|return|>, earlier assistant turns as their final channel
# only, ending in <|end|>; the generation prompt is `<|start|>assistant`. With `tools`: the developer message lists
# them (the published template also writes each one's parameters as TypeScript types, left out here); an assistant
# turn's first tool call renders as `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>` +
# its arguments through tojson + `<|call|>`, after its analysis unless a later assistant turn answers without a
# call; a tool message as `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>` + its content
# through tojson + `<|end|>`.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{% set loop_messages = messages %}{% set developer_message = '' %}"
    "{% if messages[0]['role'] in ('system', 'developer') %}{% set loop_messages = messages[1:] %}"
    "{% set developer_message = messages[0]['content'] %}{% endif %}"
    "{% if developer_message or tools %}<|start|>developer<|message|>"
    "{% if developer_message %}# Instructions\n\n{{ developer_message }}\n\n{% endif %}"
    "{% if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    "type {{ fn.name }} = () => any;\n\n{% endfor %}} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% set last_tool_call = namespace(name=none) %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% if '<|channel|>' in message['content'] %}"
    "{{ raise_exception('pass the analysis in thinking and the answer in content, without <|channel|> tags') }}"
    "{% endif %}"
    "{% if 'tool_calls' in message %}"
    "{% set future_final = namespace(found=false) %}"
    "{% for later in loop_messages[loop.index:] %}"
    "{% if later['role'] == 'assistant' and 'tool_calls' not in later %}{% set future_final.found = true %}{% endif %}"
    "{% endfor %}"
    "{% set tool_call = message.tool_calls[0] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "{% if message.content and message.thinking %}"
    "{{ raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}"
    "{% elif message.content and not future_final.found %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.content }}<|end|>"
    "{% elif message.thinking and not future_final.found %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{% endif %}"
    "<|start|>assistant to=functions.{{ tool_call.name }}<|channel|>commentary "
    "{{ tool_call.content_type if tool_call.content_type is defined else 'json' }}<|message|>"
    "{{ tool_call.arguments | tojson }}<|call|>"
    "{% set last_tool_call.name = tool_call.name %}"
    "{% elif loop.last and not add_generation_prompt %}"
    "{% if 'thinking' in message %}<|start|>assistant<|channel|>analysis<|message|>{{ message['thinking'] }}"
    "<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|return|>"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>"
    "{% set last_tool_call.name = none %}{% endif %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if last_tool_call.name is none %}"
    "{{ raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}"
    "{% endif %}"
    "<|start|>functions.{{ last_tool_call.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ message['content'] | tojson }}<|end|>"
    "{% elif message['role'] == 'user' %}<|start|>user<|message|>{{ message['content'] }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

ARCHS = ("qwen3", "llama", "qwen3_next", "qwen3_5", "qwen3_moe", "gpt_oss", "qwen3_vl", "qwen3_5_vl")
# Checkpoints shipped as `...ForConditionalGeneration` (vision tower + language model), used as text targets.
MULTIMODAL = ("qwen3_vl", "qwen3_5_vl")


def _training_text():
    """A few hundred lines of English and Python: the docstrings and source of stdlib modules."""
    import argparse
    import json as json_module
    import textwrap as textwrap_module

    lines = []
    for module in (argparse, json_module, textwrap_module):
        lines.extend(line for line in inspect.getsource(module).splitlines() if line.strip())
    rng = random.Random(0)
    words = "the a drafter target block token layer hidden state anchor slot loss teacher".split()
    lines.extend(" ".join(rng.choice(words) for _ in range(12)) for _ in range(200))
    return lines


def make_tokenizer(directory, vocab_size=384, chat_format="chatml"):
    """Train a byte-level BPE tokenizer with a chat template and save it to `directory`.

    Returns the `PreTrainedTokenizerFast`. chat_format "chatml": special tokens `<|endoftext|>` (pad),
    `<|im_start|>`, `<|im_end|>` (eos, ends every chat turn). "harmony" (gpt-oss): `<|endoftext|>` (pad),
    `<|start|>`, `<|end|>`, `<|message|>`, `<|channel|>`, `<|return|>` (eos, ends a reply), `<|call|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=HARMONY_TOKENS if chat_format == "harmony" else SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|return|>" if chat_format == "harmony" else "<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=HARMONY_TEMPLATE if chat_format == "harmony" else CHAT_TEMPLATE,
    )
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


def tiny_sizes(hidden_size):
    """The attention and MLP sizes of every tiny model, target or drafter: 4 heads of hidden / 4 (2 kv heads),
    an MLP of 2 x hidden."""
    return dict(hidden_size=hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                intermediate_size=2 * hidden_size)


def _config(arch, vocab_size, num_layers, hidden_size, pad_token_id, eos_token_id, tie_word_embeddings):
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig, Qwen3VLConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    common = dict(
        vocab_size=vocab_size,
        **tiny_sizes(hidden_size),
        num_hidden_layers=num_layers,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2)
    if arch == "qwen3_moe":
        # output_router_logits as a training config would leave it: extraction must not depend on it.
        return Qwen3MoeConfig(num_experts=4, decoder_sparse_step=1, output_router_logits=True, **moe, **common)
    if arch == "gpt_oss":
        # Attention sinks, sliding (window 8, shorter than the test sequences) and full layers in turn, YaRN RoPE
        # with gpt-oss's factor 32 over 4096 positions.
        common.update(intermediate_size=hidden_size, max_position_embeddings=4096 * 32)
        return GptOssConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(num_layers)], **common)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                  deepstack_visual_indexes=[0])
    if arch == "qwen3_vl":
        text = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True}
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings)
    # Hybrid: linear-attention (gated delta net) layers with a full-attention layer every 2nd.
    hybrid = dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
    )
    if arch == "qwen3_next":
        return Qwen3NextConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            **hybrid,
            **common,
        )
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**hybrid, **common)
    if arch == "qwen3_5_vl":
        text = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
        vision.pop("deepstack_visual_indexes")
        return Qwen3_5Config(text_config={**hybrid, **text}, vision_config=vision,
                             tie_word_embeddings=tie_word_embeddings)
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")


def tiny_model(arch="qwen3", num_layers=6, hidden_size=64, vocab_size=384, seed=0, pad_token_id=None,
               eos_token_id=None, tie_word_embeddings=False):
    """A random fp32 causal LM of `arch`, in memory (`make_tiny_target` saves one with its tokenizer).

    Norm weights are randomised too (HF initialises them to 1, or 0 for the
    zero-centred norms of Qwen3-Next/Qwen3.5), so a norm applied twice, or with
    the wrong centring, changes the numbers and is caught by tests.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = _config(arch, vocab_size, num_layers, hidden_size, pad_token_id, eos_token_id, tie_word_embeddings)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch in MULTIMODAL else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model


def make_tiny_target(directory, arch="qwen3", num_layers=6, hidden_size=64, vocab_size=384, seed=0):
    """Build `tiny_model(arch, ...)` with a tokenizer of `vocab_size`, save both (safetensors); return `directory`."""
    directory = str(directory)
    chat_format = "harmony" if arch == "gpt_oss" else "chatml"
    tokenizer = make_tokenizer(directory, vocab_size=vocab_size, chat_format=chat_format)
    model = tiny_model(arch, num_layers, hidden_size, len(tokenizer), seed, tokenizer.pad_token_id,
                       tokenizer.eos_token_id)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_jsonl(path, records):
    """Write `records` (dicts) one JSON object a line; return `path`."""
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def sample_records(n=12, seed=0):
    """A mix of the three JSONL formats: chat conversations, plain text, pre-tokenized ids."""
    rng = random.Random(seed)
    words = textwrap.dedent(inspect.getsource(random.Random.shuffle)).split()
    out = []
    for i in range(n):
        def sentence(lo, hi):
            return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

        if i % 3 == 2:
            out.append({"text": sentence(10, 40)})
        else:
            turns = [{"role": "system", "content": sentence(2, 6)}] if i % 2 else []
            for _ in range(rng.randint(1, 2)):
                turns.append({"role": "user", "content": sentence(3, 12)})
                turns.append({"role": "assistant", "content": sentence(3, 20)})
            out.append({"conversations": turns})
    return out
