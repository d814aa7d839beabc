"""W&B and MLflow beside TensorBoard (offline: WANDB_MODE=offline, an MLflow file store in a tmp dir): the same
metric names and values as metrics.jsonl, and every run's provenance in OUT/provenance.json and in each tracker."""
import glob
import json
import os
import struct
import sys

import pytest
import yaml
from test_trainer import TINY_YAML, losses, records, run, tiny  # noqa: F401  (tiny: the module's fixture)

from dflash_fast.train.config import ConfigError, load_config
from dflash_fast.train.trackers import git_commit


def wandb_offline_run(path):
    """(history rows {key: value}, run config {key: value}) of an offline run's .wandb file: wandb's LevelDB-style
    log (a 7-byte file header, 32 KiB blocks of chunks: crc u32, length u16, type u8; 1 full, 2 first, 3 middle,
    4 last) of wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, rows, config = open(path, "rb").read(), 7, b"", [], {}
    while pos + 7 <= len(data):
        if (block_left := 32768 - pos % 32768) < 7:
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif record.WhichOneof("record_type") == "run":
                config.update((item.key, json.loads(item.value_json)) for item in record.run.config.update)
    return rows, config


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores in maintenance mode
    return tmp_path


def test_wandb_and_mlflow_get_the_metrics_jsonl_scalars_and_the_provenance(tiny, offline):  # noqa: F811
    from mlflow.tracking import MlflowClient

    out = str(offline / "run")
    run(tiny, out, schedule__steps=3, logging__wandb="true", logging__mlflow="true", logging__project="p",
        data__val_fraction=0.1, validation__every=3, export="false")

    with open(os.path.join(out, "provenance.json")) as f:
        provenance = json.load(f)
    manifest = json.load(open(os.path.join(tiny.store, "manifest.json")))
    assert provenance["config"] == yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert provenance["target"]["config_sha256"] == manifest["target"]["config_sha256"]
    assert provenance["data"]["data_sha256"] == manifest["extraction"]["data_sha256"]
    assert provenance["data"]["identity"]["store_tokens"] == manifest["num_tokens"]
    assert provenance["code"]["git"] == git_commit() and provenance["code"]["torch"]

    [wandb_file] = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    rows, wandb_config = wandb_offline_run(wandb_file)
    assert {row["_step"]: row["train/loss"] for row in rows} == pytest.approx(losses(out), rel=1e-6)
    assert rows[-1]["val/tau_offline"] == pytest.approx(records(out, "val")[-1]["tau_offline"], rel=1e-6)
    assert wandb_config["target"] == provenance["target"] and wandb_config["data"] == provenance["data"]
    from wandb.sdk import wandb_setup

    assert wandb_setup._singleton is None  # the run closed W&B's service; none left to interpreter exit

    client = MlflowClient()
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")}
    assert history == pytest.approx(losses(out), rel=1e-6)
    assert {"train/tau_offline", "train/lr", "val/loss"} <= set(mlflow_run.data.metrics)
    assert mlflow_run.data.params["optimizer.lr"] == str(provenance["config"]["optimizer"]["lr"])
    assert mlflow_run.data.tags["target_config_sha256"] == manifest["target"]["config_sha256"]
    artifact = client.download_artifacts(mlflow_run.info.run_id, "provenance.json", str(offline))
    assert json.load(open(artifact))["config"] == provenance["config"]
    assert json.load(open(os.path.join(out, "trackers.json")))["mlflow"] == mlflow_run.info.run_id


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_is_one_config_error_naming_it(package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    with pytest.raises(ConfigError, match=rf"logging.{package}=true needs the {package} package: pip install"):
        load_config(TINY_YAML, [f"logging.{package}=true"])


def test_a_resumed_run_continues_its_mlflow_run_and_a_fresh_one_starts_another(offline):
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from dflash_fast.train.trackers import open_trackers, provenance

    out = str(offline / "run")
    os.makedirs(out)
    cfg = load_config(TINY_YAML)
    record = provenance(cfg.to_dict(), {"target": {"config_sha256": "c0de"}}, {"seed": 0}, 0, 1)
    logging_cfg = SimpleNamespace(wandb=False, mlflow=True, project="p")
    ids = []
    for resumed_step in (0, 3, 0):
        [tracker] = open_trackers(logging_cfg, out, record, resumed_step)
        tracker.log({"split": "train", "step": resumed_step + 1, "loss": 1.0})
        tracker.close()
        ids.append(tracker.id)
    assert ids[1] == ids[0] and ids[2] != ids[0]
    history = MlflowClient().get_metric_history(ids[0], "train/loss")
    assert sorted(m.step for m in history) == [1, 4]
