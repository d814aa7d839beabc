"""extract.runners (split out; docstring to write)."""

from dflash_fast.extract.capture import TargetRunner
from dflash_fast.extract.plan import Job
from dflash_fast.target.load import load_target


def make_runner(job: Job) -> TargetRunner:
    """Load the job's target (frozen, in its compute dtype, on its device) and wrap it in a TargetRunner."""
    if job.options.engine == "vllm":
        from dflash_fast.extract.vllm_runner import VllmRunner

        return VllmRunner(job)
    model = load_target(job.target, job.device, job.compute_dtype, job.options.trust_remote_code)
    pad_id = job.tokenizer.pad_token_id if job.tokenizer.pad_token_id is not None else 0
    return TargetRunner(model, job.layer_ids, job.layout, pad_id, job.options.parity_every)
