"""`dflash-fast eval`: real acceptance of a drafter (an export or a checkpoint) on a prompt set.

    prompts ──encode──▶ decode.speculative_generate (the drafter proposes, the HF target verifies) per prompt
            ──report.Tally──▶ tau, acceptance by position and context, greedy identity, tau_offline ──▶ JSON
    --engine vllm | both: vLLM itself serves the target and the export (evaluate/vllm.py), alone or side by side
    --benchmark gsm8k,mt-bench,...: public benchmarks instead of --data, one report row each (evaluate/benchmarks.py)

`tau_offline` runs the drafter's training forward over the target's own greedy output (an anchor at every eligible
response position) and averages spec.md §6's per-block value.
"""

import json
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from dflash_fast.drafter.model import DFlashDrafter, slot_metrics
from dflash_fast.drafter.weights import load_frozen_tensors
from dflash_fast.evaluate import benchmarks
from dflash_fast.evaluate.benchmarks import benchmarks_report, decode_suites, first_prompt, load_suites, markdown_table
from dflash_fast.evaluate.decode import Proposer, Step, TargetRunner, greedy_generate, speculative_generate
from dflash_fast.evaluate.report import Tally, mean_acceptance, report, summary
from dflash_fast.evaluate.sampling import Sampler, add_sampling_arguments, check_sampling, make_sampler
from dflash_fast.flags import call_with_flags
from dflash_fast.serve.export import exported_thinking, load_exported
from dflash_fast.serve.model_card import read_provenance, trained_thinking
from dflash_fast.store.layer_ids import default_layer_ids
from dflash_fast.target.load import check_target
from dflash_fast.target.prompts import (
    add_model_arguments,
    encode_prompt,
    eos_token_ids,
    load_model,
    prompt_tokenizer,
    read_prompts,
)


def response_row(step: Step, ids: Sequence[int], prompt_len: int) -> Dict[str, torch.Tensor]:
    """One sequence as a training row (dflash_fast.data.batches keys, no anchors yet): the target's
    forward `step` over `ids` [t]; the loss mask covers the response, positions prompt_len..t-1."""
    t, dev = len(ids), step.logits.device
    return dict(
        input_ids=torch.tensor([list(ids)], device=dev),
        loss_mask=(torch.arange(t, device=dev) >= prompt_len)[None],
        document_ids=torch.zeros(1, t, dtype=torch.long, device=dev),
        position_ids=torch.arange(t, device=dev)[None],
        hidden=step.hidden[None],
        last=step.last[None],
    )


@torch.inference_mode()
def offline_tau(
    runner: TargetRunner,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    anchors: Optional[Sequence[int]] = None,
    anchors_per_forward: int = 32,
) -> Tuple[float, int]:
    """spec.md §6 tau_offline sums over one sequence -> (tau_sum, blocks).

    One target forward over prompt + response gives `hidden` and `last`; the drafter's training
    forward then scores blocks at `anchors` (default: every response position a with a + 1 in the
    response), `anchors_per_forward` at a time to bound its [A*B] queries.
    """
    ids = list(prompt_ids) + list(response_ids)
    row = response_row(runner.forward(ids), ids, len(prompt_ids))
    anchors = list(range(len(prompt_ids), len(ids) - 1)) if anchors is None else sorted(anchors)
    tau_sum, blocks = 0.0, 0
    for a in range(0, len(anchors), anchors_per_forward):
        chunk = torch.tensor([anchors[a : a + anchors_per_forward]], device=runner.device)
        # kl: the full teacher of `last` (its argmax is ce's label; a DSpark confidence head needs the full teacher)
        out = drafter(dict(row, anchors=chunk, anchor_valid=torch.ones_like(chunk, dtype=torch.bool)), loss_kind="kl")
        m = slot_metrics(out)
        tau_sum += float(m["tau_sum"])
        blocks += int(m["blocks"])
    return tau_sum, blocks


