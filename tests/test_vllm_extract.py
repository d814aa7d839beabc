"""`extract --engine vllm`: the store vLLM's capture gives is the store the HF path gives, field by field.

The layer-id trap (spec.md §1): vLLM numbers its aux layers as HF's hidden_states (embeddings at 0), one higher than
our layer ids, and its aux id L is `last`. A tap shifted by one changes every stored hidden state, and these tests
compare each one. The engine tests run where vLLM is installed (.ci/run's second venv, docs/engine-target.md);
DFLASH_REQUIRE_VLLM=1 turns their skip into a failure there. The rest runs in every venv.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from launch_env import launch_env
from tiny_targets import make_tiny_target, sample_records, write_jsonl

from dflash_fast import cli
from dflash_fast.errors import UserError
from dflash_fast.evaluate.quickstart import TARGET
from dflash_fast.extract.extract import extract
from dflash_fast.extract.vllm_runner import SCRATCH_PREFIX, aux_layer_ids, engine_max_model_len, scratch_dir
from dflash_fast.store.fp8 import dequantize_fp8
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.target.load import load_head, load_target
from dflash_fast.target.norm import final_norm_module
from dflash_fast.target.records import Example

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM and os.environ.get("DFLASH_REQUIRE_VLLM") != "1",
                                reason="vLLM is not installed (docs/engine-target.md)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_LAYERS = 8  # the embedded target
LAYER_IDS = [0, 3, NUM_LAYERS - 1]  # the first layer, one inside, the last (the same tensor as `last`)
OPTIONS = dict(layer_ids=LAYER_IDS, dtype="fp32", topk=4, max_seq_len=96, batch_tokens=256, shard_tokens=300,
               parity_every=1, progress=False)


def test_our_layer_ids_are_vllm_aux_ids_one_higher_and_last_is_aux_id_num_layers():
    aux, tapped, last = aux_layer_ids([5, 0, 3], NUM_LAYERS)
    assert aux == [1, 4, 6, 8] and [aux[i] for i in tapped] == [6, 1, 4] and aux[last] == 8
    aux, tapped, last = aux_layer_ids([0, NUM_LAYERS - 1], NUM_LAYERS)  # id L-1 and `last`: one aux layer
    assert aux == [1, 8] and tapped == [0, 1] and last == 1


def test_vllm_is_never_asked_for_more_positions_than_the_target_has():
    config = SimpleNamespace(max_position_embeddings=2048)  # a target with 2048 positions
    docs = [Example(np.ones(n, dtype=np.int64), np.ones(n, dtype=np.bool_)) for n in (300, 2047)]
    assert engine_max_model_len(docs, 2048, config) == 2048  # the longest document and the one token generated
    assert engine_max_model_len([], 1024, config) == 1025  # a served target: any document up to --max-seq-len
    truncated = docs + [Example(np.ones(2048, dtype=np.int64), np.ones(2048, dtype=np.bool_))]  # --max-seq-len 2048
    for examples in (truncated, []):
        with pytest.raises(UserError) as e:
            engine_max_model_len(examples, 2048, config)
        assert str(e.value).startswith("--max-seq-len 2048 is too long for --engine vllm on this target: a document "
                                       "of 2048 tokens plus the one token vLLM generates needs 2049 positions and "
                                       "the target has 2048 (max_position_embeddings); pass --max-seq-len 2047")


def test_a_scratch_directory_left_by_a_dead_process_is_removed_and_a_live_ones_kept(tmp_path):
    """vLLM's captures go to a scratch directory named after its process; a process that died without its exit
    handlers left one behind in /dev/shm: the next runner removes it, never a running process's."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getppid()}-def"
    other = tmp_path / "dflash-vllm-notapid"
    for d in (dead, live, other):
        d.mkdir()
        (d / "capture.safetensors").write_bytes(b"x")
    new = scratch_dir(str(tmp_path))
    assert os.path.basename(new).startswith(f"{SCRATCH_PREFIX}{os.getpid()}-") and os.path.isdir(new)
    assert not dead.exists() and live.exists() and other.exists()


def test_the_head_alone_is_the_loaded_targets_final_norm_and_lm_head():
    _, norm, name, head = load_head(TARGET, torch.device("cpu"), torch.float32)
    model = load_target(TARGET, torch.device("cpu"), torch.float32)
    full_norm, full_name = final_norm_module(model)
    assert name == full_name
    assert torch.equal(norm.weight, full_norm.weight)
    assert torch.equal(head.weight, model.get_output_embeddings().weight)


