"""`train.py --plan` before the extraction and with the target beside the drafter: a store not extracted yet is
planned from the target's config and the extraction settings (the same plan its store gives once extracted),
an in-process vLLM's device share is counted, and so is an fp8 quantisation's fp32 working set."""
import os
import re

import pytest
from test_memory import online_forward_peak, within
from test_trainer import TINY_YAML, settings, tiny  # noqa: F401 (tiny: the module's fixture)

from dflash_fast.extract.vllm_runner import GPU_MEMORY_UTILIZATION
from dflash_fast.store.format import Layout
from dflash_fast.train import trainer
from dflash_fast.train.memory import OnlineTarget, online_forward_bytes

EMBEDDED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_fast", "assets",
                        "target")
DEVICE = "4e9"


def planned(capsys, *args):
    trainer.main(["--config", TINY_YAML, "--plan", "--device-memory", DEVICE, *args])
    return capsys.readouterr().out


def terms(text):
    """term -> its value as printed (the plan's lines: '  NAME  1.23 MiB')."""
    return dict(re.findall(r"^  (\S.*?)\s{2,}([\d.]+ [MG]iB)", text, re.M))


def gib(value):
    """'1.50 GiB' or '12.00 MiB' -> GiB."""
    number, unit = value.split()
    return float(number) / (1 if unit == "GiB" else 1024)


def test_plan_of_a_store_not_extracted_yet_from_the_embedded_target(tmp_path, capsys):
    store, out = tmp_path / "store", tmp_path / "run"
    text = planned(capsys, f"model.target={EMBEDDED}", f"data.store={store}", f"output_dir={out}")
    assert "of the store not extracted yet): layer ids" in text and "peak per rank" in text, text
    assert "largest data.seq_len at data.num_anchors=64" in text
    assert not store.exists() and not out.exists()


def test_a_missing_store_without_a_target_says_both_ways_out(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        trainer.main(["--config", TINY_YAML, "--plan", f"data.store={tmp_path / 'store'}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist: extract it first, or pass model.target=" in err[0], err


def test_the_planned_store_plans_like_the_store_extracted_with_those_settings(tiny, tmp_path, capsys):  # noqa: F811
    """The fixture's store was extracted from tiny.target with layer ids 1, 2, fp32, top-k 8."""
    common = settings(tiny, str(tmp_path / "run"), model__target=tiny.target)
    extracted = planned(capsys, *common)
    before = planned(capsys, *common, f"data.store={tmp_path / 'not_yet'}", "model.layer_ids=[1,2]",
                     "data.online.dtype=fp32")
    assert "not extracted yet): layer ids [1, 2], float32, top-k 8, `last` kept" in before
    assert terms(before) == terms(extracted) and len(terms(extracted)) > 10
    assert before.splitlines()[-3:] == extracted.splitlines()[-3:]  # fits, the largest seq_len and num_anchors


def test_an_in_process_vllm_takes_its_share_of_the_device_in_the_plan(tiny, tmp_path, capsys):  # noqa: F811
    vllm = settings(tiny, str(tmp_path / "run"), data__source="vllm", model__target=tiny.target,
                    data__jsonl=str(tiny.root / "data.jsonl"), data__online__max_seq_len=64,
                    model__layer_ids="[1,2]")
    in_process = planned(capsys, *vllm)
    share = terms(in_process)["vLLM engine (gpu_memory_utilization)"]
    assert share == f"{GPU_MEMORY_UTILIZATION * float(DEVICE) / 2**30:.2f} GiB", in_process
    served = planned(capsys, *vllm, "data.online.address=127.0.0.1:7400")  # vLLM on another GPU: nothing here
    assert "vLLM engine" not in served and "online target" not in served
    assert gib(terms(in_process)["peak per rank"]) - gib(terms(served)["peak per rank"]) >= (
        GPU_MEMORY_UTILIZATION * float(DEVICE) / 2**30 - 0.01)


def test_fp8_quantisation_of_the_taps_is_in_the_online_forward(monkeypatch):
    """Many taps, a narrow MLP: quantize_fp8's fp32 working set over [T, K, H] is the forward's largest moment
    (the plan without it is a third short of what is allocated)."""
    hidden, inter, vocab, tokens, layers = 128, 128, 384, 256, 12
    layer_ids = [0, 2, 4, 6, 8, 10]
    measured = online_forward_peak(monkeypatch, (hidden, inter, vocab, tokens, layers), layer_ids,
                                   Layout(len(layer_ids), hidden, 4, "float8_e4m3fn", True))
    sizes = (0, layers, hidden, inter, vocab, tokens, len(layer_ids))
    within(measured, online_forward_bytes(OnlineTarget(*sizes, fp8=True), 4), "the fp8 online forward")
    assert online_forward_bytes(OnlineTarget(*sizes), 4) < 0.8 * measured
