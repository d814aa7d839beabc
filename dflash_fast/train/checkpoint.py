"""Trainer checkpoints on disk: the checksummed completion marker, verification and fall-back, client state,
RNG state, the trained drafter for export and eval, and a training run's side: saving one (save_checkpoint),
choosing the one to resume (find_resume), and setting aside the checkpoints a resume replaces (set_aside_newer).

    OUT/checkpoints/stepNNNNNNNN/
        mp_rank_00_model_states.pt, *optim_states.pt   DeepSpeed's own files (pickles): only resume reads them, through
                                                        DeepSpeed's loader made weights-only, once they verified
        drafter.safetensors                             the trainable weights, fp32, gathered from every ZeRO partition:
                                                        the only weights export and eval read
        rng_rankNNNNN.json                              each rank's Python, numpy and torch RNG state
        dflash_fast.json                                the completion marker, written last (fsynced, renamed into
                                                        place): the client state (step, data position, drafter
                                                        config, ...) and the size and sha256 of every other file

A checkpoint is *complete* when its marker parses (a missing, empty or corrupt marker: a save that did not finish),
and *verified* when the files on disk are exactly the ones its marker lists, each with the recorded size and sha256.
Readers take a run's newest verified checkpoint and say which newer ones they skipped and why; a checkpoint named
directly must verify.

Nothing here unpickles with code: resume reads DeepSpeed's files through `load_training_state`, torch's
weights-only unpickler with DeepSpeed's few state classes allowed, so a crafted .pt file is refused, not run. The
checksums catch damage and files swapped in after the run wrote them, not a forged marker.
"""
import json
import os
import random
import re
import shutil
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.drafter.weights import check_tensors, read_tensors, stderr_line
from dflash_fast.errors import COUNT, LIST, OBJECT, SHA256, STR, ConfigError, MapOf, Obj, read_mapping, schema_problem
from dflash_fast.store.format import TMP_SUFFIX, sha256_file, write_json_atomic

CHECKPOINT_TAG = re.compile(r"^step(\d{8})$")
MARKER = "dflash_fast.json"  # written last into a checkpoint: client state + every other file's size and sha256
MARKER_FORMAT = "dflash-fast checkpoint 1"
WEIGHTS = "drafter.safetensors"


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for; the message names each file that failed and why."""


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.json"


class Sharing(NamedTuple):
    """How the ranks of a job share the work on one checkpoint: this rank hashes every `world_size`-th file,
    `gather(obj)` returns every rank's `obj`, in rank order (an all-gather; one process: [obj]), and `barrier()`
    waits for every rank."""

    rank: int = 0
    world_size: int = 1
    gather: Callable[[Any], List[Any]] = lambda obj: [obj]
    barrier: Callable[[], None] = lambda: None

    def on_every_rank(self, fn: Callable[[], Any], errors: Tuple[type, ...]) -> Any:
        """fn() on every rank. An error of `errors` any rank raises is shared before anyone raises, and every rank
        raises the lowest rank's: no rank is left waiting at a barrier for one that stopped (a disk error writing
        one rank's files, say). The gather is the barrier."""
        result, problem = None, None
        try:
            result = fn()
        except errors as e:
            problem = e
        problems = [p for p in self.gather(problem) if p is not None]
        if problems:
            raise problems[0]
        return result

    def on_rank0(self, fn: Callable[[], Any], errors: Tuple[type, ...]) -> Any:
        """fn() on rank 0 (None on the others), its error of `errors` every rank's (on_every_rank)."""
        return self.on_every_rank(fn if self.rank == 0 else lambda: None, errors)


# ---------------------------------------------------------------- the completion marker


def _files_on_disk(ckpt: str) -> List[str]:
    """Every file under `ckpt` but the marker (and its temporary), as sorted relative paths."""
    names = []
    for root, _, files in os.walk(ckpt):
        names += [os.path.relpath(os.path.join(root, f), ckpt) for f in files]
    return sorted(n for n in names if n not in (MARKER, MARKER + TMP_SUFFIX))


def _digests(ckpt: str, names: List[str], sharing: Sharing) -> Dict[str, Dict]:
    """name -> {"size", "sha256"} of every file in `names`, each rank hashing its share."""
    mine = {
        n: {"size": os.path.getsize(os.path.join(ckpt, n)), "sha256": sha256_file(os.path.join(ckpt, n))}
        for n in names[sharing.rank :: sharing.world_size]
    }
    return {n: d for part in sharing.gather(mine) for n, d in part.items()}


