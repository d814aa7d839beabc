"""The KV connector `dflash-fast extract --engine vllm` gives vLLM: its hidden-states connector, written synchronously.

vLLM's `extract_hidden_states` speculative method caches the auxiliary hidden states of every prompt token in a
KV-cache layer of its own; `ExampleHiddenStatesConnector` copies them out once a request finishes. Its copy is
asynchronous (pinned host memory and a CUDA stream: it fails on a CPU with "pin_memory=True requires a CUDA or
other accelerator backend") and guarded by lock files. This one copies and writes in the engine step that reports
the request finished, then renames the file into place, so a reader sees whole files only: a file whose name
exists is complete. vLLM imports this module itself (kv_connector_module_path); nothing else does, since it
imports vLLM at the top.

File per request: `<shared_storage_path>/<request id>.safetensors` with `hidden_states [n, A, H]` (the A
requested aux layers in ascending id order, as the model collects them) and `token_ids [n]` (the prompt).
"""
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    extract_from_kv_cache,
)


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a synchronous write on the worker (any device), no lock files."""

    def wait_for_save(self) -> None:
        pass  # no lock files: the rename in _write is the signal

    def _write(self, pending) -> None:
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), len(pending.token_ids))
        tmp = pending.filename + ".tmp"
        save_file({"hidden_states": hidden.cpu().contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
        os.replace(tmp, pending.filename)

    def get_finished(self, finished_req_ids):  # noqa: ARG002 (vLLM's signature; done is per write)
        """Write every request the scheduler handed over in this step; report them sent (TP rank 0 only)."""
        written = set()
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._is_tp_rank_zero and isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            for pending in metadata.pending_saves:
                self._write(pending)
                written.add(pending.req_id)
        return written or None, None
