"""vLLM 0.32's LiLiCorr head, candidates and walk on a CPU, for tests/test_vllm_lilicorr.py, in a process of its own.

    python tests/vllm_lilicorr_on_cpu.py CASES.pt OUT.pt

CASES.pt: a list of cases, each {"config": the dflash_config's lilicorr_* keys, "model_hidden_size", "block_size",
"rms_norm_eps", "state": our head's state dict, "inputs": (token_embeddings, candidate_log_probs, pass_hidden,
anchor_hidden, anchor_valid)} and optionally "lm_head" [V, H], "hidden" [S, H], "embed" [V, H] (the candidates).
A case with "export" (an export directory), "target" (its target) and "inputs" builds the head as vLLM serves that
export instead: vLLM's own config loader (SpeculativeConfig, method dflash, num_speculative_tokens "drafted"), the
model class its registry names for the export's architectures, and that class's `load_weights` on the export's
model.safetensors (LiLiCorrForCausalLM: the lattice tensors through AutoWeightsLoader, its coverage check).
OUT.pt: per case {"start", "pair", "table", "walk" (indices per row), and with lm_head "ids", "log_probs",
"drafted"; with export "architectures", "model_class", "dflash_config" (as vLLM parsed them)}.

vLLM's pieces as it serves them: `LiLiCorrHead` (model_executor/models/lilicorr.py) built under a VllmConfig without
compilation, our state dict loaded `strict` and its layers' weights processed as vLLM's loader does
(`materialize_inference_buffers` at the end of `load_weights`, then `process_weights_after_loading`: the CPU
linears), `score` and `forward`; the walk
by the V2 speculator's own `CandidateSampler` (spec_decode/dflash2: `_selector_walk_kernel`, greedy), whose Triton
kernel runs in Triton's interpreter (tests/vllm_v2_on_cpu.py: a "cpu" backend named before vLLM is imported, in this
process only); the candidates by `LogitsProcessor.get_top_k_tokens(..., return_log_probs=True)` on a `ParallelLMHead`
(`LiLiCorrForCausalLM.compute_candidates`).
"""
import os
import sys
import tempfile

import torch
from vllm_v2_on_cpu import switch_on_v2_runner


def processed(module):
    """vLLM's loader's step after the weights: each layer's quant method prepares them (the CPU linear ops)."""
    for m in module.modules():
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)
    return module


def walk(table):
    """vLLM's greedy walk of one table [S, K, K] -> the chosen candidate index per slot [S]."""
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    s, k, _ = table.shape
    sampler = CandidateSampler(1, s, k, torch.device("cpu"))
    ids = torch.arange(s * k).view(1, s, k)  # index i of slot s is token s k + i
    tokens = torch.zeros(1, s, dtype=torch.int64)
    sampler.sample(ids, table[None].float().contiguous(), 1, torch.arange(1, s + 1).view(1, s),
                   torch.zeros(1, s, dtype=torch.int32), torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                   tokens, None, False)
    return tokens[0] - torch.arange(s) * k


def served_head(case, out):
    """vLLM's LiLiCorr head as vLLM builds and loads it from the export `case["export"]` (the module docstring)."""
    from safetensors.torch import load_file
    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader import get_model_architecture

    target, parallel = ModelConfig(model=case["target"], dtype="float32"), ParallelConfig()
    spec = SpeculativeConfig(method="dflash", model=case["export"], num_speculative_tokens=case["drafted"],
                             target_model_config=target, target_parallel_config=parallel)
    config = VllmConfig(model_config=target, speculative_config=spec, parallel_config=parallel,
                        compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with set_current_vllm_config(config):
        model_class, _ = get_model_architecture(spec.draft_model_config)
        model = model_class(vllm_config=config)
        model.load_weights(load_file(os.path.join(case["export"], "model.safetensors")).items())
    out.update(architectures=list(spec.draft_model_config.architectures), model_class=model_class.__name__,
               dflash_config=dict(spec.draft_model_config.hf_config.dflash_config))
    return processed(model).model.lilicorr


def run(case):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.lilicorr import LiLiCorrHead

    out = {}
    if "export" in case:
        head = served_head(case, out).eval()
    else:
        head = LiLiCorrHead(model_hidden_size=case["model_hidden_size"], block_size=case["block_size"],
                            rms_norm_eps=case["rms_norm_eps"], config=case["config"])
        head.load_state_dict(case["state"], strict=True)
        head.materialize_inference_buffers(torch.device("cpu"), torch.float32)  # in load_weights, as vLLM's loader
        processed(head).eval()  # then the loader's processing of the loaded weights
    emb, log_probs, pass_hidden, anchor, valid = case["inputs"]
    with torch.no_grad():
        out["start"], out["pair"] = head.score(token_embeddings=emb, candidate_log_probs=log_probs,
                                               pass_hidden=pass_hidden, anchor_hidden=anchor, anchor_valid=valid)
        out["table"] = head(emb, log_probs, pass_hidden, anchor, valid)
        out["walk"] = torch.stack([walk(t) for t in out["table"]])
        if "lm_head" in case:
            v, h = case["lm_head"].shape
            lm_head = ParallelLMHead(v, h)
            lm_head.weight.data[:v].copy_(case["lm_head"])
            processed(lm_head)
            ids, values = LogitsProcessor(v).get_top_k_tokens(lm_head, case["hidden"], case["config"][
                "lilicorr_candidate_topk"], return_log_probs=True)
            table = head(case["embed"][ids][None], values[None], case["hidden"][None], case["anchor"][None],
                         torch.ones(1, dtype=torch.bool))
            out.update(ids=ids, log_probs=values, drafted=ids.gather(1, walk(table[0])[:, None])[:, 0])
    return out


def main(cases_path: str, out_path: str) -> None:
    switch_on_v2_runner()
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    cases = torch.load(cases_path)
    with tempfile.TemporaryDirectory() as tmp, \
            set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{os.path.join(tmp, 'init')}")
        parallel_state.initialize_model_parallel(1, 1)
        torch.save([run(case) for case in cases], out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
