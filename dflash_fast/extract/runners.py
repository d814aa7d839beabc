"""The one place a target runner is chosen. Every runner is called the same way, whichever engine runs the target:

    runner(examples: [Example]) -> [per-document arrays in the store's layout]   one padded forward of the documents
    runner.num_layers, .vocab_size, .norm_kind, .norm_eps, .norm_name, .model   the facts job_manifest records

    engine hf      capture.TargetRunner     transformers in this process (the tap hooks, `last`, parity, teacher)
    engine vllm    vllm_runner.VllmRunner   vLLM in this process (extract_hidden_states, our ids mapped to vLLM's)
    an address     remote.RemoteRunner      `dflash-fast serve-target` at HOST:PORT (either engine, served elsewhere)
    served         vllm_serve.ServedVllmRunner  `vllm serve` replicas with the extraction flags (data.source=vllm_serve)

`dflash-fast extract` writes what a runner returns into a store; data/online.py hands it to the trainer, read like a
store; serve.py answers a RemoteRunner's requests with a runner of its own.
"""
from typing import Dict, Optional

from dflash_fast.extract.capture import TargetRunner
from dflash_fast.extract.plan import Job
from dflash_fast.extract.remote import RemoteRunner
from dflash_fast.target.load import load_target


def make_runner(job: Job, address: str = "", served: Optional[Dict] = None):
    """The runner of `job`: served at `address` when one is given, by the `vllm serve` replicas of `served`
    (ServedVllmRunner's keyword arguments: servers, api_key, transfer, timeout_s) when given, else its engine's,
    loaded here (frozen, in its compute dtype, on its device)."""
    if served is not None:
        from dflash_fast.extract.vllm_serve import ServedVllmRunner, parse_servers

        return ServedVllmRunner(job, parse_servers(served["servers"]), **{k: v for k, v in served.items()
                                                                           if k != "servers"})
    if address:
        return RemoteRunner(address, job)
    if job.options.engine == "vllm":
        from dflash_fast.extract.vllm_runner import VllmRunner

        return VllmRunner(job)
    model = load_target(job.target, job.device, job.compute_dtype, job.options.trust_remote_code)
    pad_id = job.tokenizer.pad_token_id if job.tokenizer.pad_token_id is not None else 0
    return TargetRunner(model, job.layer_ids, job.layout, pad_id, job.options.parity_every)
