"""Real acceptance while training (`validation.prompts`): the drafter being trained, decoding held-out prompts.

    every validation.decode_every steps, and at the end:
      every rank        gathered_state (ZeRO-3: the partitions gathered; a collective)
      rank 0            the drafter's weights copied into an eval copy; the prompts decoded by `dflash-fast eval`'s
                        loop (make_proposal, decode_all: the same functions, greedy, and sampled at
                        validation.temperature with a generator seeded by validation.seed, the same every time)
      rank 0            a "decode" record in OUT/metrics.jsonl (TensorBoard, W&B, MLflow), a log line, the bar's tau
      every rank        waits for rank 0 (Sharing.on_rank0: an error there is every rank's)
    at the end:         OUT/validation.json and a table: the offline estimates (tau_offline, acc_j, alpha_j of the
                        last train record, and of the held-out split's when there is one) beside real tau; a warning
                        naming the usual causes when they diverge (compare)

train/ cannot import this package (imports go down the pipeline: docs/layout.md), so the top-level train.py hands
RealAcceptance to the trainer, which only calls `after_step` and `finish`. The target: in data.source=online the
job's own HF target (its prefetch held off while decoding); otherwise the HF target loaded once, on rank 0's device,
at the first decoding (its weights stay resident next to the drafter: `train.py --plan` does not count them).

A "decode" record: tau and accept_1..accept_{B-1} (per drafted position, the fraction of blocks that reached it
that accepted it: report.acceptance_by_position's `conditional`), tau_offline_prompts (the drafter's tau_offline
over the decoded outputs, eval's `tau_offline`), prompts, new_tokens, verify_forwards, seconds; with a temperature
also temperature, tau_sampled and accept_sampled_j.
"""
import contextlib
import json
import os
import time
from typing import Dict, List, Optional

from dflash_fast.data.online import OnlineSource
from dflash_fast.data.source import Source
from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.errors import UserError
from dflash_fast.evaluate.decode import TargetRunner
from dflash_fast.evaluate.evaluate import decode_all, make_proposal
from dflash_fast.evaluate.report import report
from dflash_fast.evaluate.sampling import Sampling, make_sampler
from dflash_fast.store.format import write_json_atomic
from dflash_fast.target.prompts import encode_prompt, eos_token_ids, load_model, prompt_tokenizer, read_prompts
from dflash_fast.train.distributed import gathered_state

RESULT = "validation.json"
TROUBLESHOOTING = "docs/troubleshooting.md#real-tau-far-from-tau_offline"
CAUSES = (
    "the store tapped other layer ids than the drafter decodes with (model.layer_ids, extract --layer-ids)",
    "the final norm applied twice (`last` taken after the target's final norm instead of before it)",
    "an anchored mask of <= instead of < (in training a slot saw its own position)",
    "a chat template mismatch between the training data and the prompts (thinking on/off, system prompt, "
    "validation.thinking)",
    "training responses that are not the target's own greedy ones (another model, sampled at a temperature)",
    "a train-serve context mismatch (model.window_from, data.seq_len shorter than the prompts plus "
    "validation.max_new_tokens)",
    "validation prompts not drawn like the training data (other sources or tasks), or held-out documents that "
    "repeat training text (a near-duplicate inflates val tau_offline): no bug, a gap between the texts scored",
    "too few prompts",
)