def write_marker(ckpt: str, client: Dict, sharing: Sharing = Sharing()) -> None:
    """Hash every file of the checkpoint `ckpt` (the ranks share the work; rank 0's listing is the one used),
    then rank 0 writes the completion marker. Every rank calls it, after every rank's files are written."""
    names = sharing.gather(_files_on_disk(ckpt))[0]
    files = _digests(ckpt, names, sharing)
    sharing.on_rank0(lambda: write_json_atomic(os.path.join(ckpt, MARKER), {"format": MARKER_FORMAT,
                                                                             "client": client, "files": files}),
                     (OSError,))


# The marker's shape (errors.check_schema): the client state resume and export read, every file's size and sum.
MARKER_SCHEMA = Obj({
    "format": STR,
    "client": Obj({}, optional={"step": COUNT, "epoch": COUNT, "micro_batch": COUNT, "data": OBJECT,
                                "drafter": OBJECT, "verifier": STR}),
    "files": MapOf(Obj({"size": COUNT, "sha256": SHA256})),
})


def _marker_problem(marker: Dict) -> Optional[str]:
    """Why `marker` is not a completion marker of this dflash-fast: a wrong field, or a file outside the checkpoint."""
    if marker.get("format") != MARKER_FORMAT:
        return f"format is {marker.get('format')!r}, not {MARKER_FORMAT!r}"
    problem = schema_problem(marker, MARKER_SCHEMA)
    if problem is None:
        outside = [n for n in marker["files"] if os.path.isabs(n) or ".." in n.split(os.sep)]
        problem = f"files lists {outside[0]!r}, a path outside the checkpoint" if outside else None
    return problem


def read_marker(ckpt: str) -> Tuple[Optional[Dict], str]:
    """(marker, "") of a complete checkpoint, else (None, why it counts as incomplete)."""
    try:
        marker = read_mapping(os.path.join(ckpt, MARKER), json.load, ValueError, ValueError, "JSON", "a JSON object",
                              missing=FileNotFoundError)
    except FileNotFoundError:
        return None, f"incomplete: no completion marker {MARKER} (the save did not finish)"
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"incomplete: its completion marker {MARKER} is unreadable ({e})"
    problem = _marker_problem(marker)
    if problem is not None:
        return None, (
            f"incomplete: {MARKER} is not a {MARKER_FORMAT!r} completion marker ({problem}: hand-edited, or written "
            f"by an older dflash-fast that recorded no checksums)"
        )
    return marker, ""


def checkpoint_tags(checkpoints_dir: str) -> List[str]:
    """Complete checkpoint tags in `checkpoints_dir` (their marker parses; not yet verified), oldest first."""
    if not os.path.isdir(checkpoints_dir):
        return []
    return sorted(
        t
        for t in os.listdir(checkpoints_dir)
        if CHECKPOINT_TAG.match(t) and read_marker(os.path.join(checkpoints_dir, t))[0] is not None
    )


def step_of(tag: str) -> int:
    return int(CHECKPOINT_TAG.match(tag).group(1))


def tag_of(step: int) -> str:
    return f"step{step:08d}"


# ---------------------------------------------------------------- verification and choice


def verify_checkpoint(ckpt: str, sharing: Sharing = Sharing()) -> List[str]:
    """Why the checkpoint `ckpt` is not exactly what its run wrote: [] when it verifies. Sizes and the set of
    files are checked first (cheap), then every sha256. With several ranks, every rank calls it and gets the
    same answer."""
    marker, why = read_marker(ckpt)
    problems = [why] if marker is None else []
    if marker is not None:
        listed, on_disk = marker["files"], set(_files_on_disk(ckpt))
        for name in sorted(set(listed) | on_disk):
            if name not in on_disk:
                problems.append(f"{name}: missing (the marker lists it)")
            elif name not in listed:
                problems.append(f"{name}: not listed in the marker (added after the checkpoint was written)")
            elif os.path.getsize(os.path.join(ckpt, name)) != listed[name]["size"]:
                problems.append(
                    f"{name}: {os.path.getsize(os.path.join(ckpt, name))} bytes, the marker records "
                    f"{listed[name]['size']} (truncated or replaced)"
                )
    problems = sorted({p for part in sharing.gather(problems) for p in part})
    if problems:
        return problems
    digests = _digests(ckpt, sorted(listed), sharing)
    return [
        f"{name}: sha256 {digests[name]['sha256'][:16]}... differs from the recorded {d['sha256'][:16]}... "
        f"(same size: its bytes were changed)"
        for name, d in sorted(listed.items())
        if digests[name]["sha256"] != d["sha256"]
    ]


