"""The KV connector `dflash-fast extract --engine vllm` gives vLLM: its hidden-states connector, written synchronously.

vLLM's `extract_hidden_states` speculative method caches the auxiliary hidden states of every prompt token in a
KV-cache layer of its own; `ExampleHiddenStatesConnector` copies them out once a request finishes. Its copy is
asynchronous (pinned host memory and a CUDA stream: it fails on a CPU with "pin_memory=True requires a CUDA or
other accelerator backend") and guarded by lock files. This one copies and writes in the engine step that reports
the request finished, then renames the file into place, so a reader sees whole files only: a file whose name
exists is complete. vLLM imports this module itself (kv_connector_module_path); nothing else does, since it
imports vLLM at the top.

File per request: `<shared_storage_path>/<request id>.safetensors` with `hidden_states [n, A, H]` (the A
requested aux layers in ascending id order, as the model collects them) and `token_ids [n]` (the prompt) -- the
format of vLLM's own connector, which hs_connectors' FileTransfer reads. Extra config keys (kv_connector_extra_config):

    use_synchronization_lock  (vLLM's key; default true) `<file>.lock` held from the request's first step until its
                              file is in place, as vLLM's connector does, so a client that got the path in the
                              response (`vllm serve`: hs_connectors, extract/vllm_serve.py) waits on it; false in
                              process (extract --engine vllm reads after the writing step)
    fp8                       (default false) hidden_states in float8_e4m3fn with one fp32 scale per token,
                              `hidden_states_scales [n, 1, 1]`: hs_connectors' FP8HiddenStatesConnector's format
"""
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    extract_from_kv_cache,
)

FP8_SCALES = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY


def quantize_fp8(hidden: torch.Tensor):
    """hs_connectors' per-token FP8 (fp8_utils.quantize_tensor_to_fp8): [n, A, H] -> (e4m3 [n, A, H], fp32 scale
    [n, 1, 1]) with scale = max(amax / 448, 1e-12); dequantized as e4m3.to(dtype) * scale.to(dtype)."""
    fp32 = hidden.float()
    scale = (fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
             / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (fp32 / scale).to(torch.float8_e4m3fn), scale


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a synchronous write on the worker (any device), no lock files."""

    def wait_for_save(self) -> None:
        """vLLM's: a held lock file per new request (when use_synchronization_lock), released in _write."""
        if self.use_lock:
            super().wait_for_save()

    def _write(self, pending) -> None:
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), len(pending.token_ids))
        tensors = {"hidden_states": hidden.cpu().contiguous(), "token_ids": pending.token_ids.clone()}
        if self._kv_transfer_config.get_from_extra_config("fp8", False):
            tensors["hidden_states"], tensors[FP8_SCALES] = quantize_fp8(tensors["hidden_states"])
        tmp = pending.filename + ".tmp"
        try:
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)
        finally:
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock a reader waits on

    def get_finished(self, finished_req_ids):  # noqa: ARG002 (vLLM's signature; done is per write)
        """Write every request the scheduler handed over in this step; report them sent (TP rank 0 only)."""
        written = set()
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._is_tp_rank_zero and isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            for pending in metadata.pending_saves:
                self._write(pending)
                written.add(pending.req_id)
        return written or None, None