class RealAcceptance:
    """Built by the Trainer (Trainer(real_acceptance=RealAcceptance)) when validation.prompts is set; reads the
    prompts and the tokenizer on rank 0 at once, so a bad file stops the run before step 1."""

    def __init__(self, trainer):
        self.cfg = trainer.cfg.validation
        self.tau: Optional[float] = None  # the newest greedy tau (rank 0), for the progress bar
        self.decoded_step: Optional[int] = None
        self.target = trainer.target
        self.trained_thinking = (trainer.store.manifest.get("extraction") or {}).get("thinking") or {}
        self.model = self.runner = self.drafter = None
        self.encoded, self.tokenizer = (trainer.sharing.on_rank0(self._prompts, (UserError, ValueError, OSError))
                                        or ([], None))
        trainer.log(f"real acceptance: {len(self.encoded)} prompts of {self.cfg.prompts} x "
                    f"{self.cfg.max_new_tokens} new tokens, "
                    + (f"every {self.cfg.decode_every} steps and " if self.cfg.decode_every else "")
                    + "at the end; greedy" + (f" and T = {self.cfg.temperature}" if self.cfg.temperature else ""))

    def _prompts(self):
        """The prompts encoded as eval encodes them, and the tokenizer (rank 0)."""
        try:
            prompts = read_prompts(self.cfg.prompts, self.cfg.num_prompts)
        except (OSError, ValueError) as e:
            raise UserError(f"validation.prompts={self.cfg.prompts}: {e}") from None
        tokenizer, think = prompt_tokenizer(
            self.target, self.cfg.thinking, self.trained_thinking,
            f"validation.prompts (validation.thinking={self.cfg.thinking or 'the default'})")
        return [encode_prompt(tokenizer, p, think) for p in prompts], tokenizer

    # ---- the trainer's two calls

    def after_step(self, trainer, stopping: bool) -> None:
        """Decode every validation.decode_every steps (not while a signal stops the run: it saves at once)."""
        if self.cfg.decode_every and trainer.step % self.cfg.decode_every == 0 and not stopping:
            self.decode(trainer)

    def finish(self, trainer) -> None:
        """The end of the run: a last decoding unless this step had one, then OUT/validation.json and its table."""
        if self.decoded_step != trainer.step:
            self.decode(trainer)
        path = os.path.join(trainer.out_dir, RESULT)

        def write() -> None:
            with open(trainer.metrics.path) as f:
                result = compare([json.loads(line) for line in f], self.cfg.max_gap)
            write_json_atomic(path, result)
            trainer.log(comparison_table(result) + f"\n(in {path})")
            if result["warning"]:
                trainer.log(f"WARNING: {result['warning']}")

        trainer.sharing.on_rank0(write, (OSError, ValueError))

    # ---- one decoding

    def decode(self, trainer) -> None:
        """One decoding at trainer.step: every rank gathers, rank 0 decodes and records, the others wait."""
        state = gathered_state(trainer.engine.module, trainer.rank, trainer.zero_stage)
        entry = trainer.sharing.on_rank0(lambda: self._decode(trainer, state), (UserError, ValueError, OSError))
        self.decoded_step = trainer.step
        if entry is not None:
            trainer.metrics.record(entry)
            self.tau = entry["tau"]
            trainer.log(decode_line(entry))

    def _target(self, trainer):
        """(HF model, what keeps others off it while decoding): the online job's own target, or one loaded once."""
        source = trainer.store
        if (isinstance(source, OnlineSource) and Source.of(trainer.cfg.data).engine == "hf"
                and source.runner.model is not None):
            return source.runner.model, source.exclusive()
        if self.model is None:
            self.model = load_model(self.target, trainer.device)
        return self.model, contextlib.nullcontext()

    def _decode(self, trainer, state) -> Dict:
        t = time.perf_counter()
        model, exclusive = self._target(trainer)
        module = trainer.engine.module
        if self.drafter is None:
            self.drafter = DFlashDrafter(module.config, frozen_dtype=module.embed_tokens.dtype)
            self.drafter.set_frozen(module.embed_tokens, module.lm_head, module.target_norm)
            self.runner = TargetRunner(model, module.config.layer_ids)  # its taps are hooks: made once
        self.drafter.load_trainable(state)
        settings = [None] + ([Sampling(self.cfg.temperature, 1.0, self.cfg.seed)] if self.cfg.temperature else [])
        eos, reports = eos_token_ids(model.generation_config, self.tokenizer), []
        with exclusive:
            for sampling in settings:
                sampler = make_sampler(sampling, model.device)  # seeded afresh: the same draws at every step
                proposal = make_proposal(self.drafter, model, self.target, None, None, sampler)
                tally = decode_all(self.runner, self.encoded, proposal, self.cfg.max_new_tokens, eos,
                                    offline=sampler is None, baseline=False, progress=False, sampler=sampler)
                reports.append(report(tally, False))
        return decode_record(trainer.step, reports[0], reports[1] if len(reports) > 1 else None,
                             self.cfg.temperature, time.perf_counter() - t)