def select_checkpoint(
    path: str, log: Callable[[str], None] = stderr_line, sharing: Sharing = Sharing()
) -> Tuple[str, str]:
    """The checkpoint to read at `path` -> (checkpoints dir, tag).

    `path` names one checkpoint (a stepNNNNNNNN directory): it must verify. A run directory or its checkpoints/
    directory: its newest checkpoint that verifies; when newer ones were skipped, `log` says which and why.
    Raises CheckpointError naming every failed file when there is none."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if CHECKPOINT_TAG.match(os.path.basename(path)) or os.path.isfile(os.path.join(path, MARKER)):
        problems = verify_checkpoint(path, sharing)
        if problems:
            raise CheckpointError(f"the checkpoint {path} does not verify: " + "; ".join(problems))
        return os.path.dirname(path), os.path.basename(path)
    tags = sorted(t for t in os.listdir(path) if CHECKPOINT_TAG.match(t)) if os.path.isdir(path) else []
    if not tags:
        raise CheckpointError(
            f"{path} is not a run directory, a checkpoints directory or a checkpoint (it holds no stepNNNNNNNN "
            f"checkpoint directory)"
        )
    skipped = []
    for tag in reversed(tags):
        problems = verify_checkpoint(os.path.join(path, tag), sharing)
        if not problems:
            if skipped:
                log(f"using {os.path.join(path, tag)}, the newest checkpoint that verifies; skipped newer ones:\n  - "
                    + "\n  - ".join(skipped))
            return path, tag
        skipped.append(f"{tag}: " + "; ".join(problems))
    raise CheckpointError(f"no checkpoint in {path} verifies:\n  - " + "\n  - ".join(skipped))


def read_client_state(load_dir: str, tag: str) -> Dict:
    """The client state of a complete checkpoint (step, data position, drafter config, verifier, ...)."""
    marker, why = read_marker(os.path.join(load_dir, tag))
    if marker is None:
        raise CheckpointError(f"{os.path.join(load_dir, tag)}: {why}")
    return marker["client"]


# ---------------------------------------------------------------- a training run's checkpoints


def find_resume(checkpoints_dir: str, spec: Optional[str], data: Dict, log: Callable[[str], None],
                sharing: Sharing = Sharing()) -> Optional[Tuple[str, str, Dict]]:
    """The checkpoint a run continues from (checkpoint.resume=`spec`: None, `latest` or a path) -> (checkpoints
    dir, tag, client state), verified and checked against the run's `data` identity before anything is built;
    None for a fresh start. DeepSpeed's loader unpickles its files, so a checkpoint whose files differ from the
    checksums its run recorded is refused (`latest`: the newest that verifies is taken, saying so)."""
    tags = checkpoint_tags(checkpoints_dir)
    if spec is None:
        if tags:
            raise ConfigError(
                f"{checkpoints_dir} already holds checkpoints ({tags[-1]}): pass --resume to continue "
                f"that run, or choose another output_dir"
            )
        return None
    if spec == "latest" and not tags:
        log(f"--resume: no checkpoint in {checkpoints_dir} yet, starting from step 0")
        return None
    try:
        load_dir, tag = select_checkpoint(checkpoints_dir if spec == "latest" else spec, log, sharing)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.resume={spec}: {e}") from None
    client = read_client_state(load_dir, tag)
    for key, now in data.items():
        if client["data"].get(key) != now:
            raise ConfigError(
                f"cannot resume {os.path.join(load_dir, tag)}: {key} was {client['data'].get(key)!r}, now {now!r}; "
                f"the data position would not line up: restore it, or start a fresh output_dir"
            )
    return load_dir, tag, client


def set_aside_newer(checkpoints_dir: str, step: int, log: Callable[[str], None], sharing: Sharing = Sharing()) -> None:
    """Checkpoints in `checkpoints_dir` newer than the resumed `step` (they failed to verify, or an older one was
    resumed on purpose) belong to a future this run replaces: renamed to TAG.superseded, so that neither
    keep_last pruning nor a later --resume mistakes them for this run's. Every rank calls it."""
    def renamed() -> None:
        for tag in checkpoint_tags(checkpoints_dir):
            if step_of(tag) > step:
                old = os.path.join(checkpoints_dir, tag)
                os.replace(old, old + ".superseded")
                log(f"{old} is newer than the resumed step {step}: renamed to {old}.superseded")

    sharing.on_rank0(renamed, (OSError,))


