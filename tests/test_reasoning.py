"""Reasoning data: `regenerate --thinking on|off` through the template's switch, gpt-oss replies split into their
analysis / final channels and rendered back, `data.reasoning: train|mask|drop`, and one training row per assistant
turn where the template drops earlier turns' reasoning (Qwen3's), so that training contexts are serving contexts."""
import json
import os

import pytest
from tiny_targets import make_tiny_target, make_tokenizer, write_jsonl
from transformers import AutoTokenizer

from dflash_fast import cli
from dflash_fast.errors import ConfigError
from dflash_fast.extract import regenerate as regen
from dflash_fast.target.harmony import split_channels
from dflash_fast.target.prompts import decode_reply
from dflash_fast.target.records import ChatTokenizer, read_examples

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3's chat template as it treats reasoning (written after the published one): `reasoning_content` or the text
# before `</think>`; assistant turns after the last user turn render `<think>...</think>` (the last one always),
# earlier ones their answer only; enable_thinking=false prefills an empty think block in the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}"
    "{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}{%- set reasoning = '' -%}"
    "{%- if m['reasoning_content'] is defined and m['reasoning_content'] is string -%}"
    "{%- set reasoning = m['reasoning_content'] -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n' + content }}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
HARMONY_REPLY = ("<|channel|>analysis<|message|>the token<|end|><|start|>assistant<|channel|>final<|message|>"
                 "anchor slot<|return|>")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("qwen3_tok"))
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("harmony_tok"), chat_format="harmony")


def trained(tok, ex):
    return tok.decode([t for t, m in zip(ex.input_ids.tolist(), ex.loss_mask) if m])


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


TWO_TURNS = [{"role": "user", "content": "hidden"},
             {"role": "assistant", "content": "<think>\nthe token\n</think>\n\nanchor slot"},
             {"role": "user", "content": "layer"},
             {"role": "assistant", "content": "<think>\nthe block\n</think>\n\nblock loss"}]


def test_a_template_that_drops_earlier_reasoning_trains_each_turn_in_its_serving_context(qwen3):
    rows = ChatTokenizer(qwen3, len(qwen3)).conversation_rows(TWO_TURNS)
    assert len(rows) == 2
    for row, turn in zip(rows, (1, 3)):
        # Serving turn `turn`: the template renders the chat so far with the generation prompt, the target generates
        # its reasoning and answer. The row is exactly that prompt (no loss) followed by what it generated (loss).
        prompt = qwen3(render(qwen3, TWO_TURNS[:turn], add_generation_prompt=True), add_special_tokens=False)
        ids = row.input_ids.tolist()
        assert ids[:len(prompt["input_ids"])] == prompt["input_ids"]
        assert not row.loss_mask[:len(prompt["input_ids"])].any() and row.loss_mask[len(prompt["input_ids"]):].all()
        assert trained(qwen3, row) == TWO_TURNS[turn]["content"] + "<|im_end|>\n"
    # Rendered once, the conversation holds the first turn without the reasoning the target generated before its
    # answer: that context is not the one turn 3 was served in, and the first turn's reasoning would never train.
    whole = render(qwen3, TWO_TURNS)
    first_turn_served = qwen3.decode(rows[0].input_ids.tolist())
    assert not whole.startswith(first_turn_served) and "the token" not in whole
    single = ChatTokenizer(qwen3, len(qwen3)).conversation(TWO_TURNS)
    assert trained(qwen3, single) == "anchor slot<|im_end|>\n<think>\nthe block\n</think>\n\nblock loss<|im_end|>\n"


def test_a_template_that_keeps_every_turn_as_served_stays_one_row(tmp_path):
    tok = make_tokenizer(tmp_path)  # plain ChatML: every turn is rendered as it was generated
    chat = ChatTokenizer(tok, len(tok))
    [row] = chat.conversation_rows(TWO_TURNS)
    single = chat.conversation(TWO_TURNS)
    assert row.input_ids.tolist() == single.input_ids.tolist() and row.loss_mask.tolist() == single.loss_mask.tolist()


