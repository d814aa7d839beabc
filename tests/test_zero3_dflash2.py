"""DFlash2 (spec.md §9) under DeepSpeed ZeRO-3 on the CPU (gloo): its convolutions' base kernels and the selector's
codebooks are parameters its modules read outside their own forward, so ZeRO-3 must gather them there. One launch
of 2 ranks trains with ZeRO-1, -2 and -3 (parameters really partitioned: no persistence threshold), as
tests/test_trainer.py does for DFlash; the three must give the same losses and the same weights. With Muon, one
rank in this process under ZeRO-1 and partitioned ZeRO-3."""
import json
import os
import subprocess
import sys

import pytest
import torch
from launch_env import launch_env
from test_trainer import REPO, TINY_YAML, losses, records, run, settings, tiny  # noqa: F401 (tiny is a fixture)

from dflash_fast.train.checkpoint import load_drafter_for_export
from dflash_fast.train.distributed import free_port

DFLASH2 = dict(model__conv_kernel_size=2, model__conv_group_size=16, model__selector_rank=8,
               model__selector_top_k=4, loss__selector_alpha=0.5, export="false")


def test_dflash2_trains_alike_under_zero_1_2_and_partitioned_3(tiny, tmp_path):  # noqa: F811
    ds3 = json.loads(open(os.path.join(REPO, "configs", "ds_zero3.json")).read())
    ds3["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    (tmp_path / "ds_zero3_partitioned.json").write_text(json.dumps(ds3))
    ds_files = [os.path.join(REPO, "configs", "ds_zero1.json"), os.path.join(REPO, "configs", "ds_zero2.json"),
                str(tmp_path / "ds_zero3_partitioned.json")]
    # The in-process runs of other tests made this process a world of one; the launcher's ranks get their own.
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(REPO, "tests", "test_trainer_launch.py"), str(tmp_path / "two"), ",".join(ds_files), TINY_YAML,
           *settings(tiny, "unused", schedule__steps=3, data__val_fraction=0.1, checkpoint__every=3, **DFLASH2)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    runs = [str(tmp_path / "two" / f"run{i}") for i in range(3)]
    reference = losses(runs[0])
    assert sorted(reference) == [1, 2, 3]
    assert "recall_at_k" in records(runs[0])[0], "a DFlash2 run logs its selector's recall"
    for stage, out in zip((2, 3), runs[1:]):
        got = losses(out)
        assert got.keys() == reference.keys()
        for step, loss in reference.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), f"ZeRO-{stage}, step {step}"
        assert records(out, "val")[0]["loss"] == pytest.approx(records(runs[0], "val")[0]["loss"], rel=1e-5)
    weights = [dict(load_drafter_for_export(out)[0].named_parameters()) for out in runs]
    for name, w in weights[0].items():
        for stage, other in zip((2, 3), weights[1:]):
            torch.testing.assert_close(other[name], w, rtol=1e-4, atol=1e-5, msg=f"ZeRO-{stage} {name}")
    assert any(name.startswith("candidate_selector.") for name in weights[0])
    assert any(name.endswith("attention_conv.base_kernel") for name in weights[0])


def test_dflash2_with_muon_trains_alike_under_zero_1_and_partitioned_3(tiny, tmp_path):  # noqa: F811
    """DFlash2's default recipe is Muon, which takes its [2, taps, H] base kernels and [V, r] codebooks too: one
    rank in this process, ZeRO-1 against ZeRO-3 with every parameter partitioned, the same losses."""
    got = {}
    for stage in (1, 3):
        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        (tmp_path / f"zero{stage}.json").write_text(json.dumps({"zero_optimization": zero}))
        out = str(tmp_path / f"run{stage}")
        with torch._dynamo.config.patch(disable=True):  # DeepSpeed compiles its Muon update; eager is the same math
            run(tiny, out, deepspeed=str(tmp_path / f"zero{stage}.json"), optimizer__kind="muon",
                optimizer__grad_clip=0.0, schedule__steps=3, **DFLASH2)
        got[stage] = losses(out)
    assert sorted(got[1]) == [1, 2, 3]
    for step, loss in got[1].items():
        assert got[3][step] == pytest.approx(loss, rel=1e-5), f"step {step}"