def resume_hint(last_checkpoint: Optional[str], sharing: Sharing = Sharing()) -> str:
    """Where a stopped run can continue from: its last checkpoint only if that verifies (every rank calls it)."""
    if last_checkpoint is None:
        return "no checkpoint was saved before it"
    problems = verify_checkpoint(last_checkpoint, sharing)
    if not problems:
        return (
            f"the last good checkpoint is {last_checkpoint} (it verifies: every file matches its recorded "
            f"sha256; continue from it with --resume after lowering optimizer.lr or checking the store)"
        )
    return (
        f"the last checkpoint {last_checkpoint} does not verify ({'; '.join(problems)}); --resume "
        f"continues from the newest one that does"
    )


def save_checkpoint(engine, checkpoints_dir: str, step: int, client: Dict, keep_last: int,
                    sharing: Sharing = Sharing()) -> str:
    """Write the checkpoint of `step` of the DeepSpeed `engine` -> its path: DeepSpeed's files, the fp32 master
    weights, each rank's RNG state, then the marker; only the newest `keep_last` complete checkpoints stay. Every
    rank calls it.

    The master weights are gathered and checked (check_tensors: names, shapes, finite values) before anything is
    written; weights its readers would refuse (a NaN) stop every rank with the same CheckpointError, decided by
    rank 0 and shared before anyone raises, so that no rank is left waiting at a barrier for one that stopped."""
    tag = tag_of(step)
    path = os.path.join(checkpoints_dir, tag)
    weights = master_weights(engine, sharing.rank)

    def checked() -> Dict[str, torch.Tensor]:
        cpu = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()}
        try:
            check_tensors(engine.module.config, cpu, os.path.join(path, WEIGHTS), CheckpointError)
        except CheckpointError as e:  # check_tensors lists one problem a line: one line here
            where, *problems = str(e).split("\n  - ")
            raise CheckpointError(f"the checkpoint of step {step} was not saved: {where} {'; '.join(problems)}") \
                from None
        return cpu

    weights = sharing.on_rank0(checked, (CheckpointError,))

    def cleared() -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)  # a save of this step that never finished (killed): its files would mix with ours

    def written() -> None:
        if sharing.rank == 0:
            write_weights(path, weights, engine.module.config)
        write_rng_state(path, sharing.rank)

    try:  # a disk error on one rank (rank 0 alone writes the weights and the marker) stops every rank alike
        sharing.on_rank0(cleared, (OSError,))
        engine.save_checkpoint(checkpoints_dir, tag=tag)
        sharing.on_every_rank(written, (OSError,))
        write_marker(path, client, sharing)
    except OSError as e:
        raise CheckpointError(f"the checkpoint of step {step} was not saved: {e}") from None
    if sharing.rank == 0:
        for old in checkpoint_tags(checkpoints_dir)[:-keep_last]:
            shutil.rmtree(os.path.join(checkpoints_dir, old), ignore_errors=True)
    sharing.barrier()
    return path


# ---------------------------------------------------------------- the drafter's weights


def master_weights(engine, rank: int) -> Optional[Dict[str, torch.Tensor]]:
    """The fp32 master weights of a DeepSpeed `engine` by name, gathered from every ZeRO partition; rank 0 gets
    them, the others None. A collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if rank == 0:
            weights[name] = (p if full is None else full).detach().to("cpu", torch.float32, copy=True)
    return weights if rank == 0 else None


def write_weights(ckpt: str, tensors: Dict[str, torch.Tensor], cfg: DrafterConfig) -> None:
    """The drafter's trainable weights (name -> full tensor) as fp32 safetensors in `ckpt`, checked (check_tensors)
    before they are written: a checkpoint never holds weights its readers would refuse."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    check_tensors(cfg, tensors, os.path.join(ckpt, WEIGHTS), CheckpointError)
    save_file(tensors, os.path.join(ckpt, WEIGHTS), metadata={"format": "pt"})