def test_reasoning_train_mask_drop_decide_the_reasoning_spans_loss_and_presence(qwen3):
    inline = TWO_TURNS[:2]
    field = [inline[0], {"role": "assistant", "reasoning_content": "the token", "content": "anchor slot"}]
    by_mode = {mode: ChatTokenizer(qwen3, len(qwen3), mode).conversation_rows(inline) for mode in ("train", "mask",
                                                                                                      "drop")}
    [train], [mask], [drop] = by_mode["train"], by_mode["mask"], by_mode["drop"]
    assert trained(qwen3, train) == "<think>\nthe token\n</think>\n\nanchor slot<|im_end|>\n"
    # mask: the same tokens in the context, the reasoning without loss.
    assert mask.input_ids.tolist() == train.input_ids.tolist() and trained(qwen3, mask) == "anchor slot<|im_end|>\n"
    # drop: no reasoning at all; the template's switch off, so its empty think block is the prompt's, as it serves.
    text = qwen3.decode(drop.input_ids.tolist())
    assert "the token" not in text and text.endswith("assistant\n<think>\n\n</think>\n\nanchor slot<|im_end|>\n")
    assert trained(qwen3, drop) == "anchor slot<|im_end|>\n"
    for mode in ("train", "mask", "drop"):  # reasoning_content reads as the inline <think> part
        [a], [b] = ChatTokenizer(qwen3, len(qwen3), mode).conversation_rows(field), by_mode[mode]
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    with pytest.raises(ValueError, match="reasoning 'keep': choose one of"):
        ChatTokenizer(qwen3, len(qwen3), "keep")


def test_mask_keeps_gpt_oss_analysis_in_the_context_and_trains_the_final_channel(harmony):
    turns = [{"role": "user", "content": "hidden state"},
             {"role": "assistant", "thinking": "the token", "content": "anchor slot"}]
    [train] = ChatTokenizer(harmony, len(harmony)).conversation_rows(turns)
    [mask] = ChatTokenizer(harmony, len(harmony), "mask").conversation_rows(turns)
    assert trained(harmony, train) == HARMONY_REPLY and mask.input_ids.tolist() == train.input_ids.tolist()
    assert trained(harmony, mask) == "<|start|>assistant<|channel|>final<|message|>anchor slot<|return|>"


def test_a_gpt_oss_conversation_trains_each_turn_as_generated_after_the_history_the_template_keeps(harmony):
    turns = [{"role": "user", "content": "hidden state"},
             {"role": "assistant", "thinking": "the token", "content": "anchor slot"},
             {"role": "user", "content": "token layer"},
             {"role": "assistant", "thinking": "the block", "content": "block loss"}]
    rows = ChatTokenizer(harmony, len(harmony)).conversation_rows(turns)
    assert [trained(harmony, row) for row in rows] == [HARMONY_REPLY, HARMONY_REPLY.replace(
        "the token", "the block").replace("anchor slot", "block loss")]
    second = harmony.decode(rows[1].input_ids.tolist())
    assert second.startswith(render(harmony, turns[:3], add_generation_prompt=True))
    assert "<|channel|>final<|message|>anchor slot<|end|>" in second and "the token" not in second


def test_a_gpt_oss_reply_splits_into_its_channels_and_renders_back_to_the_generated_tokens(harmony):
    generated = harmony(HARMONY_REPLY, add_special_tokens=False)["input_ids"]
    reply = decode_reply(harmony, generated)
    assert reply == {"thinking": "the token", "content": "anchor slot"}
    turns = [{"role": "user", "content": "hidden state"}, {"role": "assistant", **reply}]
    [row] = ChatTokenizer(harmony, len(harmony)).conversation_rows(turns)
    ids = row.input_ids.tolist()
    assert ids[-len(generated):] == generated and row.loss_mask.sum() == len(generated)  # exactly what it generated
    # Cut at the token budget inside the analysis.
    assert split_channels("<|channel|>analysis<|message|>the to") == {"thinking": "the to", "content": ""}
    assert split_channels("anchor slot") is None


