"""A resume that changes the schedule: the resuming run's config governs every step after the resume, the first
included (docs/training.md, "Resuming with another schedule")."""
import pytest
from test_trainer import records, run, tiny  # noqa: F401 (tiny: the module's fixture, a store of ~30 documents)

from dflash_fast.train.optim import lr_multiplier

LR, WARMUP_RATIO = 3e-3, 0.25


def test_first_resumed_step_runs_at_the_new_schedules_learning_rate(tiny, tmp_path):  # noqa: F811
    out = str(tmp_path / "run")
    common = dict(optimizer__lr=LR, schedule__warmup_ratio=WARMUP_RATIO, schedule__kind="cosine",
                  schedule__min_lr_ratio=0.1, export=False)
    run(tiny, out, schedule__steps=2, **common)  # its schedule ends at step 2: update 2 would run at the floor
    run(tiny, out, schedule__steps=6, checkpoint__resume="latest", **common)
    lrs = {r["step"]: r["lr"] for r in records(out)}
    assert sorted(lrs) == list(range(1, 7))
    warmup = round(WARMUP_RATIO * 6)
    for step in (3, 4, 5, 6):  # record `step` is update step - 1 (0-based)
        assert lrs[step] == pytest.approx(LR * lr_multiplier(step - 1, 6, warmup, "cosine", 0.1), rel=1e-9), (
            f"step {step} after the resume must run at the 6-step schedule's learning rate"
        )