def run_dir_of(path: str) -> str:
    """The run directory of a checkpoint path as select_checkpoint takes it (a run, its checkpoints/ directory, or
    one stepNNNNNNNN checkpoint), found without reading the checkpoint; where OUT/provenance.json is."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return path
    if CHECKPOINT_TAG.match(os.path.basename(path)) or os.path.isfile(os.path.join(path, MARKER)):
        path = os.path.dirname(path)
    return os.path.dirname(path)


def load_drafter_for_export(checkpoint: str, log: Callable[[str], None] = stderr_line) -> Tuple[DFlashDrafter, str]:
    """The trained drafter of a run or checkpoint (select_checkpoint) and the verifier (target) path it was
    trained against: built from the marker's JSON drafter config and `drafter.safetensors`, never from
    DeepSpeed's pickles, and only once the file's header backs the config (read_tensors). Frozen target tensors are
    not loaded: export writes trainable weights only."""
    drafter, verifier, _, _ = load_checkpoint_for_export(checkpoint, log)
    return drafter, verifier


def load_checkpoint_for_export(checkpoint: str, log: Callable[[str], None] = stderr_line
                               ) -> Tuple[DFlashDrafter, str, Dict, str]:
    """load_drafter_for_export's drafter and verifier, with the checkpoint's client state and its run directory
    (what the model card tells: the steps, the run's config, OUT/provenance.json)."""
    load_dir, tag = select_checkpoint(checkpoint, log)
    ckpt = os.path.join(load_dir, tag)
    client = read_client_state(load_dir, tag)
    try:
        cfg = DrafterConfig(**client["drafter"])
        verifier = client["verifier"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt}/{MARKER}: its drafter config or verifier is not one this dflash-fast "
                              f"builds ({type(e).__name__}: {e})") from None
    weights = read_tensors([os.path.join(ckpt, WEIGHTS)], cfg, CheckpointError)
    drafter = DFlashDrafter(cfg)
    drafter.load_trainable(weights)
    return drafter, verifier, client, os.path.dirname(os.path.abspath(load_dir))


# ---------------------------------------------------------------- DeepSpeed's states, read without running code


def deepspeed_safe_globals() -> List[type]:
    """The classes DeepSpeed pickles into its checkpoints beside tensors and plain containers (ZeRO-1/2/3 optimizer
    states hold the stage, the loss scaler and the fp32 slice map; fp16 the dynamic scaler), as
    torch.serialization.get_unsafe_globals_in_checkpoint lists them. Allow-listing a class lets torch's
    weights-only unpickler make an instance and set its attributes; it never calls a function the file names."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_training_state(engine, load_dir: str, tag: str) -> None:
    """Resume's read of DeepSpeed's model and optimizer states (engine.load_checkpoint) with every file unpickled
    by torch.load(weights_only=True) and only `deepspeed_safe_globals` allowed: DeepSpeed's own loader would
    unpickle them with weights_only=False, running any code a crafted file holds. A file holding anything else
    is refused by name (CheckpointError)."""
    import pickle

    allowed = deepspeed_safe_globals()

    def load(path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)|Unsupported operand (\S+)", str(e))
            what = next((g for g in found.groups() if g), "") if found else str(e).splitlines()[0]
            raise CheckpointError(
                f"{path}: holds a pickled object that is not training state ({what}); resume loads DeepSpeed's "
                f"files weights-only and never runs code from them: resume from a checkpoint this trainer wrote"
            ) from None

    checkpoint_engine = engine.checkpoint_engine
    checkpoint_engine.load = load  # every DeepSpeed read of the checkpoint (model, ZeRO partitions) goes through it
    try:
        # The schedule is not resumed from the file: the resuming run's config governs it (optim.resume_schedule).
        loaded, _ = engine.load_checkpoint(load_dir, tag, load_optimizer_states=True, load_lr_scheduler_states=False)
    finally:
        del checkpoint_engine.load
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load the checkpoint {os.path.join(load_dir, tag)}")


# ---------------------------------------------------------------- RNG state (JSON: no pickle)


def rng_state() -> Dict:
    """This process's Python, numpy and torch (and CUDA) generator states as JSON-able values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes().hex()
    return state


def set_rng_state(state: Dict) -> None:
    def byte_tensor(text: str) -> torch.Tensor:
        return torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(byte_tensor(state["cuda"]))


def write_rng_state(ckpt: str, rank: int) -> None:
    write_json_atomic(os.path.join(ckpt, rng_file(rank)), rng_state())


RNG_SCHEMA = Obj({"python": LIST, "numpy": LIST, "torch": STR}, optional={"cuda": STR})


def restore_rng_state(ckpt: str, rank: int) -> None:
    """Restore this rank's RNG state from a (verified) checkpoint."""
    path = os.path.join(ckpt, rng_file(rank))
    set_rng_state(read_mapping(path, json.load, ValueError, CheckpointError, "JSON", "an RNG state (a JSON object)",
                               schema=RNG_SCHEMA))