def drafter_thinking(drafter) -> Dict[str, int]:
    """How the training conversations of `drafter` were rendered (counts by thinking "on" / "off"): an export's
    config.json dflash_fast.thinking, a trainer checkpoint's run OUT/provenance.json; {} when neither records it
    (or `drafter` is a module, not a path)."""
    if not isinstance(drafter, str) or not os.path.exists(drafter):
        return {}
    if os.path.isfile(os.path.join(drafter, "config.json")):
        return exported_thinking(drafter)
    from dflash_fast.train.checkpoint import run_dir_of

    return trained_thinking(read_provenance(run_dir_of(drafter))) or {}


def load_drafter(path: str, target: str) -> DFlashDrafter:
    """An export directory (speculators or z-lab layout), or a trainer checkpoint; frozen tensors from `target`."""

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"drafter {path} does not exist: pass a `dflash-fast export` directory or a trainer checkpoint"
        )
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        # checkpoints hold no config.json: this is an export (load_exported names what is wrong with it)
        return load_exported(path, target)
    from dflash_fast.train.checkpoint import load_drafter_for_export

    drafter, _ = load_drafter_for_export(path)
    drafter.set_frozen(**load_frozen_tensors(target))
    return drafter


def _check_drafter(drafter: DFlashDrafter, model) -> None:
    hidden_size, vocab = model.config.get_text_config().hidden_size, model.get_output_embeddings().weight.shape[0]
    cfg = drafter.config
    if (cfg.target_hidden_size, cfg.vocab_size) != (hidden_size, vocab):
        raise ValueError(
            f"the drafter was built for a target with hidden size {cfg.target_hidden_size} and vocabulary "
            f"{cfg.vocab_size}; this target has {hidden_size} and {vocab}: pass the drafter's own target"
        )


class Proposal(NamedTuple):
    module: Optional[DFlashDrafter]  # None for a proposer callable (no tau_offline)
    propose: Proposer
    block_size: int
    layer_ids: List[int]


def make_proposal(drafter, model, target: str, block_size: Optional[int], layer_ids,
              sampler: Optional[Sampler] = None) -> Proposal:
    """What `evaluate` drafts with, from a DFlashDrafter (sampling its drafts through `sampler` when given), a path
    or a Proposer callable."""
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, target)
    if isinstance(drafter, DFlashDrafter):
        _check_drafter(drafter, model)
        module = drafter.to(device=model.device, dtype=model.dtype).eval()
        cfg, with_confidence = module.config, module.proposes_confidence
        draw = None if sampler is None else sampler.draw
        # verification block: the anchor and the drafted tokens (B of them with sample_from_anchor)
        return Proposal(module, lambda hidden, anchor, _ids: module.propose(hidden, anchor, with_confidence, draw),
                        cfg.drafted_tokens + 1, list(cfg.layer_ids))
    if callable(drafter):
        if block_size is None:
            raise ValueError("a proposer callable needs block_size (B: the anchor plus B-1 drafted tokens)")
        if layer_ids is None:
            layer_ids = default_layer_ids(model.config.get_text_config().num_hidden_layers)
        return Proposal(None, drafter, block_size, list(layer_ids))
    raise TypeError(f"drafter must be a DFlashDrafter, a path or a proposer callable, not {type(drafter).__name__}")


def decode_all(runner: TargetRunner, encoded: List[List[int]], proposal: Proposal, max_new_tokens: int,
                eos: Sequence[int], offline: bool, baseline: bool, progress: bool,
                sampler: Optional[Sampler] = None, tally: Optional[Tally] = None) -> Tally:
    """Speculative decoding of every prompt (into `tally` when given); with `baseline` the target's own loop too
    (greedy, or sampled by `sampler`), with `offline` tau_offline over its output (the speculative output without
    `baseline`)."""
    from tqdm import tqdm

    tally = Tally(proposal.block_size) if tally is None else tally
    bar = tqdm(encoded, unit="prompt", desc="eval", disable=not progress)
    for ids in bar:
        spec = speculative_generate(runner, ids, proposal.propose, proposal.block_size, max_new_tokens, eos, sampler)
        tally.add_speculative(spec)
        if sum(tally.histogram):
            bar.set_postfix(tau=f"{mean_acceptance(tally.histogram):.2f}")
        reference = spec.tokens
        if baseline:
            reference, seconds = greedy_generate(runner, ids, max_new_tokens, eos, sampler)
            tally.add_greedy(reference, seconds, spec, compare=sampler is None)
        if offline and proposal.module is not None and len(reference) > 1:
            tau_sum, blocks = offline_tau(runner, proposal.module, ids, reference)
            tally.tau_sum += tau_sum
            tally.blocks += blocks
    return tally


