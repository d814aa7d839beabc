"""The README's first command on a reduced budget: every stage of the real pipeline runs and hands
its output to the next (regenerate -> extract -> deepspeed train.py -> export -> eval), and with --online without
the extract stage."""
import json
import os

from dflash_fast.evaluate.quickstart import quickstart

SMALL = [
    "schedule.steps=3",
    "logging.every=1",
    "validation.every=0",
    "data.batch_rows=1",
    "data.seq_len=256",
    "data.num_anchors=16",
]


def small_quickstart(out, **options):
    return quickstart(str(out), num_prompts=12, eval_prompts=2, max_new_tokens=24, eval_max_new_tokens=16,
                      extra_overrides=SMALL, progress=False, **options)


def test_quickstart_pipeline_runs_end_to_end_on_a_small_budget(tmp_path):
    out = tmp_path / "qs"
    report = small_quickstart(out)
    assert report["prompts"] == 2 and report["greedy_mismatches"] == 0
    histogram = report["acceptance_histogram"]
    assert report["tau"] == sum((n + 1) * c for n, c in enumerate(histogram)) / sum(histogram)
    # tau_offline scores one block per reply token but the last.
    assert report["offline_blocks"] == report["new_tokens"] - report["prompts"] > 0
    assert json.loads((out / "eval.json").read_text())["tau"] == report["tau"]
    exported = json.loads((out / "run" / "export" / "config.json").read_text())
    assert exported["speculators_model_type"] == "dflash"
    assert exported["aux_hidden_state_layer_ids"] == [
        i + 1 for i in json.loads((out / "store" / "manifest.json").read_text())["layer_ids"]
    ]
    steps = [
        json.loads(line)["step"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert max(steps) == 3
    # a second run resumes every stage instead of redoing it
    again = small_quickstart(out)
    assert again["tau"] == report["tau"]
    assert len((out / "train.jsonl").read_text().splitlines()) == 12
    assert os.path.isdir(out / "run" / "checkpoints")


def test_quickstart_online_trains_without_a_store(tmp_path):
    out = tmp_path / "qs"
    report = small_quickstart(out, online=True)
    assert not os.path.exists(out / "store"), "online: nothing hidden is written"
    assert report["greedy_mismatches"] == 0 and report["tau"] >= 1.0
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(r["step"] for r in records) == 3
    assert all(r["time_target_forward_ms"] > 0 for r in records if r["split"] == "train")


def test_quickstart_dspark_trains_exports_and_decodes_greedy_exact(tmp_path):
    out = tmp_path / "qs"
    report = small_quickstart(out, drafter="dspark")
    assert report["greedy_mismatches"] == 0 and report["block_size"] == 9, "8 drafted tokens: sample_from_anchor"
    assert len(report["confidence_calibration"]) == 8
    exported = json.loads((out / "run" / "export" / "config.json").read_text())
    assert exported["speculators_model_type"] == "dspark" and exported["markov_rank"] == 64
    assert exported["enable_confidence_head"] is True and exported["sample_from_anchor"] is True


def test_the_dspark_config_is_tiny_yaml_plus_the_dspark_keys():
    import yaml

    from dflash_fast.evaluate.quickstart import REPO

    def read(name):
        with open(os.path.join(REPO, "configs", name)) as f:
            return yaml.safe_load(f)

    dflash, dspark = read("tiny.yaml"), read("tiny_dspark.yaml")
    added = {"model": {"sample_from_anchor", "markov_rank", "markov_head_type", "confidence_head",
                       "confidence_head_with_markov"}, "loss": {"confidence_alpha"}}
    for section, keys in added.items():
        assert set(dspark[section]) - set(dflash[section]) == keys
        for key in keys:
            del dspark[section][key]
    del dflash["output_dir"], dspark["output_dir"]
    assert dspark == dflash


def test_chained_prompts_fill_their_token_budget_and_end_with_a_user_turn():
    from transformers import AutoTokenizer

    from dflash_fast.evaluate.quickstart import TARGET, chain_turns
    from dflash_fast.target.prompts import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    answered = [{"conversations": [{"role": "user", "content": f"def f{i}(x):\n    return x + {i}\n"},
                                   {"role": "assistant", "content": f"\ndef g{i}(y):\n    return y * {i}\n"}],
                 "source": f"file{i}.py"} for i in range(40)]

    def length(turns):
        return len(encode_prompt(tokenizer, read_prompts([{"conversations": turns}])[0]))

    record, used = chain_turns(answered, tokenizer, 300)
    turns = record["conversations"]
    assert [t["role"] for t in turns] == ["user", "assistant"] * (used - 1) + ["user"]
    assert turns[-1] == answered[used - 1]["conversations"][0] and record["sources"] == [f"file{i}.py" for i in
                                                                                       range(used)]
    assert 1 < used < 40 and length(turns) <= 300
    assert length(turns[:-1] + answered[used - 1]["conversations"][1:] + answered[used]["conversations"][:1]) > 300
    alone, one = chain_turns(answered, tokenizer, 1)
    assert one == 1 and alone["conversations"] == answered[0]["conversations"][:1], "a first prompt over budget stays"


def test_quickstart_long_context_trains_long_rows_and_evaluates_past_the_short_length(tmp_path):
    import yaml

    from dflash_fast.evaluate.quickstart import MAX_SEQ_LEN
    from dflash_fast.store.reader import HiddenStateStore

    out = tmp_path / "qs"
    report = quickstart(str(out), num_prompts=12, eval_prompts=2, max_new_tokens=24, eval_max_new_tokens=16,
                        extra_overrides=["schedule.steps=2", "logging.every=1", "validation.every=0",
                                         "data.val_fraction=0"],
                        progress=False, long_context=True)
    chained = [json.loads(line) for line in (out / "train_long.jsonl").read_text().splitlines()]
    assert sum(len(r["sources"]) for r in chained) == 12, "every answered training prompt is chained once"
    assert all(r["conversations"][-1]["role"] == "assistant" for r in chained)
    assert max(HiddenStateStore(str(out / "store")).lengths) > MAX_SEQ_LEN
    assert yaml.safe_load((out / "run" / "config.yaml").read_text())["data"]["seq_len"] == 2048
    assert report["greedy_mismatches"] == 0 and report["prompts"] == 2
    contexts = [b["context"] for b in report["acceptance_by_context"]]
    assert contexts[0] == "128-255" and contexts[-1] == "1024-2047"