HARMONY_CALL = ('<|channel|>analysis<|message|>the token<|end|><|start|>assistant to=functions.get_weather'
                '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": CITY}}]


def test_a_gpt_oss_function_call_becomes_tool_calls_and_renders_back_to_the_generated_tokens(harmony):
    generated = harmony(HARMONY_CALL, add_special_tokens=False)["input_ids"]
    reply = decode_reply(harmony, generated)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert reply == {"thinking": "the token", "content": "", "tool_calls": [call]}
    turns = [{"role": "user", "content": "hidden state"}, {"role": "assistant", **reply}]
    prompt = harmony(render(harmony, turns[:1], tools=TOOLS, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    [row] = ChatTokenizer(harmony, len(harmony)).conversation_rows(turns, TOOLS)
    assert row.input_ids.tolist() == prompt + generated  # the prompt it was served, then exactly what it generated
    assert not row.loss_mask[:len(prompt)].any() and row.loss_mask[len(prompt):].all()
    # The harmony docs' form, the recipient in the channel header and <|constrain|>json, is the same call (the
    # template renders it in its own form); a call cut before <|call|>, a commentary to no function, a final
    # answer after the call or arguments that are not a JSON object stay text.
    docs_form = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
    assert split_channels(docs_form) == {"content": "", "tool_calls": [call]}
    for text in ('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Par',
                 "<|channel|>commentary<|message|>let me look<|end|>",
                 HARMONY_CALL + "<|start|>assistant<|channel|>final<|message|>sunny<|return|>",
                 "<|channel|>commentary to=functions.get_weather json<|message|>[1]<|call|>",
                 "<|channel|>commentary to=browser.search json<|message|>{}<|call|>"):
        assert split_channels(text) is None, text


def test_a_gpt_oss_tool_conversation_trains_the_calls_and_answer_not_the_tool_output(harmony):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turns = [{"role": "user", "content": "hidden state"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "sunny"},
             {"role": "assistant", "thinking": "the block", "content": "anchor slot"}]
    [row] = ChatTokenizer(harmony, len(harmony)).conversation_rows(turns, TOOLS)
    call_text = HARMONY_CALL.split("<|start|>assistant", 1)[1]
    tool_output = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
    answer = HARMONY_REPLY.replace("the token", "the block")
    text = harmony.decode(row.input_ids.tolist())
    assert text.endswith(f"<|start|>assistant{call_text}{tool_output}<|start|>assistant{answer}")
    # Trained: each turn after its generation prompt, the call and the answer with its analysis; the tool's output
    # and the generation prompts are context.
    assert trained(harmony, row) == call_text + answer


def test_a_gpt_oss_answer_after_a_reasoned_call_trains_in_the_context_it_was_served(harmony):
    # The template drops a call's analysis once an answer follows it, but the answer was generated after the call
    # with its analysis (the prompt then had no answer yet): the answer's row is that prompt, then the answer.
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turns = [{"role": "user", "content": "hidden state"},
             {"role": "assistant", "thinking": "the token", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "sunny"},
             {"role": "assistant", "thinking": "the block", "content": "anchor slot"}]
    assert "the token" not in render(harmony, turns, tools=TOOLS)
    rows = ChatTokenizer(harmony, len(harmony)).conversation_rows(turns, TOOLS)
    answer = HARMONY_REPLY.replace("the token", "the block")
    assert [trained(harmony, row) for row in rows] == [HARMONY_CALL, answer]
    served = render(harmony, turns[:3], tools=TOOLS, add_generation_prompt=True)
    assert harmony.decode(rows[1].input_ids.tolist()) == served + answer and "the token" in served


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss", num_layers=2)


def test_regenerate_writes_gpt_oss_channels_and_the_thinking_switch_extraction_renders_with(gpt_oss, tmp_path,
                                                                                            monkeypatch):
    tok = AutoTokenizer.from_pretrained(gpt_oss)
    generated = tok(HARMONY_REPLY, add_special_tokens=False)["input_ids"]
    prompts = []
    monkeypatch.setattr(regen, "generate_batch", lambda _model, batch, *_a, **_k: prompts.extend(batch)
                        or [generated] * len(batch))
    data = write_jsonl(tmp_path / "p.jsonl", [{"conversations": [{"role": "user", "content": "hidden state"}]}])
    out = tmp_path / "regen.jsonl"
    assert cli.main(["regenerate", "--target", gpt_oss, "--data", str(data), "--out", str(out), "--thinking", "off",
                     "--device", "cpu"]) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert "Reasoning: low" in tok.decode(prompts[0])
    assert record["conversations"][-1] == {"role": "assistant", "thinking": "the token", "content": "anchor slot"}
    assert record["chat_template_kwargs"] == {"reasoning_effort": "low"} and record["sampling"]["thinking"] == "off"
    # Extraction renders the record with the switch it was generated under: the row is the prompt the target saw,
    # then exactly the tokens it generated.
    [row], _, _ = read_examples(out, ChatTokenizer(tok, len(tok)), 512)
    assert row.input_ids.tolist() == prompts[0] + generated and row.loss_mask.sum() == len(generated)


def test_regenerate_thinking_sets_qwen3s_switch_and_extraction_keeps_it(tmp_path, monkeypatch):
    target = make_tiny_target(tmp_path / "qwen3", arch="qwen3", num_layers=2)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(target)
    replies = {"off": "anchor slot<|im_end|>", "on": "<think>\nthe token\n</think>\n\nanchor slot<|im_end|>"}
    prompts = []
    monkeypatch.setattr(regen, "generate_batch", lambda _model, batch, *_a, **_k: prompts.extend(batch)
                        or [answer] * len(batch))
    data = write_jsonl(tmp_path / "p.jsonl", [{"conversations": [{"role": "user", "content": "hidden"}]}])
    for thinking in ("off", "on"):
        prompts.clear()
        answer = tok(replies[thinking], add_special_tokens=False)["input_ids"]
        out = tmp_path / f"{thinking}.jsonl"
        regen.regenerate(target, str(data), str(out), thinking=thinking, device="cpu", progress=False)
        [record] = [json.loads(line) for line in out.read_text().splitlines()]
        assert record["chat_template_kwargs"] == {"enable_thinking": thinking == "on"}
        assert tok.decode(prompts[0]).endswith("<think>\n\n</think>\n\n" if thinking == "off" else "assistant\n")
        [row], _, _ = read_examples(out, ChatTokenizer(tok, len(tok)), 512)
        ids, generated = row.input_ids.tolist(), prompts[0] + answer  # the template ends the turn with "\n" after it
        assert ids[:len(generated)] == generated and tok.decode(ids[len(generated):]) == "\n"
        if thinking == "off":  # the prefilled empty think block is the prompt's, not trained
            assert trained(tok, row) == "anchor slot<|im_end|>\n"
    with pytest.raises(ValueError, match="thinking 'maybe': choose on or off"):
        regen.regenerate(target, str(data), str(tmp_path / "x.jsonl"), thinking="maybe")


def test_data_reasoning_reaches_the_extraction_and_a_bad_value_is_one_config_error(monkeypatch, tmp_path):
    from dflash_fast.train import data as data_module
    from dflash_fast.train.config import load_config

    seen = {}
    monkeypatch.setattr(data_module, "OnlineSource", lambda _t, _j, options, **_: seen.update(options=options))
    base = ["data.source=online", "model.target=t", f"data.jsonl={tmp_path}", f"output_dir={tmp_path}"]
    data_module.open_source(load_config("configs/tiny.yaml", base + ["data.reasoning=mask"]))
    assert seen["options"].reasoning == "mask"
    assert load_config("configs/tiny.yaml", base).data.reasoning == "train"
    with pytest.raises(ConfigError, match="data.reasoning='keep' is not one of train, mask, drop"):
        load_config("configs/tiny.yaml", base + ["data.reasoning=keep"])


def test_extract_reasoning_flag_is_part_of_the_job(qwen3, tmp_path):
    from dflash_fast.extract.plan import ExtractOptions, plan_job

    target = make_tiny_target(tmp_path / "t", arch="qwen3", num_layers=2)
    qwen3.save_pretrained(target)
    data = write_jsonl(tmp_path / "d.jsonl", [{"conversations": TWO_TURNS}])
    jobs = {mode: plan_job(target, str(data), None, ExtractOptions(reasoning=mode, num_tapped=1), "cpu", 0, 1)
            for mode in ("train", "mask")}
    assert "reasoning" not in jobs["train"].identity and jobs["mask"].identity["reasoning"] == "mask"
    assert jobs["train"].id != jobs["mask"].id and jobs["train"].stats.sequences == 2
    masked = [trained(qwen3, ex) for ex in jobs["mask"].examples]
    assert masked == ["anchor slot<|im_end|>\n", "block loss<|im_end|>\n"]
    with pytest.raises(ValueError, match="choose one of"):
        ExtractOptions(reasoning="keep")


def test_regenerate_refuses_to_resume_with_the_other_thinking_switch(tmp_path):
    """A file of --thinking on responses continued with --thinking off (or the template's default) would train on
    two kinds of reply at once: refused, naming both settings, before the target loads."""
    out = tmp_path / "out.jsonl"
    on = dict(engine="hf", temperature=0.0, top_p=1.0, top_k=0, seed=0, max_new_tokens=8, thinking="on")
    out.write_text(json.dumps({"index": 0, "text": "hi there", "sampling": on}) + "\n")
    prompts = [{"text": "hi"}, {"text": "ho"}]
    never_loaded = tmp_path / "target"
    never_loaded.mkdir()
    (never_loaded / "config.json").write_text("{}")
    for thinking, asked in (("off", "thinking=off"), (None, "thinking=the template default")):
        with pytest.raises(ValueError, match=f"written with .*thinking=on; this run asks for .*{asked}: resuming"):
            regen.regenerate(str(never_loaded), prompts, str(out), max_new_tokens=8, thinking=thinking,
                             progress=False)


def test_the_thinking_state_is_read_from_the_template_by_rendering(qwen3, tmp_path):
    from dflash_fast.target.prompts import thinking_state

    assert [thinking_state(qwen3, t) for t in (None, True, False)] == ["on", "on", "off"]  # Qwen3: on by default
    assert thinking_state(make_tokenizer(tmp_path), None) is None  # plain ChatML: no switch


def test_a_store_records_the_thinking_its_conversations_were_rendered_with(tmp_path):
    """extraction.thinking counts the conversations by the switch they were rendered with (the record's
    chat_template_kwargs, as regenerate --thinking writes them; reasoning=drop turns it off)."""
    from dflash_fast.extract.extract import extract
    from dflash_fast.store.reader import HiddenStateStore

    target = make_tiny_target(tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(target)
    turn = [{"role": "user", "content": "hidden"}, {"role": "assistant", "content": "anchor slot"}]
    records = [{"conversations": turn, **({"chat_template_kwargs": {"enable_thinking": False}} if i % 3 == 0 else {})}
               for i in range(6)] + [{"text": "no template"}]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    for reasoning, want in (("train", {"off": 2, "on": 4}), ("drop", {"off": 6})):
        extract(target, str(data), str(tmp_path / reasoning), layer_ids=[1, 3], dtype="fp32", progress=False,
                reasoning=reasoning)
        assert HiddenStateStore(str(tmp_path / reasoning)).manifest["extraction"]["thinking"] == want


def test_validation_prompts_of_the_other_thinking_setting_get_one_warning_line():
    from dflash_fast.target.prompts import thinking_mismatch

    line = thinking_mismatch({"on": 40, "off": 2}, "off", "validation.prompts (validation.thinking=off)")
    assert line.startswith("warning: validation.prompts (validation.thinking=off) render with thinking off, but 40 "
                           "of the 42 training conversations were rendered with thinking on") and "\n" not in line
    assert thinking_mismatch({"on": 40}, "on", "x") is None
    assert thinking_mismatch({}, "off", "x") is None and thinking_mismatch({"on": 3}, None, "x") is None


def test_eval_warns_in_one_line_when_its_prompts_use_the_other_thinking_setting_than_the_exported_drafter(
        tmp_path, capsys):
    """A store rendered with thinking on -> the run's provenance.json -> `dflash-fast export` records it in config.json
    (dflash_fast.thinking) -> `dflash-fast eval --thinking off` warns once, of the export and of the checkpoint (its
    run's provenance.json); `--thinking on` does not, nor does an export written before the field; a field that is
    not counts is refused by name."""
    from safetensors.torch import save_file

    from dflash_fast.drafter.model import build_drafter
    from dflash_fast.extract.extract import extract
    from dflash_fast.store.reader import HiddenStateStore
    from dflash_fast.train.checkpoint import WEIGHTS, write_marker
    from dflash_fast.train.config import load_config
    from dflash_fast.train.trackers import provenance

    target = make_tiny_target(tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(target)
    turn = [{"role": "user", "content": "hidden"}, {"role": "assistant", "content": "anchor slot"}]
    records = [{"conversations": turn, "chat_template_kwargs": {"enable_thinking": True}}] * 3
    extract(target, str(write_jsonl(tmp_path / "data.jsonl", records)), str(tmp_path / "store"), layer_ids=[1, 3],
            dtype="fp32", progress=False)
    manifest = HiddenStateStore(str(tmp_path / "store")).manifest
    assert manifest["extraction"]["thinking"] == {"on": 3}

    drafter = build_drafter(target, [1, 3], mask_token_id=0, num_layers=1, block_size=4)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step00000001"
    ckpt.mkdir(parents=True)
    save_file({n: p.detach() for n, p in drafter.named_parameters()}, str(ckpt / WEIGHTS))
    config = load_config(os.path.join(REPO, "configs", "tiny.yaml")).to_dict()
    write_marker(str(ckpt), {"drafter": drafter.config.to_dict(), "verifier": target, "step": 1, "config": config})
    (run / "provenance.json").write_text(json.dumps(provenance(config, manifest, {}, 0, 1)))
    export = str(tmp_path / "export")
    assert cli.main(["export", "--checkpoint", str(run), "--out", export, "--dtype", "fp32"]) == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["dflash_fast"]["thinking"] == {"on": 3}
    assert "| thinking | on (3 conversations)" in (tmp_path / "export" / "README.md").read_text()
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"conversations": turn[:1]}])

    def warnings(thinking, drafter=export):
        capsys.readouterr()
        assert cli.main(["eval", "--target", target, "--drafter", drafter, "--data", str(prompts), "--thinking",
                         thinking, "--max-new-tokens", "2", "--no-baseline", "--no-offline"]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]

    assert warnings("off") == [
        "warning: eval prompts (--thinking off) render with thinking off, but 3 of the 3 training conversations were "
        "rendered with thinking on: acceptance here is measured on another distribution than the drafter learned "
        "(docs/troubleshooting.md#thinking-on-in-training-off-in-serving)"]
    assert warnings("on") == []
    assert warnings("off", str(run)) == [  # the checkpoint itself: its run's provenance.json
        "warning: eval prompts (--thinking off) render with thinking off, but 3 of the 3 training conversations were "
        "rendered with thinking on: acceptance here is measured on another distribution than the drafter learned "
        "(docs/troubleshooting.md#thinking-on-in-training-off-in-serving)"]
    assert warnings("off", str(ckpt)) != [] and warnings("on", str(run)) == []
    from dflash_fast.evaluate.evaluate import evaluate

    capsys.readouterr()  # `--engine both`: vLLM's run of the same prompts has warned, ours does not say it again
    evaluate(target, str(prompts), export, max_new_tokens=2, offline=False, baseline=False, progress=False,
             thinking="off", warn_thinking=False)
    assert "warning:" not in capsys.readouterr().err
    del exported["dflash_fast"]["thinking"]  # an export written before dflash-fast recorded it
    (tmp_path / "export" / "config.json").write_text(json.dumps(exported))
    assert warnings("off") == []
    exported["dflash_fast"]["thinking"] = {"on": "3"}
    (tmp_path / "export" / "config.json").write_text(json.dumps(exported))
    assert cli.main(["eval", "--target", target, "--drafter", export, "--data", str(prompts)]) == 1
    assert "config.json: dflash_fast.thinking.on must be a non-negative integer" in capsys.readouterr().err


def test_an_online_source_counts_the_thinking_its_conversations_render_with_for_the_runs_provenance(tmp_path):
    """An online run keeps no store, yet its rows render the same conversations: its source counts them as
    extraction does, and the run's provenance.json records them (what export carries on and eval warns against)."""
    from dflash_fast.data.online import OnlineSource
    from dflash_fast.extract.plan import ExtractOptions
    from dflash_fast.train.config import load_config
    from dflash_fast.train.trackers import provenance

    target = make_tiny_target(tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(target)
    turn = [{"role": "user", "content": "hidden"}, {"role": "assistant", "content": "anchor slot"}]
    records = [{"conversations": turn, "chat_template_kwargs": {"enable_thinking": i != 1}} for i in range(3)]
    data = str(write_jsonl(tmp_path / "data.jsonl", records))
    source = OnlineSource(target, data, ExtractOptions(layer_ids=[1, 3], dtype="fp32"))
    assert source.manifest["extraction"]["thinking"] == {"off": 1, "on": 2}
    config = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                         ["data.source=online", f"data.jsonl={data}", f"model.target={target}"]).to_dict()
    assert provenance(config, source.manifest, {}, 0, 1)["data"]["thinking"] == {"off": 1, "on": 2}
