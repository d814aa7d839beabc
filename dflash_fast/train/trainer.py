"""The DeepSpeed training loop: `deepspeed train.py --config configs/<name>.yaml [key=value ...]`.

    store ──make_loader──▶ micro-batches ──drafter (DeepSpeed engine)──▶ loss ──backward──▶ AdamW or Muon (ZeRO 0-3)
    (data.source=online: JSONL ──the target's forward in this process, one micro-batch ahead──▶ micro-batches)
      every step:     metrics summed over micro-batches and ranks, then divided (spec.md §6)
      every N steps:  JSONL record, validation on the held-out split, checkpoint; real acceptance (validation.prompts:
                      the evaluator's decoding, handed in by train.py: dflash_fast/evaluate/validation.py)
      at the end:     checkpoint, validation, real acceptance beside the offline estimates, export (gated,
                      dflash_fast/serve/export.py) into OUT/export

One optimizer step is `schedule.grad_accum` micro-batches of `data.batch_rows`
rows on each rank. Its loss is the weighted mean over ALL valid slots of the
global batch (spec.md §5: sum(l * w * mask) / sum(mask)): before backward, each
micro-batch's loss is rescaled by its share of the step's global slot count,
so a step computes the same gradient however it is split into ranks and
micro-batches.

The parts, each built by its module's functions:

    data.py         the source (store or online target), each rank's batches, the resumable training stream
    model.py        the drafter (fresh, or model.init_from) matched against the store; the loss kind; the export format
    optim.py        the DeepSpeed JSON, the parameter groups, AdamW or Muon and its checks, the schedule
    distributed.py  the process group, the precision, the collectives a checkpoint or an export needs
    metrics.py      sums over micro-batches and ranks, the record window, OUT/metrics.jsonl
    checkpoint.py   which checkpoint to resume, saving one, setting aside a future the resume replaces

Run directory `output_dir` (OUT):

    OUT/config.yaml                  the resolved config
    OUT/metrics.jsonl                one record per `logging.every` steps ("split": "train") and per validation ("val")
    OUT/checkpoints/stepNNNNNNNN/    DeepSpeed's files, drafter.safetensors, rng_rankNNNNN.json and the completion
                                     marker dflash_fast.json (client state, every file's sha256): checkpoint.py
    OUT/export/                      the gated export (speculators layout, or zlab when only it serves the drafter)
    OUT/tensorboard/                 with logging.tensorboard=true
    OUT/provenance.json              config, code version and commit, data identity, target config hash (trackers.py)
    OUT/validation.json              with validation.prompts: offline estimates vs real tau at the end

Without a launcher (`python train.py ...`) the run is a world of one process;
under `deepspeed` (or `torchrun`) every rank runs it. `train(cfg)` runs one job
in this process (tests run several); `main()` is the process entry point.
"""
import argparse
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from dflash_fast.data.batches import derive_seed
from dflash_fast.data.source import Source
from dflash_fast.drafter import ops
from dflash_fast.drafter.losses import has_kl, needs_last
from dflash_fast.drafter.model import DrafterOutput
from dflash_fast.errors import DEBUG_ENV, ConfigError, UserError, run_reporting_errors
from dflash_fast.extract.vllm_runner import GPU_MEMORY_UTILIZATION
from dflash_fast.lock import output_lock
from dflash_fast.serve.engines import serving_engines
from dflash_fast.serve.export import export_run
from dflash_fast.store.format import torch_dtype
from dflash_fast.train.checkpoint import (
    CheckpointError,
    find_resume,
    load_training_state,
    restore_rng_state,
    resume_hint,
    save_checkpoint,
    set_aside_newer,
)
from dflash_fast.train.config import TrainConfig, load_config
from dflash_fast.train.data import (
    TrainStream,
    close_batches,
    data_identity,
    open_batches,
    open_source,
    planned_manifest,
    step_batches,
    to_device,
)
from dflash_fast.train.distributed import gathered_state, init_distributed, quiet_deepspeed, resolve_precision, sharing
from dflash_fast.train.memory import check_fits, device_bytes, gib, largest_fitting, run_plan, step_of
from dflash_fast.train.metrics import (
    Sums,
    Window,
    progress_bar,
    show_step,
    timed,
    train_record,
    val_record,
)
from dflash_fast.train.model import build_run_drafter, export_format, planned_drafter_config, resolve_loss_kind
from dflash_fast.train.optim import build_engine, check_muon_stepped, deepspeed_config, resume_schedule, total_steps
from dflash_fast.train.trackers import open_outputs