def test_tensor_parallel_size_without_the_vllm_engine_is_one_error_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", sample_records(2))
    argv = ["extract", "--target", TARGET, "--data", str(data), "--out", str(tmp_path / "out"),
            "--tensor-parallel-size", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --tensor-parallel-size is the engine's: it needs --engine vllm") and \
        err.count("\n") == 1


def test_engine_vllm_without_vllm_installed_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    data = write_jsonl(tmp_path / "d.jsonl", sample_records(2))
    argv = ["extract", "--engine", "vllm", "--target", TARGET, "--data", str(data), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --engine vllm needs vLLM") and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_engine_vllm_under_several_ranks_is_refused_before_loading(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sample_records(2))
    with pytest.raises(UserError, match="--engine vllm runs one engine for the whole job"):
        extract(TARGET, data, str(tmp_path / "out"), engine="vllm", rank=0, world_size=2, progress=False)


def test_data_source_vllm_under_several_ranks_is_refused_before_any_engine(monkeypatch):
    from dflash_fast.train.config import load_config
    from dflash_fast.train.data import open_source

    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                      ["data.source=vllm", f"model.target={TARGET}", "data.jsonl=never-read.jsonl"])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(UserError, match="data.source=vllm runs one vLLM engine inside a one-rank trainer"):
        open_source(cfg)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "mixed.jsonl", sample_records(8))


@pytest.fixture(scope="module")
def stores(tmp_path_factory, data):
    """{engine: store directory} of the same extraction (fp32, parity on every batch)."""
    root = tmp_path_factory.mktemp("stores")
    return {engine: extract(TARGET, data, str(root / engine), engine=engine, **OPTIONS)["out"]
            for engine in ("hf", "vllm")}


# Two engines (or TP ranks) sum a token's products in another order, so they round relative to the magnitude of the
# token's whole vector, not of each element: at 1k tokens an activation near 440 differs by 3e-4 absolute. Each
# token's largest difference is bounded by TOKEN_RTOL x (1 + its largest |value|).
TOKEN_RTOL = 1e-4


def assert_close_per_token(x, y, what):
    """x, y: [T, ...] one field of one item: each token t within TOKEN_RTOL * (1 + max |y[t]|)."""
    x, y = x.float().flatten(1), y.float().flatten(1)
    diff, scale = (x - y).abs().amax(1), y.abs().amax(1)
    bad = (diff > TOKEN_RTOL * (1 + scale)).nonzero().flatten()
    assert len(bad) == 0, (f"{what}: {len(bad)} token(s) differ beyond {TOKEN_RTOL} of the token's scale, the first "
                           f"at t={int(bad[0])}: {float(diff[bad[0]]):.3g} at scale {float(scale[bad[0]]):.3g}")


def assert_same_store(a_path, b_path):
    a, b = HiddenStateStore(a_path), HiddenStateStore(b_path)
    assert len(a) == len(b) > 0 and a.manifest["layer_ids"] == b.manifest["layer_ids"]
    for key in ("num_tokens", "num_loss_tokens", "dtype", "final_norm", "topk"):
        assert a.manifest.get(key) == b.manifest.get(key), key
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for key in ("input_ids", "loss_mask", "teacher_topk_ids"):
            assert torch.equal(x[key], y[key]), (key, i)
        for k, layer in enumerate(a.manifest["layer_ids"]):
            assert_close_per_token(x["hidden"][:, k], y["hidden"][:, k], f"item {i}, layer id {layer}")
        assert_close_per_token(x["last"], y["last"], f"item {i}, last")
        assert_close_per_token(x["teacher_topk_logits"], y["teacher_topk_logits"], f"item {i}, teacher top-k logits")
        torch.testing.assert_close(x["teacher_lse"], y["teacher_lse"], rtol=1e-4, atol=1e-4)


@needs_vllm
def test_vllm_store_is_the_hf_store_every_layer_last_and_teacher(stores):
    assert_same_store(stores["hf"], stores["vllm"])
    assert HiddenStateStore(stores["vllm"]).manifest["extraction"]["engine"] == "vllm"


@needs_vllm
def test_vllm_store_is_the_hf_store_at_1k_tokens(tmp_path):
    """At the lengths users extract: activations grow along a long context, and the two engines round relative to
    each token's scale (TOKEN_RTOL), which the 96-token records above never show."""
    with open(os.path.join(os.path.dirname(TARGET), "prompts_train.jsonl")) as f:
        texts = [json.loads(line)["conversations"][0]["content"] for line in f]
    records = [{"text": "\n".join(texts[i::2])} for i in range(2)]  # each far beyond 1024 tokens
    data = write_jsonl(tmp_path / "long.jsonl", records)
    options = {**OPTIONS, "max_seq_len": 1024, "batch_tokens": 2048, "shard_tokens": 4096}
    hf = extract(TARGET, data, str(tmp_path / "hf"), **options)["out"]
    assert HiddenStateStore(hf).lengths.tolist() == [1024, 1024]
    assert_same_store(hf, extract(TARGET, data, str(tmp_path / "vllm"), engine="vllm", **options)["out"])