def evaluate(
    target: str,
    data: Union[str, Sequence[Dict], None],
    drafter: Union[DFlashDrafter, str, Proposer],
    block_size: Optional[int] = None,
    layer_ids: Optional[Sequence[int]] = None,
    max_new_tokens: Optional[int] = None,
    num_prompts: Optional[int] = None,
    offline: bool = True,
    baseline: bool = True,
    device=None,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    benchmark: Optional[str] = None,
    benchmark_dir: Optional[str] = None,
    thinking: Optional[str] = None,
    split: str = "train",
    warn_thinking: bool = True,
) -> Dict:
    """Speculative decoding of every prompt in `data` (regenerate's JSONL formats, or records) -> report dict.

    `drafter`: a DFlashDrafter, a path (an export of either layout or a trainer checkpoint), or a Proposer
    callable (then `block_size` is required and `layer_ids` defaults to 5 spread ids).
    `baseline` times the target's plain greedy loop and counts prompts where the speculative
    output differs from it; `offline` adds tau_offline over that greedy output (drafters only).
    `temperature` > 0 samples (spec.md §10, evaluate/sampling.py) with `top_p`, seeded by `seed`: the baseline is then
    the target's plain sampling loop (timed, not compared: greedy_mismatches is None).
    `benchmark` ("gsm8k,mt-bench=PATH,...", files found in `benchmark_dir`) replaces `data`: one report row per
    benchmark (evaluate/benchmarks.py), each at its own token budget unless `max_new_tokens` is given (default 128
    for `data`).
    `thinking` "on" / "off" sets the chat template's thinking switch (target/prompts.thinking_switch); one line
    warns when the drafter trained on the other setting (drafter_thinking), unless `warn_thinking` is false (`--engine
    both`: vLLM's run of the same prompts has said it).
    `split`: the split read when `data` is a Hugging Face dataset (target/datasets_in.py).
    """
    sampling = check_sampling(temperature, top_p, seed)
    check_target(target)
    suites = None if benchmark is None else load_suites(benchmark, benchmark_dir, num_prompts)
    prompts = read_prompts(data, num_prompts, split) if suites is None else []
    tokenizer, think = prompt_tokenizer(target, thinking, drafter_thinking(drafter) if warn_thinking else {},
                                        f"eval prompts (--thinking {thinking or 'not given: the template default'})",
                                        trust_remote_code)
    model = load_model(target, device, dtype, trust_remote_code)
    name = drafter if isinstance(drafter, str) else getattr(drafter, "__name__", type(drafter).__name__)
    sampler = make_sampler(sampling, model.device)
    proposal = make_proposal(drafter, model, target, block_size, layer_ids, sampler)
    runner = TargetRunner(model, proposal.layer_ids)
    eos = eos_token_ids(model.generation_config, tokenizer)

    def encode(prompt):
        return encode_prompt(tokenizer, prompt, think)

    encoded = [encode(p) for p in prompts] or [encode(first_prompt(suites))]
    if runner.device.type == "cuda":  # first-call kernel selection and allocation stay out of the timings
        warm = min(max_new_tokens or 128, 2 * proposal.block_size)
        speculative_generate(runner, encoded[0], proposal.propose, proposal.block_size, warm, eos, sampler)
        greedy_generate(runner, encoded[0], warm, eos, sampler)
        if sampler is not None:  # the report of a seed does not depend on the warm-up's draws
            sampler.generator.manual_seed(seed)
    if suites is not None:
        tallies = decode_suites(
            suites, proposal.block_size, encode,
            lambda ids, budget, tally: decode_all(runner, ids, proposal, budget, eos, offline, baseline, progress,
                                                   sampler, tally),
            lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), max_new_tokens)
        return benchmarks_report(
            suites, tallies, baseline, max_new_tokens,
            dict(engine="hf", target=target, drafter=name, device=str(runner.device),
                 dtype=str(model.dtype).replace("torch.", ""), block_size=proposal.block_size,
                 layer_ids=proposal.layer_ids, thinking=thinking, **sampling._asdict()))
    max_new_tokens = max_new_tokens or 128
    tally = decode_all(runner, encoded, proposal, max_new_tokens, eos, offline, baseline, progress, sampler)
    return report(
        tally,
        baseline,
        engine="hf",
        target=target,
        drafter=name,
        device=str(runner.device),
        dtype=str(model.dtype).replace("torch.", ""),
        prompts=len(prompts),
        block_size=proposal.block_size,
        layer_ids=proposal.layer_ids,
        max_new_tokens=max_new_tokens,
        **sampling._asdict(),
    )


