"""Where a run's metrics go besides OUT/metrics.jsonl and TensorBoard, and what the run records about itself.

    provenance       the resolved config, the package version and git commit, the data's identity and the target's
                     config hash: OUT/provenance.json, and each tracker's run config / params
    WandbTracker     logging.wandb: a Weights & Biases run (WANDB_MODE=offline writes it under OUT/wandb)
    MlflowTracker    logging.mlflow: an MLflow run (MLFLOW_TRACKING_URI, e.g. file:///runs/mlruns; mlflow's default
                     otherwise)

Every tracker logs the metrics.jsonl records under TensorBoard's names (`train/loss`, `val/tau_offline`, ...) at
their step. A resumed run continues the same tracker runs: their ids are kept in OUT/trackers.json.
"""
import datetime
import json
import os
import subprocess
from typing import Dict, List, Optional

import yaml

from dflash_fast.data.source import Source
from dflash_fast.errors import STR, MapOf, read_mapping
from dflash_fast.serve.model_card import PROVENANCE
from dflash_fast.store.format import write_json_atomic
from dflash_fast.train.metrics import MetricsLog

TRACKER_IDS = "trackers.json"


def _version(package: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> Optional[Dict]:
    """{commit, dirty} of the checkout dflash_fast runs from; None when it is not a git checkout (a wheel, even one
    installed inside another project's repository)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10)
        lines = commit.stdout.split()
        if commit.returncode != 0 or len(lines) != 2 or os.path.realpath(lines[0]) != os.path.dirname(
                os.path.realpath(here)):
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": lines[1], "dirty": bool(status.stdout.strip())}


def provenance(config: Dict, manifest: Dict, data_identity: Dict, resumed_step: int, world_size: int) -> Dict:
    """What a run is: `config` (resolved), the code (package version, git commit, library versions), the data
    (the store or online source, its extraction's data path and sha256, the batching identity) and the target
    (path and config.json sha256, from the manifest)."""
    extraction = manifest.get("extraction", {})
    stored = Source(config["data"]["source"]).reads_store
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "resumed_step": resumed_step,
        "world_size": world_size,
        "code": {"dflash_fast": _version("dflash-fast"), "git": git_commit(),
                 **{p: _version(p) for p in ("torch", "transformers", "deepspeed")}},
        "target": {k: manifest.get("target", {}).get(k) for k in ("path", "config_sha256", "model_type")},
        "data": {"source": config["data"]["source"], "store": config["data"]["store"] or None,
                 "jsonl": config["data"]["jsonl"] or None,
                 **{k: extraction.get(k) for k in ("data", "data_sha256", "job")}, "identity": data_identity,
                 # an assistant turn's reasoning: extract --reasoning for a store (None: extracted before it was
                 # recorded), data.reasoning for online rows
                 "reasoning": extraction.get("reasoning") if stored
                 else config["data"]["reasoning"],
                 # conversations rendered with the target thinking on / off (a store's or an online source's
                 # extraction.thinking; the export carries it on for eval to warn against)
                 "thinking": extraction.get("thinking")},
        "config": config,
    }


def write_provenance(out_dir: str, record: Dict) -> str:
    path = os.path.join(out_dir, PROVENANCE)
    write_json_atomic(path, record)
    return path


def _flat(tree: Dict, prefix: str = "") -> Dict[str, str]:
    """{"a.b": "value"} of a nested dict, values as strings (MLflow params)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


def scalars(entry: Dict) -> Dict[str, float]:
    """A metrics.jsonl record as tracker scalars: `split/key` of every number but the step (TensorBoard's names)."""
    return {f"{entry['split']}/{k}": float(v) for k, v in entry.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class WandbTracker:
    def __init__(self, out_dir: str, project: str, name: str, record: Dict, run_id: Optional[str]):
        import wandb

        self.run = wandb.init(project=project, name=name, dir=out_dir, config=record, id=run_id,
                              resume="allow" if run_id else None)
        self.id = self.run.id

    def log(self, entry: Dict) -> None:
        self.run.log(scalars(entry), step=entry["step"])

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # the service process, now: left to wandb's atexit hook it outlived pytest's and died noisily


class MlflowTracker:
    def __init__(self, project: str, name: str, record: Dict, run_id: Optional[str]):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            from mlflow.entities import Param

            params = [Param(k, v[:6000]) for k, v in _flat(record["config"]).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        self.client.log_dict(run_id, record, PROVENANCE)
        self.client.set_tag(run_id, "git_commit", (record["code"]["git"] or {}).get("commit", "unknown"))
        self.client.set_tag(run_id, "target_config_sha256", str(record["target"]["config_sha256"]))
        self.client.set_tag(run_id, "data_sha256", str(record["data"]["data_sha256"]))
        self.id = run_id

    def log(self, entry: Dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, entry["step"]) for k, v in scalars(entry).items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def open_trackers(logging_cfg, out_dir: str, record: Dict, resumed_step: int) -> List:
    """The trackers logging.wandb / logging.mlflow ask for, each given the run's provenance `record`; a resumed run
    (resumed_step > 0) continues the runs OUT/trackers.json names."""
    path = os.path.join(out_dir, TRACKER_IDS)
    ids = {}
    if resumed_step and os.path.exists(path):
        ids = read_mapping(path, json.load, json.JSONDecodeError, ValueError, "JSON", "a JSON object",
                           schema=MapOf(STR))
    project, name = logging_cfg.project, os.path.basename(os.path.abspath(out_dir))
    trackers = {}
    if logging_cfg.wandb:
        trackers["wandb"] = WandbTracker(out_dir, project, name, record, ids.get("wandb"))
    if logging_cfg.mlflow:
        trackers["mlflow"] = MlflowTracker(project, name, record, ids.get("mlflow"))
    if trackers:
        write_json_atomic(path, {key: t.id for key, t in trackers.items()})
    return list(trackers.values())


def open_outputs(cfg, manifest: Dict, data_identity: Dict, step: int, rank: int, world_size: int) -> MetricsLog:
    """A run's output directory opened at `step` (0, or the resumed step): OUT/config.yaml (the resolved config),
    OUT/provenance.json and the W&B / MLflow runs, written by rank 0, and OUT/metrics.jsonl kept up to `step`."""
    trackers = []
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
        record = provenance(cfg.to_dict(), manifest, data_identity, step, world_size)
        write_provenance(cfg.output_dir, record)
        trackers = open_trackers(cfg.logging, cfg.output_dir, record, step)
    return MetricsLog(cfg.output_dir, step, cfg.logging.tensorboard, writer=rank == 0, trackers=trackers)