def decode_record(step: int, greedy: Dict, sampled: Optional[Dict], temperature: float, seconds: float) -> Dict:
    """The metrics.jsonl record of one decoding from eval's reports (report.report) of it."""
    entry = {"split": "decode", "step": step, "tau": greedy["tau"],
             **{f"accept_{p['position']}": p["conditional"] for p in greedy["acceptance_by_position"]},
             "tau_offline_prompts": greedy["tau_offline"], "prompts": len(greedy["per_prompt"]),
             "new_tokens": greedy["new_tokens"], "verify_forwards": greedy["verify_forwards"]}
    if sampled is not None:
        entry.update(temperature=temperature, tau_sampled=sampled["tau"],
                     **{f"accept_sampled_{p['position']}": p["conditional"] for p in sampled["acceptance_by_position"]})
    entry["seconds"] = seconds
    return entry


def decode_line(entry: Dict) -> str:
    """A decode record as one log line."""
    positions = sorted(int(k.rsplit("_", 1)[1]) for k in entry if k.startswith("accept_") and k[7:].isdigit())
    accept = " ".join("-" if entry[f"accept_{j}"] is None else f"{entry[f'accept_{j}']:.2f}" for j in positions)
    line = (f"real acceptance at step {entry['step']}: tau {_num(entry['tau'])} over {entry['prompts']} prompts "
            f"(greedy; accepted by position {accept}; tau_offline of their outputs "
            f"{_num(entry['tau_offline_prompts'])})")
    if "tau_sampled" in entry:
        line += f", tau {_num(entry['tau_sampled'])} at T = {entry['temperature']}"
    return line + f", {entry['seconds']:.1f} s"


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------- the end of the run


def _latest(records: List[Dict], split: str, step: int) -> Optional[Dict]:
    found = [r for r in records if r.get("split") == split and r["step"] <= step]
    return found[-1] if found else None


def compare(records: List[Dict], max_gap: float) -> Dict:
    """The offline estimates beside real acceptance at the last decoding of metrics.jsonl `records`.

    The offline estimate compared is the held-out split's tau_offline (val, not trained on) when the run has one,
    else the last train record's (its window's mean). Divergence: drafted tokens accepted per block, real tau - 1
    against tau_offline - 1, differ by more than `max_gap` times the offline one (the bonus token, 1 on both sides,
    is left out: it would hide a drafter that accepts nothing). Nothing is compared while the offline estimate is
    below 1.05 (a drafter that has not learnt yet). The gap splits in two through the drafter's tau_offline over the
    decoded outputs (tau_offline_prompts): `gap_decoding`, real tau against it (the same outputs: decoding against
    the training forward), and `gap_data`, it against the estimate (the same forward: these prompts' outputs against
    the split's documents, which differ even when nothing is wrong: docs/training.md); the warning says which side
    the gap lies on."""
    decodes = [r for r in records if r.get("split") == "decode"]
    if not decodes:
        raise ValueError("metrics.jsonl holds no real-acceptance (\"decode\") record to compare")
    real = decodes[-1]
    step = real["step"]
    train, val = _latest(records, "train", step), _latest(records, "val", step)
    offline = val if val is not None and val.get("tau_offline") is not None else train
    estimate = None if offline is None else offline.get("tau_offline")
    positions = sorted(int(k[7:]) for k in real if k.startswith("accept_") and k[7:].isdigit())
    by_position = []
    for j in positions:
        row = {"position": j}
        for name, rec in (("train", train), ("val", val)):
            if rec is not None:
                row.update({f"acc_{name}": rec.get(f"acc_{j}"), f"alpha_{name}": rec.get(f"alpha_{j}")})
        row["real"] = real[f"accept_{j}"]
        if "tau_sampled" in real:
            row["real_sampled"] = real[f"accept_sampled_{j}"]
        by_position.append(row)
    gap = _gap(real["tau"], estimate)
    prompts_offline = real.get("tau_offline_prompts")
    gap_decoding = _gap(real["tau"], prompts_offline)  # the same outputs: decoding against the training forward
    gap_data = _gap(prompts_offline, estimate)  # the same forward: these prompts' outputs against the split's texts
    diverged = gap is not None and gap > max_gap
    warning = None
    if diverged:
        side = ""
        if prompts_offline is not None and abs(prompts_offline - real["tau"]) <= abs(prompts_offline - estimate):
            side = (f" The drafter's tau_offline over the decoded outputs is {prompts_offline:.3f}, near real tau: "
                    f"decoding agrees with the training forward, and the gap lies between the texts scored "
                    f"({offline['split']} documents against these prompts' outputs): a bug when what the drafter "
                    f"trained on differs from what the target computes for these prompts (the store's taps or `last`, "
                    f"the template, the responses), none when the prompts are not drawn like the training data or "
                    f"held-out documents repeat training text; prompts held out from the training set tell the two "
                    f"apart.")
        elif prompts_offline is not None:
            side = (f" The drafter's tau_offline over the decoded outputs is {prompts_offline:.3f}, near the offline "
                    f"estimate: on the same outputs decoding differs from the training forward (the mask, the "
                    f"window, the proposal).")
        warning = (f"real tau {real['tau']:.3f} ({real['prompts']} prompts) is far from the offline estimate "
                   f"tau_offline {estimate:.3f} ({offline['split']} at step {offline['step']}): drafted tokens "
                   f"accepted per block differ by {100 * gap:.0f}% (validation.max_gap={max_gap:g}).{side} Usual "
                   f"causes: " + "; ".join(CAUSES) + f" ({real['prompts']} here). See {TROUBLESHOOTING}.")
    history = [{"step": r["step"], "tau": r["tau"], "tau_sampled": r.get("tau_sampled"),
                "tau_offline_prompts": r.get("tau_offline_prompts"),
                "tau_offline_train": (_latest(records, "train", r["step"]) or {}).get("tau_offline"),
                "tau_offline_val": (_latest(records, "val", r["step"]) or {}).get("tau_offline")} for r in decodes]
    return {
        "step": step,
        "offline": {"compared": None if offline is None else offline["split"], "tau_offline": estimate,
                    "tau_offline_train": None if train is None else train.get("tau_offline"),
                    "tau_offline_val": None if val is None else val.get("tau_offline")},
        "real": {k: real.get(k) for k in ("tau", "tau_offline_prompts", "temperature", "tau_sampled", "prompts",
                                          "new_tokens", "verify_forwards")},
        "by_position": by_position,
        "gap": gap,
        "gap_decoding": gap_decoding,
        "gap_data": gap_data,
        "max_gap": max_gap,
        "diverged": diverged,
        "warning": warning,
        "history": history,
    }