def add_arguments(parser) -> None:
    p = parser
    p.add_argument("--target", required=True, help="Hugging Face causal LM: local directory or hub id")
    p.add_argument(
        "--drafter",
        required=True,
        help="export directory (dflash-fast export, speculators or zlab layout) or trainer checkpoint",
    )
    p.add_argument(
        "--data", help="prompts, as for regenerate: JSONL of {conversations: [...]} or {text: ...}, or a Hugging Face "
                       "dataset (save_to_disk directory, .parquet, .arrow, hub id); or --benchmark"
    )
    p.add_argument("--split", default="train", help="the split of a Hugging Face dataset --data (default train)")
    benchmarks.add_arguments(p)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use only the first N prompts (--benchmark: N of each, z-lab's seeded subset)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated per prompt (default 128; with --benchmark each benchmark's own budget)")
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the target-only greedy loop (no speedup, no identity check)"
    )
    p.add_argument("--no-offline", action="store_true", help="skip tau_offline")
    add_sampling_arguments(p)
    p.add_argument(
        "--engine", choices=["hf", "vllm", "both"], default="hf",
        help="hf: this loop (default); vllm: vLLM serving the export (docs/vllm.md); both: the two side by side",
    )
    add_model_arguments(p)
    p.add_argument("--out", default=None, help="write the JSON report here instead of stdout")


def run(args) -> int:
    benchmarks.check_flags(args)
    if args.engine != "hf" and args.device is not None:
        raise ValueError(f"--device {args.device}: vLLM picks its own device; leave --device out with --engine "
                         f"{args.engine}")
    if args.engine == "hf":
        report = call_with_flags(evaluate, args, offline=not args.no_offline, baseline=not args.no_baseline)
        text = report["table"] if args.benchmark else summary(report)
    else:
        from dflash_fast.evaluate import vllm as vllm_engine  # vLLM is imported only here (it is an optional install)

        report = call_with_flags(vllm_engine.evaluate_vllm, args, baseline=not args.no_baseline)
        text = report["table"] if args.benchmark else summary(report)
        if args.engine == "both":
            ours = call_with_flags(evaluate, args, offline=not args.no_offline, baseline=not args.no_baseline,
                                   warn_thinking=False)
            report = {"side_by_side": vllm_engine.side_by_side(ours, report), "hf": ours, "vllm": report}
            if args.benchmark:  # one table, each cell "ours / vLLM"
                report["table"] = "ours / vLLM\n\n" + markdown_table(ours, report["vllm"])
            text = vllm_engine.summary(report)
    out = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(out + "\n")
    else:
        print(out)
    if args.out and args.benchmark:
        benchmarks.write_table(report, args.out)
    print(text + (f"\nreport in {args.out}" if args.out else ""), file=sys.stderr)
    return 0
