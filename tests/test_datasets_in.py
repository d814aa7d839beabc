"""Hugging Face datasets as --data: each preset's schema, written as tiny parquet / arrow / save_to_disk files
(nothing downloaded), reads as the JSONL of the records it maps to; a row no preset fits is one error naming its
columns; regenerate -> extract take a dataset with --split and --max-samples."""
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_targets import make_tiny_target, make_tokenizer, write_jsonl

from dflash_fast import cli
from dflash_fast.target.datasets_in import NoPreset, is_dataset, preset_of, to_record
from dflash_fast.target.records import BadLine, ChatTokenizer, read_examples

CHAT = [{"role": "user", "content": "the anchor"}, {"role": "assistant", "content": "the block slot"}]
# preset -> (rows in the dataset's own schema, the records they map to)
SCHEMAS = {
    "sharegpt": (
        [{"conversations": [{"from": "human", "value": "the anchor"}, {"from": "gpt", "value": "the block slot"}]}],
        [{"conversations": CHAT}],
    ),
    "messages": (
        [{"prompt": "the anchor", "messages": CHAT, "prompt_id": "0"}],  # UltraChat's columns
        [{"conversations": CHAT}],
    ),
    "magpie": ([{"instruction": "the anchor", "response": "the block slot", "uuid": "u"}], [{"conversations": CHAT}]),
    "codealpaca": (
        [{"instruction": "the anchor", "input": "", "output": "the block slot"},
         {"instruction": "the anchor", "input": "of layer 3", "output": "the block slot"}],
        [{"conversations": CHAT},
         {"conversations": [{"role": "user", "content": "the anchor\n\nof layer 3"}, CHAT[1]]}],
    ),
    "opencodeinstruct": (
        [{"id": "1", "input": "the anchor", "output": "the block slot", "domain": "generic"}],
        [{"conversations": CHAT}],
    ),
    "tools": (
        [{"messages": [{"role": "user", "content": "weather in Paris?", "tool_calls": None},
                       {"role": "assistant", "content": None,
                        "tool_calls": [{"type": "function",
                                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                       {"role": "tool", "content": "sunny", "tool_calls": None},
                       {"role": "assistant", "content": "It is sunny.", "tool_calls": None}],
          "tools": json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])}],
        [{"conversations": [{"role": "user", "content": "weather in Paris?"},
                            {"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                              "arguments": '{"city": "Paris"}'}}]},
                            {"role": "tool", "content": "sunny"},
                            {"role": "assistant", "content": "It is sunny."}],
          "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}],
    ),
    "text": ([{"text": "the anchor token", "meta": "x"}], [{"text": "the anchor token"}]),
    # Salesforce xlam-function-calling-60k: tools and answers are JSON strings; xLAM's parameters are no JSON schema.
    "xlam": (
        [{"id": 0, "query": "weather in Paris?",
          "tools": json.dumps([{"name": "get_weather", "description": "the weather",
                                "parameters": {"city": {"type": "str", "description": "a city"}}}]),
          "answers": json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}])}],
        [{"conversations": [{"role": "user", "content": "weather in Paris?"},
                            {"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]}],
          "tools": [{"type": "function", "function": {
              "name": "get_weather", "description": "the weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "str", "description": "a city"}}}}}]}],
    ),
}
# Renders tools and tool calls as Qwen-style templates do, so that a record's tools reach the target's context.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }}({{ c['function']['arguments'] }})"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = TOOLS_TEMPLATE
    return ChatTokenizer(tok, len(tok))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3"), arch="qwen3", num_layers=2)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def tokens(examples):
    return [(e.input_ids.tolist(), e.loss_mask.tolist()) for e in examples]


@pytest.mark.parametrize("preset", sorted(SCHEMAS))
def test_each_preset_reads_as_the_jsonl_of_its_records(preset, tokenizer, tmp_path):
    rows, records = SCHEMAS[preset]
    path = write_parquet(tmp_path / f"{preset}.parquet", rows)
    assert is_dataset(path) and {preset_of(r) for r in pa.Table.from_pylist(rows).to_pylist()} == {preset}
    assert [to_record(r) for r in datasets.Dataset.from_list(rows)] == records
    from_dataset, stats, _ = read_examples(path, tokenizer, 512)
    from_jsonl, _, _ = read_examples(write_jsonl(tmp_path / "same.jsonl", records), tokenizer, 512)
    assert stats.sequences == len(rows) and tokens(from_dataset) == tokens(from_jsonl)


def test_tool_definitions_and_calls_are_in_the_context_and_only_the_calls_train(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "tools.parquet", SCHEMAS["tools"][0])
    [ex], _, _ = read_examples(path, tokenizer, 512)
    tok = tokenizer.tok
    text = tok.decode(ex.input_ids.tolist())
    trained = tok.decode([t for t, m in zip(ex.input_ids.tolist(), ex.loss_mask) if m])
    assert "# Tools\nget_weather" in text
    assert trained == ('<tool_call>get_weather({"city": "Paris"})</tool_call><|im_end|>\n'
                       "It is sunny.<|im_end|>\n")


def test_arrow_files_and_saved_datasets_read_their_split_and_first_rows(tokenizer, tmp_path):
    rows = [{"instruction": f"the anchor {i}", "response": "the block slot"} for i in range(5)]
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                  "test": datasets.Dataset.from_list(rows[:2])})
    saved.save_to_disk(str(tmp_path / "saved"))
    train, _, sha_train = read_examples(str(tmp_path / "saved"), tokenizer, 512)
    test, _, sha_test = read_examples(str(tmp_path / "saved"), tokenizer, 512, split="test")
    first3, _, _ = read_examples(str(tmp_path / "saved"), tokenizer, 512, max_samples=3)
    assert (len(train), len(test), len(first3)) == (5, 2, 3) and sha_train != sha_test
    assert tokens(first3) == tokens(train)[:3]
    arrow = next((tmp_path / "saved" / "train").glob("*.arrow"))
    assert tokens(read_examples(str(arrow), tokenizer, 512)[0]) == tokens(train)
    with pytest.raises(ValueError, match=r"no split 'validation': its splits are \['test', 'train'\]"):
        read_examples(str(tmp_path / "saved"), tokenizer, 512, split="validation")


def test_a_folder_of_a_hub_datasets_files_reads_its_split(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))  # load_dataset's cache
    rows = [{"messages": CHAT}, {"messages": CHAT[:1] + [{"role": "assistant", "content": "the layer"}]}]
    (tmp_path / "ds" / "data").mkdir(parents=True)
    write_parquet(tmp_path / "ds" / "data" / "train-00000-of-00001.parquet", rows)
    write_parquet(tmp_path / "ds" / "data" / "test-00000-of-00001.parquet", rows[:1])
    from_folder, _, _ = read_examples(str(tmp_path / "ds"), tokenizer, 512)
    test, _, _ = read_examples(str(tmp_path / "ds"), tokenizer, 512, split="test")
    from_jsonl, _, _ = read_examples(write_jsonl(tmp_path / "same.jsonl", [to_record(r) for r in rows]), tokenizer, 512)
    assert tokens(from_folder) == tokens(from_jsonl) and tokens(test) == tokens(from_jsonl)[:1]


def test_a_row_no_preset_fits_is_one_error_naming_its_columns(target, tmp_path, capsys):
    path = write_parquet(tmp_path / "odd.parquet", [{"question": "the anchor", "answer": "the block"}])
    with pytest.raises(NoPreset, match=r"columns found \['answer', 'question'\]"):
        to_record(pa.Table.from_pylist([{"question": "q", "answer": "a"}]).to_pylist()[0])
    rc = cli.main(["extract", "--target", target, "--data", path, "--out", str(tmp_path / "out"), "--estimate",
                   "--num-tapped", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {path}[train] row 0: fits no preset: columns found ['answer', 'question']")


def test_a_bad_row_is_refused_or_counted_with_skip_bad(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "mixed.parquet", [{"text": "the anchor"}, {"text": None, "other": "x"}])
    with pytest.raises(BadLine, match=r"row 1: fits no preset.*--skip-bad"):
        read_examples(path, tokenizer, 512)
    examples, stats, _ = read_examples(path, tokenizer, 512, skip_bad=True)
    assert len(examples) == 1 and stats.bad_lines == 1


def test_regenerate_then_extract_take_a_dataset_with_split_and_max_samples(target, tmp_path, capsys):
    rows = [{"instruction": f"say {w}", "input": "", "output": "old"} for w in ("anchor", "block", "slot")]
    datasets.DatasetDict({"eval": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "regen.jsonl"
    assert cli.main(["regenerate", "--target", target, "--data", str(tmp_path / "ds"), "--split", "eval",
                     "--max-samples", "2", "--out", str(out), "--max-new-tokens", "4", "--device", "cpu"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["conversations"][0]["content"] for r in written] == ["say anchor", "say block"]
    assert all(r["conversations"][-1]["content"] != "old" for r in written)
    store = tmp_path / "store"
    assert cli.main(["extract", "--target", target, "--data", str(out), "--out", str(store), "--dtype", "fp32",
                     "--num-tapped", "1"]) == 0
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["extraction"]["input"]["lines"] == 2
    capsys.readouterr()


def test_online_training_reads_data_split_and_max_samples_into_its_extraction(monkeypatch, tmp_path):
    from dflash_fast.train import data as data_module
    from dflash_fast.train.config import load_config

    seen = {}
    monkeypatch.setattr(data_module, "OnlineSource",
                        lambda _target, jsonl, options, **_: seen.update(jsonl=jsonl, options=options))
    cfg = load_config("configs/tiny.yaml", ["data.source=online", "model.target=t", f"data.jsonl={tmp_path}",
                                            "data.split=eval", "data.max_samples=7", f"output_dir={tmp_path}"])
    data_module.open_source(cfg)
    assert (seen["jsonl"], seen["options"].split, seen["options"].max_samples) == (str(tmp_path), "eval", 7)


def test_regenerate_prompts_keep_the_tools_and_earlier_tool_calls(tokenizer, tmp_path):
    from dflash_fast.target.prompts import encode_prompt, read_prompts

    rows = SCHEMAS["tools"][0]
    rows = [dict(rows[0], messages=rows[0]["messages"][:3] + [{"role": "user", "content": "and Rome?"}])]
    [prompt] = read_prompts(write_parquet(tmp_path / "tools.parquet", rows))
    text = tokenizer.tok.decode(encode_prompt(tokenizer.tok, prompt))
    assert "# Tools\nget_weather" in text and '<tool_call>get_weather({"city": "Paris"})' in text
    assert text.endswith("and Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_eval_reads_the_split_of_a_dataset_given_as_its_prompts(target, tmp_path, monkeypatch):
    from dflash_fast.evaluate import evaluate as evaluate_module

    rows = [{"instruction": f"say {w}", "response": "old"} for w in ("anchor", "block", "slot")]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                          "eval": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    read, seen = evaluate_module.read_prompts, []

    class Stop(Exception):
        pass

    def stop_before_the_model(*_args, **_kwargs):
        raise Stop

    monkeypatch.setattr(evaluate_module, "read_prompts", lambda *a: seen.extend(read(*a)) or seen)
    monkeypatch.setattr(evaluate_module, "load_model", stop_before_the_model)
    argv = ["eval", "--target", target, "--drafter", str(tmp_path), "--data", str(tmp_path / "ds")]
    for split, expected in (("eval", ["say anchor", "say block", "say slot"]), (None, ["say anchor"])):
        seen.clear()
        with pytest.raises(Stop):
            cli.main(argv + (["--split", split] if split else []))
        assert [p.messages[0]["content"] for p in seen] == expected
