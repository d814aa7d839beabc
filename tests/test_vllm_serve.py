"""The target served by vLLM at an address (`dflash-fast serve-target --engine vllm`, data.source=vllm with
data.online.address): training steps equal the steps on the store `extract --engine vllm` writes, and a run killed
after a checkpoint resumes to the uninterrupted run's steps. One server per module (vLLM loads the target in ~40 s);
the trainers run in processes of their own, as in test_vllm_extract. Runs where vLLM is installed (.ci/run's second
venv); DFLASH_REQUIRE_VLLM=1 turns the skip into a failure there. The protocol's own tests need no vLLM:
tests/test_serve_target.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from test_vllm_extract import LAYER_IDS, OPTIONS, REPO, train_in_a_process  # noqa: E402
from tiny_targets import sample_records, write_jsonl  # noqa: E402

from dflash_fast.evaluate.quickstart import TARGET  # noqa: E402
from dflash_fast.extract.extract import extract  # noqa: E402
from dflash_fast.train.checkpoint import checkpoint_tags  # noqa: E402

# 8 steps of 2 micro-batches, a checkpoint every 2 steps (the newest kept): a run killed after step 4's checkpoint
# resumes from it.
RESUMABLE = {"schedule.steps": 8, "checkpoint.every": 2, "checkpoint.keep_last": 1}


def serve_command(port=0, **flags):
    flags = {"engine": "vllm", "target": TARGET, "layer-ids": ",".join(map(str, LAYER_IDS)), "dtype": "fp32",
             "topk": OPTIONS["topk"], "max-seq-len": OPTIONS["max_seq_len"], "parity-every": 1, "port": port, **flags}
    return [sys.executable, "-m", "dflash_fast.cli", "serve-target", *[f"--{k}={v}" for k, v in flags.items()]]


def start_server(log_path, **flags):
    """serve-target in a process of its own -> (the process, HOST:PORT once it listens)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    log = open(log_path, "w")
    proc = subprocess.Popen(serve_command(**flags), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while True:
        text = open(log_path).read()
        if " listening on " in text:
            return proc, text.split(" listening on ", 1)[1].split()[0]
        assert proc.poll() is None and time.time() < deadline, f"serve-target did not start: {text[-3000:]}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "mixed.jsonl", sample_records(8))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, address = start_server(tmp_path_factory.mktemp("server") / "serve.log")
    yield address
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def stores(request, data, tmp_path_factory):
    """{"vllm": the store `extract --engine vllm` writes with the server's settings} (train_in_a_process's),
    extracted while the server loads."""
    request.getfixturevalue("served")
    return {"vllm": extract(TARGET, data, str(tmp_path_factory.mktemp("stores") / "vllm"), engine="vllm",
                            **OPTIONS)["out"]}


def test_steps_from_the_vllm_served_target_equal_the_vllm_store_steps(stores, data, served, tmp_path):
    store = train_in_a_process(stores, data, str(tmp_path / "store"), "store", RESUMABLE)
    online = train_in_a_process(stores, data, str(tmp_path / "served"), "vllm",
                                {**RESUMABLE, "data.online.address": served})
    assert len(store) == 8
    assert online == pytest.approx(store, rel=1e-5)


def test_a_run_on_the_served_target_killed_after_a_checkpoint_resumes_to_the_same_steps(stores, data, served,
                                                                                         tmp_path):
    extra = {**RESUMABLE, "data.online.address": served}
    whole = train_in_a_process(stores, data, str(tmp_path / "whole"), "vllm", extra)
    parts = str(tmp_path / "parts")
    proc = train_in_a_process(stores, data, parts, "vllm", extra, wait=False)
    try:
        deadline = time.time() + 600
        while not any(int(t[4:]) >= 4 for t in checkpoint_tags(os.path.join(parts, "checkpoints"))):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.time() < deadline, "no checkpoint at step 4 within 600 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    killed_at = int(checkpoint_tags(os.path.join(parts, "checkpoints"))[-1][4:])
    assert 4 <= killed_at < 8
    resumed = train_in_a_process(stores, data, parts, "vllm", {**extra, "checkpoint.resume": "latest"})
    assert resumed == whole, "kill -9 + resume must reproduce the uninterrupted losses step for step"