def _gap(tau: Optional[float], reference: Optional[float]) -> Optional[float]:
    """|(tau - 1) - (reference - 1)| / (reference - 1): drafted tokens accepted per block, the bonus token left out;
    None when either is missing or the reference is below 1.05 (a drafter that has not learnt yet)."""
    if tau is None or reference is None or reference < 1.05:
        return None
    return abs(tau - reference) / (reference - 1)


def comparison_table(result: Dict) -> str:
    """compare's result as the lines the run prints at its end."""
    off, real = result["offline"], result["real"]
    lines = [f"offline estimate vs real acceptance at step {result['step']}:",
             f"  tau_offline train {_num(off['tau_offline_train'])}, val {_num(off['tau_offline_val'])}, "
             f"of the decoded outputs {_num(real['tau_offline_prompts'])}  |  real tau {_num(real['tau'])} "
             f"(greedy, {real['prompts']} prompts)"
             + (f", {_num(real['tau_sampled'])} at T = {real['temperature']}" if real.get("tau_sampled") else ""),
             "  position: acc_j train / val, alpha_j train / val  |  real acceptance (greedy"
             + (", sampled)" if real.get("tau_sampled") else ")")]
    for row in result["by_position"]:
        lines.append(f"  {row['position']:>8}: {_num(row.get('acc_train'))} / {_num(row.get('acc_val'))}, "
                     f"{_num(row.get('alpha_train'))} / {_num(row.get('alpha_val'))}  |  {_num(row['real'])}"
                     + (f", {_num(row['real_sampled'])}" if "real_sampled" in row else ""))
    gaps = {k: "-" if result.get(k) is None else f"{100 * result[k]:.0f}%" for k in ("gap", "gap_decoding", "gap_data")}
    lines.append(f"  gap in drafted tokens per block: {gaps['gap']} (warns past {100 * result['max_gap']:.0f}%): real "
                 f"tau against the outputs' tau_offline {gaps['gap_decoding']} (decoding), the outputs' against "
                 f"{result['offline']['compared']}'s {gaps['gap_data']} (the texts)")
    return "\n".join(lines)