_NOISE_STREAM = 101  # derive_seed stream tag of the hidden-state noise, apart from batches.py's tags


class NonFiniteLoss(UserError):
    """A step produced a non-finite loss or gradient norm; nothing after the last good checkpoint is saved."""


class Trainer:
    """Builds everything from a validated config; `run()` trains, checkpoints, validates and exports."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device_memory: Optional[int] = None,
                 real_acceptance: Optional[Callable[["Trainer"], Any]] = None):
        """`device_memory`: the bytes the memory plan must fit (default: the GPU's; a CPU run has no limit).
        `real_acceptance(trainer)` (validation.prompts; train.py hands evaluate/validation.py's): called after
        each step as `.after_step(trainer, stopping)` and once at the end as `.finish(trainer)`."""
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.out_dir = cfg.output_dir
        self.checkpoints_dir = os.path.join(self.out_dir, "checkpoints")
        self.sharing = sharing(rank, world_size)
        self.stop_signal: Optional[str] = None
        ops.set_backend(cfg.kernels)

        self.store = open_source(cfg)  # online: an OnlineSource, read like a store
        manifest = self.store.manifest
        self.data_identity = data_identity(manifest, cfg, world_size)
        resume = find_resume(self.checkpoints_dir, cfg.checkpoint.resume, self.data_identity, self.log, self.sharing)
        self.target = cfg.model.target or manifest["target"]["path"]
        self.loss_kind = resolve_loss_kind(cfg.loss.kind, manifest)
        # Every store holds the teacher's top-k, so only kl reads `last` (ce takes the stored argmax).
        self.with_last = needs_last(self.loss_kind, stored_labels=True)
        self.precision, self.dtype = resolve_precision(cfg.precision)
        drafter = build_run_drafter(cfg, self.store.path, manifest, self.target, self.loss_kind, self.dtype, self.log)
        drafter.checkpoint_layers = cfg.model.activation_checkpointing
        self.export_format = export_format(cfg, drafter.config)
        self.block_size, self.sample_from_anchor = drafter.config.block_size, drafter.config.sample_from_anchor

        ds = deepspeed_config(cfg.deepspeed, cfg, self.precision)
        # No register_external_parameter for fc, hidden_norm and norm (read by DFlashDrafter.forward, not by their
        # own forward): ZeRO-3 detects such reads and gathers the parameters itself.
        self.zero_stage = ds.get("zero_optimization", {}).get("stage", 0)
        limit = device_bytes() if device_memory is None else device_memory
        plan = run_plan(cfg, drafter.config, ds, world_size, self.dtype, self.loss_kind, manifest, self.target, limit)
        self.log(check_fits(plan, limit, cfg))
        num_params = sum(p.numel() for p in drafter.parameters())
        self.stream = TrainStream(self.store, cfg, rank, world_size, with_last=self.with_last)
        self.total_steps = total_steps(cfg.schedule, self.stream.per_epoch)
        self.engine, self.optimizer, optimizer_line = build_engine(drafter, cfg, ds, self.total_steps)
        self.muon_unchecked = cfg.optimizer.kind == "muon" and self.zero_stage == 0
        self.device = self.engine.device
        self.step = 0
        self.last_checkpoint: Optional[str] = None
        self.saved_step: Optional[int] = None  # the step of this run's newest checkpoint (or the resumed one)
        self.validated_step: Optional[int] = None  # the step of its newest periodic validation
        if resume is not None:
            self._resume(*resume)
        self._log_setup(manifest, num_params, optimizer_line)
        # Rank 0 alone writes OUT's files: a disk error there stops every rank alike (Sharing.on_every_rank).
        self.metrics = self.sharing.on_every_rank(
            lambda: open_outputs(cfg, manifest, self.data_identity, self.step, rank, world_size), (OSError,))
        self.real = real_acceptance(self) if cfg.validation.prompts else None

    # ---- output

    def log(self, message: str) -> None:
        if self.rank == 0:
            from tqdm import tqdm

            tqdm.write(f"[dflash-fast] {message}", file=sys.stdout)
            sys.stdout.flush()

    def _log_setup(self, manifest: Dict, num_params: int, optimizer_line: str) -> None:
        d, s = self.cfg.data, self.cfg.schedule
        self.log(f"store {self.store.path}: {len(self.store)} documents, {manifest['num_tokens']:,} tokens, layer ids "
                 f"{manifest['layer_ids']}; target {self.target}")
        self.log(f"drafter: {num_params:,} trainable parameters, {self.cfg.model.num_layers} layers, "
                 f"block {self.block_size}; loss {self.loss_kind}; {optimizer_line}; {self.precision}; "
                 f"ZeRO-{self.zero_stage}; kernels " + ", ".join(f"{op}={ops.backend_of(op)}" for op in ops.OPS))
        self.log(f"{self.world_size} rank(s) x {s.grad_accum} micro-batch(es) x {d.batch_rows} row(s) of "
                 f"{d.seq_len} tokens per step; "
                 f"{self.stream.per_epoch} micro-batches per epoch per rank; {self.total_steps} steps")

    # ---- checkpoints

    def save(self) -> None:
        epoch, index = self.stream.position
        client = {"step": self.step, "epoch": epoch, "micro_batch": index, "data": self.data_identity,
                  "drafter": self.engine.module.config.to_dict(), "verifier": self.target,
                  "loss_kind": self.loss_kind, "config": self.cfg.to_dict()}
        try:
            self.last_checkpoint = save_checkpoint(self.engine, self.checkpoints_dir, self.step, client,
                                                   self.cfg.checkpoint.keep_last, self.sharing)
        except CheckpointError as e:  # every rank raises it (save_checkpoint decides on rank 0 and shares it)
            raise UserError(f"{e}; {resume_hint(self.last_checkpoint, self.sharing)}") from None
        self.saved_step = self.step
        self.log(f"checkpoint {self.last_checkpoint}")

    def _resume(self, load_dir: str, tag: str, client: Dict) -> None:
        load_training_state(self.engine, load_dir, tag)
        self.step = self.saved_step = client["step"]
        resume_schedule(self.engine, self.step)
        self.stream = TrainStream(self.store, self.cfg, self.rank, self.world_size, self.with_last, client["epoch"],
                                  client["micro_batch"])
        restore_rng_state(os.path.join(load_dir, tag), self.rank)
        self.last_checkpoint = os.path.join(load_dir, tag)
        set_aside_newer(self.checkpoints_dir, self.step, self.log, self.sharing)
        self.log(f"resumed from {self.last_checkpoint} at step {self.step} (epoch {client['epoch']}, "
                 f"micro-batch {client['micro_batch']})")

    # ---- steps

    def _forward(self, batch: Dict[str, torch.Tensor], noise_std: float, seed: int) -> DrafterOutput:
        loss = self.cfg.loss
        return self.engine(batch, loss_kind=self.loss_kind, noise_std=noise_std, seed=seed,
                           gamma=loss.gamma, weighting=loss.weighting,
                           dpace_alpha=loss.dpace_alpha, **loss.family_weights())

    def train_step(self) -> Tuple[Sums, Dict[str, float], Optional[float]]:
        """One optimizer step -> (sums reduced over ranks, seconds per phase, grad norm)."""
        from deepspeed.accelerator import get_accelerator

        sync = get_accelerator().synchronize
        gas = self.cfg.schedule.grad_accum
        times = dict.fromkeys(("fetch", "forward", "backward", "optimizer"), 0.0)
        with timed(times, "fetch"):
            micro, counts, total = step_batches(self.stream, self.cfg.schedule.grad_accum, self.block_size,
                                                self.sample_from_anchor, self.device)
        target_seconds = self.stream.take_target_seconds()
        if target_seconds is not None:
            times["target_forward"] = target_seconds  # online; on the side thread, hidden by the steps before
        sums = Sums(self.block_size, self.device)
        for i, (batch, count) in enumerate(zip(micro, counts)):
            with timed(times, "forward", sync):
                batch = to_device(batch, self.device, self.dtype)
                seed = derive_seed(self.cfg.seed, _NOISE_STREAM, self.step, self.rank, i) % 2**31
                out = self._forward(batch, self.cfg.data.noise_std, seed)
            with timed(times, "backward", sync):
                # DeepSpeed divides by grad_accum and averages over ranks; this makes the step's gradient that of
                # sum(l * w * mask) / (global slot count).
                self.engine.backward(out.loss * (max(count, 1) * self.world_size * gas / total))
            with timed(times, "optimizer", sync):
                self.engine.step()
            sums.add_output(out, batch)
        if self.muon_unchecked:
            check_muon_stepped(self.engine)
            self.muon_unchecked = False
        times["drafter"] = times["forward"] + times["backward"] + times["optimizer"]
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        if grad_norm is not None and not math.isfinite(grad_norm):
            sums.add("nonfinite", 1.0)
        sums.add("stop", float(self.stop_signal is not None))
        return sums.all_reduce(), times, grad_norm

    @torch.no_grad()
    def validate(self) -> Dict:
        loader = open_batches(self.store, self.cfg, self.rank, self.world_size, "val", self.with_last)
        sums = Sums(self.block_size, self.device)
        batches = 0
        try:
            for batch in loader:
                if self.cfg.validation.max_batches and batches >= self.cfg.validation.max_batches:
                    break
                batch = to_device(batch, self.device, self.dtype)
                sums.add_output(self._forward(batch, 0.0, 0), batch)
                batches += 1
        finally:
            close_batches(loader)
        entry = val_record(self.step, sums.all_reduce(), has_kl(self.loss_kind), batches * self.world_size)
        self.sharing.on_rank0(lambda: self.metrics.record(entry), (OSError,))
        self.log(f"validation at step {self.step}: loss {entry['loss']:.4f}, "
                 f"tau_offline {entry['tau_offline'] or 0:.3f}")
        return entry

    def export(self) -> Optional[str]:
        """Gather the 16-bit (or fp32) module weights from every ZeRO-3 partition; rank 0 writes OUT/export."""
        module = self.engine.module
        state = gathered_state(module, self.rank, self.zero_stage)
        def write() -> str:
            return export_run(module, os.path.join(self.out_dir, "export"), self.target,
                              torch_dtype(self.cfg.export_dtype), self.export_format, self.out_dir,
                              {"step": self.step, "loss_kind": self.loss_kind, "config": self.cfg.to_dict()},
                              state_dict=state)

        path = self.sharing.on_rank0(write, (UserError, ValueError, OSError))  # an error is every rank's (errors.py)
        engines = " and ".join(serving_engines(self.export_format, module.config.family))
        self.log(f"exported the drafter to {path} ({self.export_format} format, {self.cfg.export_dtype}; gated: "
                 f"read back as {engines} read it, same architecture and logits)")
        return path

    # ---- the loop

    def _on_signal(self, signum, _frame) -> None:
        if self.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop without saving
        self.stop_signal = signal.Signals(signum).name

    def _step(self, bar) -> Sums:
        """One optimizer step and what follows it: the progress bar, a metrics record every logging.every steps
        (and at the last), validation every validation.every. A non-finite loss stops the run unsaved."""
        cfg = self.cfg
        lr = self.optimizer.param_groups[0]["lr"]
        t = time.perf_counter()
        sums, times, grad_norm = self.train_step()
        seconds = time.perf_counter() - t
        self.step += 1
        if sums["nonfinite"]:
            raise NonFiniteLoss(
                f"non-finite loss or gradient norm at step {self.step} (loss {sums.metrics(False)['loss']}, "
                f"grad norm {grad_norm}): stopped without saving; {resume_hint(self.last_checkpoint, self.sharing)}"
            )
        self.window.add(sums, times, seconds)
        show_step(bar, sums, seconds, self.real and self.real.tau)
        if self.step % cfg.logging.every == 0 or self.step == self.total_steps:
            epoch, index = self.stream.position
            fraction = epoch + index / self.stream.per_epoch
            entry = train_record(self.step, fraction, self.window, has_kl(self.loss_kind), lr, grad_norm)
            self.sharing.on_rank0(lambda: self.metrics.record(entry), (OSError,))
            self.window = Window(self.block_size, self.device)
        if cfg.validation.every and self.step % cfg.validation.every == 0:
            self.validate()
            self.validated_step = self.step
        if self.real is not None:  # after the step's timings: validation never counts into them
            self.real.after_step(self, stopping=bool(sums["stop"]))
        return sums

    def run(self) -> Dict:
        """Train to the last step (or a signal): -> {"step", "interrupted", "checkpoint", "export"}."""
        cfg = self.cfg
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = progress_bar(self.total_steps, self.step, self.rank == 0 and cfg.logging.progress)
        self.window = Window(self.block_size, self.device)
        try:
            while self.step < self.total_steps:
                if self._step(bar)["stop"]:
                    self.save()
                    self.log(f"stopped by a signal at step {self.step}; continue with --resume")
                    return {"step": self.step, "interrupted": True, "checkpoint": self.last_checkpoint, "export": None}
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save()
            bar.close()
            if self.saved_step != self.step:
                self.save()
            if cfg.data.val_fraction > 0 and self.validated_step != self.step:
                self.validate()
            if self.real is not None:
                self.real.finish(self)
            export = self.export() if cfg.export else None
            return {"step": self.step, "interrupted": False, "checkpoint": self.last_checkpoint, "export": export}
        finally:
            bar.close()
            self.stream.close()
            self.metrics.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


def train(cfg: TrainConfig, device_memory: Optional[int] = None, real_acceptance=None) -> Dict:
    """Run one training job (this process is one rank); see Trainer.run for the result, Trainer for
    `real_acceptance`."""
    if cfg.validation.prompts and real_acceptance is None:  # train/ cannot import the evaluator (docs/layout.md)
        raise ConfigError(f"validation.prompts={cfg.validation.prompts} decodes with dflash_fast.evaluate, which "
                          f"train.py hands the trainer: run `deepspeed train.py` (or `python train.py`)")
    quiet_deepspeed()
    rank, world_size = init_distributed()  # refuses a stale DeepSpeed build lock first (it would hang the start-up)
    with output_lock(cfg.output_dir, rank):  # one run writes an output directory at a time
        return Trainer(cfg, rank, world_size, device_memory, real_acceptance).run()


def plan(cfg: TrainConfig, device_memory: Optional[int] = None) -> str:
    """`train.py --plan`: the memory plan of one step per rank (dflash_fast/train/memory.py) and, against the GPU (or
    `device_memory`), whether it fits and the largest data.seq_len and data.num_anchors that do. Nothing is
    trained, no weight and no document is read: the store's layout is its manifest's, or, online and for a store
    not extracted yet, the one the extraction settings give on model.target (data.planned_manifest)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    d = cfg.data
    source = Source.of(d)
    extracted = source.reads_store and os.path.exists(d.store)
    if not extracted and not cfg.model.target:
        raise ConfigError(f"data.store={d.store} does not exist: extract it first, or pass model.target=TARGET to "
                          f"plan from the target's config and the extraction settings (docs/memory.md)")
    manifest = open_source(cfg).manifest if extracted else planned_manifest(cfg)
    target = cfg.model.target or manifest["target"]["path"]
    precision, dtype = resolve_precision(cfg.precision)
    loss_kind = resolve_loss_kind(cfg.loss.kind, manifest)
    drafter = planned_drafter_config(cfg, manifest, target)
    ds = deepspeed_config(cfg.deepspeed, cfg, precision)
    limit = device_bytes() if device_memory is None else device_memory
    memory = run_plan(cfg, drafter, ds, world_size, dtype, loss_kind, manifest, target, limit)
    lines = [f"memory plan per rank: {world_size} rank(s), ZeRO-{ds.get('zero_optimization', {}).get('stage', 0)}, "
             f"{cfg.optimizer.kind}, {precision}, loss {loss_kind}; a micro-batch of {d.batch_rows} row(s) of "
             f"data.seq_len={d.seq_len} tokens, data.num_anchors={d.num_anchors}; activation checkpointing "
             f"{'on' if cfg.model.activation_checkpointing else 'off'}"]
    if not extracted:
        origin = "of the store not extracted yet" if source.reads_store else str(source)
        lines.append(f"hidden states ({origin}): layer ids {manifest['layer_ids']}, {manifest['dtype']}, top-k "
                     f"{manifest['topk']}, `last` {'kept' if manifest['has_last'] else 'not kept'}, from "
                     f"{target}'s config, model.layer_ids and data.online.dtype / data.online.topk")
    lines.append(memory.lines())
    if limit is None:
        lines.append("no GPU here: nothing to fit (pass --device-memory BYTES to plan for a GPU, e.g. 141e9)")
        if memory.setup.online is not None and memory.setup.online.engine == "vllm":
            lines.append(f"not counted without a device: the share of it vLLM takes (gpu_memory_utilization="
                         f"{GPU_MEMORY_UTILIZATION}); --device-memory counts it")
        return "\n".join(lines)
    longest, most = largest_fitting(drafter, step_of(cfg), memory.setup, limit)
    lines += [f"device memory {limit:,} bytes ({gib(limit)}): {'fits' if memory.peak <= limit else 'does NOT fit'}",
              f"largest data.seq_len at data.num_anchors={d.num_anchors}: {longest}",
              f"largest data.num_anchors at data.seq_len={d.seq_len}: {most}"]
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a DFlash drafter with DeepSpeed: "
        "deepspeed train.py --config configs/tiny.yaml [key.sub=value ...]",
    )
    p.add_argument("--config", help="YAML config, e.g. configs/tiny.yaml or configs/qwen3-8b.yaml")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in OUT/checkpoints "
        "(checkpoint.resume=PATH continues from another one)",
    )
    p.add_argument(
        "--local_rank", type=int, default=None, help=argparse.SUPPRESS
    )  # the deepspeed launcher's; LOCAL_RANK is used
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan of one training step per rank and the largest data.seq_len and "
                        "data.num_anchors that fit the GPU, then exit (docs/memory.md)")
    p.add_argument("--device-memory", type=float, default=None, metavar="BYTES",
                   help="the bytes per rank the plan must fit instead of the GPU's (e.g. 141e9 to plan an H200 "
                        "run on a machine without one); a run whose plan exceeds it refuses to start")
    p.add_argument("--debug", action="store_true", help=f"show the traceback of an error (also: {DEBUG_ENV}=1)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides such as optimizer.lr=3e-4")
    return p.parse_intermixed_args(argv)


def main(argv: Optional[Sequence[str]] = None, real_acceptance=None) -> None:
    """The process entry point: a user error ends it in one `error: ...` line, exit 2 (config) or 1 (data, a
    non-finite loss); other exceptions keep their traceback (dflash_fast/errors.py). `real_acceptance`: see
    Trainer (train.py passes dflash_fast.evaluate.validation.RealAcceptance)."""
    args = parse_args(argv)
    overrides = list(args.overrides) + (["checkpoint.resume=latest"] if args.resume else [])

    device_memory = None if args.device_memory is None else int(args.device_memory)

    def run() -> None:
        cfg = load_config(args.config, overrides)
        if args.plan:
            text = plan(cfg, device_memory)
            if int(os.environ.get("RANK", "0")) == 0:
                print(text)
            return
        train(cfg, device_memory, real_acceptance)

    ours = not dist.is_initialized()  # a caller's group (several runs in one process) is the caller's to destroy
    try:
        code = run_reporting_errors(run, args.debug)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)
