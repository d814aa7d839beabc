"""The README's first command on a reduced budget: every stage of the real pipeline runs and hands
its output to the next (regenerate -> extract -> deepspeed train.py -> export -> eval), and with --online without
the extract stage."""
import json
import os

from dflash_fast.quickstart import quickstart

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

    from dflash_fast.quickstart import REPO

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


def test_compare_dspark_passes_its_trainer_overrides_to_both_drafters_of_every_seed(tmp_path, monkeypatch):
    """scripts/compare_dspark.py key=value words reach every run (docs/dspark.md's table names its loss that way)."""
    import importlib.util

    from dflash_fast.quickstart import REPO

    spec = importlib.util.spec_from_file_location("compare_dspark", os.path.join(REPO, "scripts", "compare_dspark.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls = []

    def fake_quickstart(out, drafter, extra_overrides, **_):
        calls.append((os.path.basename(out), drafter, list(extra_overrides)))
        return {"tau": 1.0, "tau_offline": 1.0, "greedy_mismatches": 0, "block_size": 8}

    monkeypatch.setattr(script, "build_store", lambda *_, **__: None)
    monkeypatch.setattr(script, "quickstart", fake_quickstart)
    script.main(["--out", str(tmp_path), "--seeds", "0,1", "--steps", "48", "loss.kind=tv"])
    assert calls == [(f"{d}_s{s}", d, [f"seed={s}", "schedule.steps=48", "loss.kind=tv"])
                     for s in (0, 1) for d in ("dflash", "dspark")]
    assert len(json.loads((tmp_path / "summary.json").read_text())) == 4
