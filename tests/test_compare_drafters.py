"""bench/compare_drafters.py (docs/dflash2.md): every drafter of every seed trains with the same overrides and
budget on one store, its report holds each run and the table the seeds' spread; a rerun reads finished runs back."""
import importlib.util
import json
import os

from dflash_fast.evaluate.quickstart import REPO


def load_script():
    path = os.path.join(REPO, "bench", "compare_drafters.py")
    spec = importlib.util.spec_from_file_location("compare_drafters", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_every_drafter_and_seed_gets_the_same_budget_and_the_report_holds_every_run(tmp_path, monkeypatch):
    script, calls = load_script(), []

    def fake_quickstart(out, drafter, extra_overrides, **_):
        calls.append((os.path.basename(out), drafter, list(extra_overrides)))
        tau = {"dflash": 1.1, "dspark": 1.2, "dflash2": 1.3}[drafter] + 0.01 * len(calls)
        report = {"tau": tau, "tau_offline": tau + 0.05, "greedy_mismatches": 0, "block_size": 8}
        if drafter == "dspark":
            report["confidence_calibration"] = [{"position": 1, "predicted": 0.2, "accepted": 0.1}]
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(report, f)
        return report

    def fake_store(base, **_):
        for name in ("train.jsonl", "store"):
            os.makedirs(os.path.join(base, name), exist_ok=True)

    monkeypatch.setattr(script, "build_store", fake_store)
    monkeypatch.setattr(script, "quickstart", fake_quickstart)
    argv = ["--out", str(tmp_path), "--seeds", "0,1,2", "--steps", "24", "loss.kind=kl"]
    script.main(argv)
    assert calls == [(f"{d}_s{s}", d, [f"seed={s}", "schedule.steps=24", "loss.kind=kl"])
                     for s in (0, 1, 2) for d in ("dflash", "dspark", "dflash2")]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["command"] == "python bench/compare_drafters.py " + " ".join(argv)
    assert len(results["runs"]) == 9 and results["budget"]["steps"] == 24
    assert [r["calibration"] is not None for r in results["runs"]] == [d == "dspark" for _ in range(3)
                                                                         for d in ("dflash", "dspark", "dflash2")]
    table = (tmp_path / "table.md").read_text()
    dflash2_taus = [r["tau"] for r in results["runs"] if r["drafter"] == "dflash2"]
    assert f"({min(dflash2_taus):.3f}–{max(dflash2_taus):.3f})" in table  # the seeds' range of each drafter
    script.main(argv)  # finished runs are read back, not trained again
    assert len(calls) == 9
