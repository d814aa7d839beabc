"""`dflash-fast regenerate`: the target's own responses, batched, resumable, readable by extract."""
import json

import pytest
import torch
from tiny_targets import make_tiny_target, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_fast.cli import main
from dflash_fast.extract import regenerate as regen
from dflash_fast.target.records import ChatTokenizer

PROMPTS = [
    {"conversations": [{"role": "user", "content": "parse the arguments"}], "source": "argparse.py"},
    {"text": "def dumps(obj, *, skipkeys=False,"},
    {
        "conversations": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "wrap this text at forty columns please"},
        ]
    },
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "an old reply that is replaced"}]},
    {"text": "the anchor"},
    {
        "conversations": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "and the drafter?"},
        ]
    },
    {"text": "class TextWrapper:\n    def __init__(self, width=70):"},
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3"), arch="qwen3")


def by_index(path):
    with open(path) as f:
        records = [json.loads(line) for line in f]
    indices = [r["index"] for r in records]
    assert len(indices) == len(set(indices)), f"duplicated prompts in {path}: {sorted(indices)}"
    return {r["index"]: r for r in records}


def test_resume_after_interruption_neither_duplicates_nor_drops(target, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    sampled = dict(batch_size=3, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7, progress=False)
    whole = regen.regenerate(target, str(data), str(tmp_path / "whole.jsonl"), **sampled)
    assert (whole["written"], whole["skipped"]) == (len(PROMPTS), 0)

    calls, real = [], regen.generate_batch

    def crash_on_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    out = tmp_path / "resumed.jsonl"
    monkeypatch.setattr(regen, "generate_batch", crash_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(target, str(data), str(out), **sampled)
    assert sorted(by_index(out)) == [0, 1, 2]
    with open(out, "a") as f:
        f.write('{"index": 3, "conversations": [{"role": "us')  # a write torn by the crash
    monkeypatch.setattr(regen, "generate_batch", real)
    resumed = regen.regenerate(target, str(data), str(out), **sampled)
    assert (resumed["written"], resumed["skipped"]) == (len(PROMPTS) - 3, 3)
    assert by_index(out) == by_index(tmp_path / "whole.jsonl"), (
        "a resumed run must write what one uninterrupted run writes"
    )
    again = regen.regenerate(target, str(data), str(out), **sampled)
    assert again["written"] == 0 and len(by_index(out)) == len(PROMPTS)


def test_batched_greedy_responses_are_the_targets_own_and_extract_reads_them(target, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "regenerate",
                "--target",
                target,
                "--data",
                str(data),
                "--out",
                str(out),
                "--batch-size",
                "4",
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    records = by_index(out)
    assert sorted(records) == list(range(len(PROMPTS)))
    model, tok = AutoModelForCausalLM.from_pretrained(target).eval(), AutoTokenizer.from_pretrained(target)
    reader = ChatTokenizer(tok, model.config.vocab_size)
    for i, prompt in enumerate(regen.read_prompts(PROMPTS)):
        ids = regen.encode_prompt(tok, prompt)
        with torch.no_grad():
            alone = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids) :]
        want = tok.decode(alone, skip_special_tokens=True)
        got = records[i]
        if prompt.messages is not None:
            assert got["conversations"][:-1] == prompt.messages
            assert got["conversations"][-1] == {"role": "assistant", "content": want}, (
                f"prompt {i}: batching changed the reply"
            )
        else:
            assert got["text"] == prompt.text + want
        assert reader.record(got).loss_mask.any()
    assert records[0]["source"] == "argparse.py", "the input record's other keys are kept"
    assert all(r["sampling"] == dict(engine="hf", temperature=0.0, top_p=1.0, top_k=0, seed=0, max_new_tokens=12)
               for r in records.values()), "each record says which engine and settings wrote it"
    assert records[3]["conversations"][-1]["content"] != "an old reply that is replaced"


def test_output_of_another_prompt_file_is_refused(target, tmp_path):
    out = write_jsonl(tmp_path / "out.jsonl", [{"index": 0, "text": "something else entirely"}])
    with pytest.raises(ValueError, match="not a response to prompt 0"):
        regen.regenerate(target, PROMPTS, str(out), progress=False)


def test_conversation_without_a_user_turn_names_its_line(tmp_path):
    data = write_jsonl(
        tmp_path / "prompts.jsonl", [PROMPTS[0], {"conversations": [{"role": "system", "content": "x"}]}]
    )
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: the conversation has no user turn"):
        regen.read_prompts(str(data))


@pytest.mark.parametrize("first, second, named", [
    (dict(temperature=1.0, top_p=0.9, seed=7), dict(temperature=0.0, top_p=0.9, seed=7), "temperature=1.0"),
    (dict(seed=7, temperature=1.0), dict(seed=8, temperature=1.0), "seed=7"),
    (dict(max_new_tokens=4), dict(max_new_tokens=6), "max_new_tokens=4"),
])
def test_a_resume_with_other_sampling_settings_is_refused_naming_both(target, tmp_path, first, second, named):
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2])
    out = str(tmp_path / "out.jsonl")
    regen.regenerate(target, str(data), out, max_new_tokens=first.pop("max_new_tokens", 4), num_prompts=1,
                     progress=False, **first)
    before = open(out).read()
    asked = ", ".join(f"{k}={v}" for k, v in second.items())
    with pytest.raises(ValueError, match=f"out.jsonl:1 was written with .*{named}.*; this run asks for .*") as e:
        regen.regenerate(target, str(data), out, max_new_tokens=second.pop("max_new_tokens", 4), progress=False,
                         **second)
    assert all(part in str(e.value).split("this run asks for")[1] for part in asked.split(", ")), str(e.value)
    assert open(out).read() == before, "nothing is appended to a file of other settings"