@needs_vllm
def test_vllm_extraction_resumes_a_store_with_a_shard_missing(stores, data, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(stores["vllm"], out)
    os.remove(out / "manifest.json")
    shards = sorted((out / "shards").iterdir())
    assert len(shards) > 1
    shutil.rmtree(shards[-1])
    summary = extract(TARGET, data, str(out), engine="vllm", **OPTIONS)
    assert summary["tokens_run"] > 0 and summary["skipped_shards"] == len(shards) - 1
    assert_same_store(stores["hf"], out)


@needs_vllm
def test_vllm_fp8_store_is_the_hf_fp8_store(data, tmp_path):
    options = {**OPTIONS, "dtype": "fp8"}
    hf = extract(TARGET, data, str(tmp_path / "hf"), **options)["out"]
    vllm = extract(TARGET, data, str(tmp_path / "vllm"), engine="vllm", **options)["out"]
    a, b = HiddenStateStore(hf), HiddenStateStore(vllm)
    assert a.manifest["dtype"] == b.manifest["dtype"] == "float8_e4m3fn"
    for i in range(len(a)):
        x, y = a[i], b[i]
        for name in ("hidden", "last"):
            # One e4m3 step (2^-3 relative) where the fp32 values straddle a rounding boundary.
            xs, ys = (dequantize_fp8(s[name], s[f"{name}_scale"], torch.float32) for s in (x, y))
            assert ((xs - ys).abs() <= 2**-3 * xs.abs() + 1e-3).all(), (name, i)
        assert torch.equal(x["teacher_topk_ids"], y["teacher_topk_ids"])


@needs_vllm
def test_a_tensor_parallel_2_store_is_the_tensor_parallel_1_store(stores, data, tmp_path):
    # In a process of its own: TP starts worker processes, which this process's engines must not share a world with.
    out = tmp_path / "tp2"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items() if k not in ("layer_ids", "progress")]
    cmd = [sys.executable, "-m", "dflash_fast.cli", "extract", "--engine", "vllm", "--tensor-parallel-size", "2",
           "--target", TARGET, "--data", str(data), "--out", str(out), "--layer-ids", ",".join(map(str, LAYER_IDS)),
           *flags]
    env = launch_env("VLLM_CPU_OMP_THREADS_BIND")
    done = subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Each TP rank sums its heads' and MLP slices' partial products in another order: rounding (TOKEN_RTOL).
    assert_same_store(stores["vllm"], out)


@needs_vllm
def test_vllm_store_is_the_hf_store_for_a_tiny_llama(data, tmp_path):
    # hidden_size 128: vLLM's CPU attention takes head_dim 32, not the tiny targets' default 16.
    target = make_tiny_target(tmp_path / "llama", "llama", num_layers=4, hidden_size=128)
    options = {**OPTIONS, "layer_ids": [0, 1, 3]}
    assert_same_store(extract(target, data, str(tmp_path / "hf"), **options)["out"],
                      extract(target, data, str(tmp_path / "vllm"), engine="vllm", **options)["out"])


# ---------------------------------------------------------------- data.source=vllm: online from the engine


def train_in_a_process(stores, data, out, source, overrides=None, wait=True):
    """`python train.py` (configs/tiny.yaml, 4 steps of 2 micro-batches with hidden-state noise, then `overrides`)
    on the store vLLM extracted with OPTIONS (source "store"), or with data.source=vllm over the same JSONL and
    settings, in a process of its own: DeepSpeed and vLLM each set up torch.distributed once per process, as in a
    real run. -> its losses by step, or with `wait=False` the running process."""
    from test_trainer import losses
    from test_trainer import settings as trainer_settings

    extra = {"model.target": TARGET, "model.mask_token_id": 2047, "model.layer_ids": ",".join(map(str, LAYER_IDS)),
             "schedule.grad_accum": 2, "data.noise_std": 0.05}
    if source == "vllm":
        extra.update({"data.source": "vllm", "data.jsonl": str(data), "data.online.max_seq_len": OPTIONS["max_seq_len"],
                      "data.online.dtype": "fp32", "data.online.topk": OPTIONS["topk"],
                      "data.online.batch_tokens": OPTIONS["batch_tokens"], "data.online.parity_every": 1})
    extra.update(overrides or {})
    store = type("Store", (), {"store": stores["vllm"]})
    argv = trainer_settings(store, out, **{k.replace(".", "__"): v for k, v in extra.items()})
    env = launch_env()
    env["PYTHONPATH"] = REPO
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "tiny.yaml"),
           *argv]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses(out)


@needs_vllm
def test_vllm_online_steps_equal_the_store_steps(stores, data, tmp_path):
    store = train_in_a_process(stores, data, str(tmp_path / "store"), "store")
    online = train_in_a_process(stores, data, str(tmp_path / "vllm"), "vllm")
    assert len(store) == 4
    assert online == pytest.approx(store, rel=1e-5)
