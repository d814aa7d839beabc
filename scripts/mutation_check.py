"""Do the tests catch the bugs they guard? Inject one-line bugs into a copy of the repo, one at a time.

    python scripts/mutation_check.py                 # every mutation below (~7 minutes of CPU)
    python scripts/mutation_check.py --only slot-mask-ignores-anchor-valid kl-metric-is-the-soft-ce
    python scripts/mutation_check.py --list          # names, targets and the tests each one runs

Each mutation replaces ONE line of the source (found by its stripped text, which must occur exactly
once in the file) with a wrong version, then runs the tests named for it in a temporary copy of the
repo: the working tree is never touched. A mutation is KILLED when those tests fail, SURVIVED when
they pass (the suite cannot see that bug: add a test), ERROR when pytest could not run them.
Before the mutations, the same tests run once on the unmodified copy and must pass.

The copy holds the files git tracks plus untracked ones it does not ignore; `dflash_fast/kernels`
is linked to the copy's `kernels/` so that both packages import from the copy (the editable install
would map `dflash_fast.kernels` back to the working tree), and bytecode is not cached (a mutant and
the original line can have the same size and mtime second). Exit status 0 iff every mutation is killed.
`tests/test_mutation_check.py` (in CI) only checks that every target line still exists once.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mutation(NamedTuple):
    name: str
    path: str  # relative to the repo root
    line: str  # the target line, stripped; must occur exactly once
    mutant: Optional[str]  # the replacement (indentation is kept); None deletes the line
    tests: Sequence[str]  # pytest node ids or files, relative to the repo root
    why: str  # the spec.md rule it breaks


T_ALIGN = "tests/test_teacher_alignment.py"
T_ORACLES = "tests/test_spec_oracles.py"
T_TRAINER = "tests/test_trainer_kl_topk.py"
T_EVAL_TAPS = "tests/test_evaluate.py::test_taps_through_the_cache_are_hf_hidden_states_at_id_plus_one"
T_EXTRACT_TAPS = "tests/test_extract.py::test_stored_hidden_is_hf_hidden_states_at_id_plus_one"
T_EXTRACT_LAST = "tests/test_extract.py::test_last_is_the_pre_norm_residual_of_the_final_layer_not_an_intermediate_one"
T_FC = "tests/test_drafter.py::test_every_tapped_layer_reaches_fc"
T_EXPORT = "tests/test_export.py::test_export_round_trip_names_and_layer_ids"
T_ANCHOR = "tests/test_batches.py::test_anchor_needs_loss_mask_on_itself_and_next_token"

MUTATIONS: List[Mutation] = [
    # ---- spec.md §5: which slots train (dflash_fast/drafter/targets.py)
    Mutation(
        "slot-mask-ignores-anchor-valid",
        "dflash_fast/drafter/targets.py",
        "& valid[:, :, None]",
        None,
        [T_ALIGN],
        "invalid anchors are masked out",
    ),
    Mutation(
        "slot-mask-ignores-document",
        "dflash_fast/drafter/targets.py",
        '& (gather(batch["document_ids"]) == anchor_doc)',
        None,
        [T_ALIGN],
        "slots whose position leaves the document are masked out",
    ),
    Mutation(
        "slot-mask-ignores-loss-mask",
        "dflash_fast/drafter/targets.py",
        '& gather(batch["loss_mask"].bool())',
        None,
        [T_ALIGN],
        "slots with loss_mask = 0 are masked out",
    ),
    Mutation(
        "slot-zero-trained",
        "dflash_fast/drafter/targets.py",
        "(j >= (0 if sample_from_anchor else 1))",
        "(j >= 0)",
        [T_ALIGN],
        "slot 0 is never trained",
    ),
    # ---- spec.md §5: the teacher at p - 1, the data label at p
    Mutation(
        "teacher-row-at-p",
        "dflash_fast/drafter/targets.py",
        "return Targets(mask, in_row, (p - 1).clamp(0, t - 1), prev)",
        "return Targets(mask, in_row, p.clamp(0, t - 1), prev)",
        [T_ALIGN],
        "slot at p is scored against p - 1",
    ),
    Mutation(
        "kl-last-at-p",
        "dflash_fast/drafter/targets.py",
        "return (targets.teacher_row + offsets).flatten()",
        "return (targets.position + offsets).flatten()",
        [T_ALIGN],
        "kl teacher at p - 1",
    ),
    Mutation(
        "ce-stored-label-at-p",
        "dflash_fast/drafter/targets.py",
        'gather_rows(batch["teacher_topk_ids"], targets.teacher_row)[:, 0] if "teacher_topk_ids" in batch else None',
        'gather_rows(batch["teacher_topk_ids"], targets.position)[:, 0] if "teacher_topk_ids" in batch else None',
        [T_ALIGN],
        "ce reads the stored argmax at p - 1",
    ),
    Mutation(
        "ce_data-label-at-p-minus-1",
        "dflash_fast/drafter/targets.py",
        'teacher = Teacher(labels=gather_rows(batch["input_ids"], targets.position))',
        'teacher = Teacher(labels=gather_rows(batch["input_ids"], targets.teacher_row))',
        [T_ALIGN],
        "ce_data's label is input_ids[p]",
    ),
    Mutation(
        "kl_topk-ids-at-p",
        "dflash_fast/drafter/targets.py",
        'topk_ids=gather_rows(batch["teacher_topk_ids"], targets.teacher_row),',
        'topk_ids=gather_rows(batch["teacher_topk_ids"], targets.position),',
        [T_ALIGN],
        "kl_topk teacher at p - 1",
    ),
    Mutation(
        "kl_topk-logits-at-p",
        "dflash_fast/drafter/targets.py",
        'topk_logits=gather_rows(batch["teacher_topk_logits"], targets.teacher_row),',
        'topk_logits=gather_rows(batch["teacher_topk_logits"], targets.position),',
        [T_ALIGN],
        "kl_topk teacher at p - 1",
    ),
    Mutation(
        "kl_topk-lse-at-p",
        "dflash_fast/drafter/targets.py",
        'topk_lse=gather_rows(batch["teacher_lse"], targets.teacher_row),',
        'topk_lse=gather_rows(batch["teacher_lse"], targets.position),',
        [T_ALIGN],
        "kl_topk teacher at p - 1",
    ),
    Mutation(
        "ce_data-metric-against-the-data",
        "dflash_fast/drafter/backbone.py",
        'teacher_argmax = stored_argmax if stored_argmax is not None and loss_kind == "ce_data" '
        "else out.teacher_argmax",
        "teacher_argmax = out.teacher_argmax",
        [T_ALIGN],
        "acc_j compares with argmax(teacher)",
    ),
    # ---- spec.md §5: weights and the denominator
    Mutation(
        "position-weight-off-by-one",
        "dflash_fast/drafter/targets.py",
        "return torch.where(j >= 1, torch.exp(-(j - 1) / gamma), torch.zeros(()))",
        "return torch.where(j >= 1, torch.exp(-j / gamma), torch.zeros(()))",
        [T_ORACLES + "::test_position_weights_are_spec_values"],
        "w_j = exp(-(j - 1) / gamma)",
    ),
    Mutation(
        "denominator-is-the-weight-sum",
        "dflash_fast/drafter/backbone.py",
        "targets.slot_mask.sum(),",
        "weights.sum(),",
        [T_ALIGN],
        "loss = sum(l * w * mask) / sum(mask)",
    ),
    Mutation(
        "trainer-ignores-loss-gamma",
        "dflash_fast/train/trainer.py",
        "gamma=loss.gamma, weighting=loss.weighting,",
        "gamma=7.0, weighting=loss.weighting,",
        [T_TRAINER],
        "loss.gamma sets w_j",
    ),
    Mutation(
        "auto-loss-kind-without-last-is-ce",
        "dflash_fast/train/model.py",
        'return "kl" if manifest["has_last"] else "kl_topk"',
        'return "kl" if manifest["has_last"] else "ce"',
        [T_TRAINER],
        "loss.kind auto is kl_topk on a store without last",
    ),
    Mutation(
        "resume-skips-a-micro-batch",
        "dflash_fast/train/trainer.py",
        'client["micro_batch"])',
        'client["micro_batch"] + 1)',
        [T_TRAINER],
        "resume continues exactly",
    ),
    # ---- spec.md §5: the loss kinds (dflash_fast/drafter/eager.py, the oracle the kernels are tested against)
    Mutation(
        "final-norm-twice-in-the-teacher",
        "dflash_fast/drafter/eager.py",
        "teacher_logits = F.linear(rms_norm(teacher.last, teacher.final_norm_weight, eps), lm_head_weight).float()",
        "teacher_logits = F.linear(rms_norm(rms_norm(teacher.last, teacher.final_norm_weight, eps), "
        "teacher.final_norm_weight, eps), lm_head_weight).float()",
        [T_ORACLES, T_ALIGN],
        "teacher = lm_head(final_norm(last)), the norm once",
    ),
    Mutation(
        "kl-metric-is-the-soft-ce",
        "dflash_fast/drafter/eager.py",
        "kl = (p * (logp - logq)).sum(-1)",
        "kl = -(p * logq).sum(-1)",
        [T_ORACLES],
        "log the KL itself, not the soft CE",
    ),
    Mutation(
        "kl_topk-without-rest-mass",
        "dflash_fast/drafter/eager.py",
        "per_row = -((p * logq_top).sum(-1) + rest_term)",
        "per_row = -(p * logq_top).sum(-1)",
        [T_ORACLES],
        "the rest mass goes to every other token",
    ),
    Mutation(
        "kl_topk-rest-probability-unnormalised",
        "dflash_fast/drafter/eager.py",
        "logq_rest = torch.logsumexp(rest_logits, dim=-1) - torch.logsumexp(logits, dim=-1)",
        "logq_rest = torch.logsumexp(rest_logits, dim=-1)",
        [T_ORACLES],
        "q_rest = 1 - sum_i q_i",
    ),
    Mutation(
        "kl_topk-renormalised-top-k",
        "dflash_fast/drafter/eager.py",
        "p = torch.exp(teacher.topk_logits.float() - teacher.topk_lse.float()[:, None])  # [N, k]",
        "p = torch.softmax(teacher.topk_logits.float(), dim=-1)  # [N, k]",
        [T_ORACLES],
        "p_i = exp(z_i - lse)",
    ),
    Mutation(
        "kl_topk-metric-without-rest-mass",
        "dflash_fast/drafter/eager.py",
        "plogp = plogp + torch.where(p_rest > 0, p_rest * p_rest.clamp(min=1e-38).log(), torch.zeros_like(p_rest))",
        None,
        [T_ORACLES],
        "the KL metric of kl_topk includes the rest mass",
    ),
    Mutation(
        "kl_topk-rest-mass-at-k-equal-v",
        "dflash_fast/drafter/eager.py",
        "p_rest = (1 - p.sum(-1)).clamp(min=0) if ids.shape[1] < logits.shape[1] else torch.zeros_like(p[:, 0])",
        "p_rest = (1 - p.sum(-1)).clamp(min=0)",
        [T_ORACLES],
        "kl_topk is exact at k = V",
    ),
    Mutation(
        "kernel-kl_topk-rest-mass-at-k-equal-v",
        "kernels/lm_head_loss.py",
        "rest_ok = (p_rest > 0) & torch.isfinite(sums[2])",
        "rest_ok = p_rest > 0",
        [T_ORACLES + "::test_kl_topk_with_k_equal_to_the_vocabulary_is_kl"],
        "kl_topk is exact at k = V, in the kernel",
    ),
    # ---- spec.md §4: the anchored attention pattern
    Mutation(
        "context-includes-the-anchor",
        "dflash_fast/drafter/eager.py",
        "ctx = (document_ids[:, None, :] == anchor_doc[:, :, None]) & (p[None, None, :] < anchors[:, :, None])",
        "ctx = (document_ids[:, None, :] == anchor_doc[:, :, None]) & (p[None, None, :] <= anchors[:, :, None])",
        [T_ORACLES],
        "context strictly before the anchor (< not <=)",
    ),
    Mutation(
        "context-ignores-documents",
        "dflash_fast/drafter/eager.py",
        "ctx = (document_ids[:, None, :] == anchor_doc[:, :, None]) & (p[None, None, :] < anchors[:, :, None])",
        "ctx = p[None, None, :] < anchors[:, :, None]",
        [T_ORACLES],
        "context keys of the anchor's document only",
    ),
    Mutation(
        "window-edge-off-by-one",
        "dflash_fast/drafter/eager.py",
        'first = anchors[:, :, None] - window if window_from == "anchor" else anchors[:, :, None] + j - window + 1',
        'first = anchors[:, :, None] - window + 1 if window_from == "anchor" else anchors[:, :, None] + j - window + 1',
        [T_ORACLES],
        "window: p >= a - W",
    ),
    Mutation(
        "query-window-ends-at-the-anchor",
        "dflash_fast/drafter/eager.py",
        'first = anchors[:, :, None] - window if window_from == "anchor" else anchors[:, :, None] + j - window + 1',
        'first = anchors[:, :, None] - window if window_from == "anchor" else anchors[:, :, None] - window + 1',
        [T_ORACLES],
        "per-query window: p > a + j - W",
    ),
    Mutation(
        "kernel-query-window-ends-at-the-anchor",
        "kernels/anchored_attention.py",
        "return tl.where(query_window > 0, tl.maximum(b_lo, b_hi - query_window + 1 + o_q % BLOCK_SIZE), b_lo)",
        "return tl.where(query_window > 0, tl.maximum(b_lo, b_hi - query_window + 1), b_lo)",
        [T_ORACLES + "::test_attention_is_a_softmax_over_the_keys_spec_makes_visible"],
        "per-query window: p > a + j - W, in the kernel",
    ),
    Mutation(
        "causal-in-block-transposed",
        "dflash_fast/drafter/eager.py",
        "return torch.tril(ones) if causal_in_block else ones",
        "return torch.triu(ones) if causal_in_block else ones",
        [T_ORACLES],
        "causal in block: j' <= j",
    ),
    Mutation(
        "kernel-context-includes-the-anchor",
        "kernels/anchored_attention.py",
        "hi = anchors.clamp(0, t)",
        "hi = (anchors + 1).clamp(0, t)",
        [T_ORACLES + "::test_attention_is_a_softmax_over_the_keys_spec_makes_visible"],
        "context strictly before the anchor, in the kernel",
    ),
    # ---- spec.md §3: anchors and fc
    Mutation(
        "anchor-without-a-next-trainable-token",
        "dflash_fast/data/batches.py",
        "eligible = (m[:-1] & m[1:] & (document_ids[:-1] == document_ids[1:])).nonzero().flatten()",
        "eligible = (m[:-1] & (document_ids[:-1] == document_ids[1:])).nonzero().flatten()",
        [T_ANCHOR],
        "an anchor needs loss_mask[a] = loss_mask[a+1] = 1",
    ),
    Mutation(
        "fc-over-k-minus-1-layers",
        "dflash_fast/drafter/eager.py",
        "return rms_norm(F.linear(x.reshape(n, k * h_t), fc_weight), norm_weight, eps)",
        "return rms_norm(F.linear(x[:, 1:].reshape(n, (k - 1) * h_t), fc_weight[:, h_t:]), norm_weight, eps)",
        [T_FC],
        "fc over ALL K layers",
    ),
    # ---- spec.md §1-2: layer ids, taps, `last`
    Mutation(
        "tap-hidden-states-l-not-l-plus-1",
        "dflash_fast/target/taps.py",
        "layers[layer].register_forward_hook(lambda _m, _args, out, layer=layer: self._keep(layer, out))",
        "layers[layer].register_forward_pre_hook(lambda _m, args, layer=layer: self._keep(layer, args[0]))",
        [T_EXTRACT_TAPS, T_EVAL_TAPS],
        "layer id l is the OUTPUT of decoder layer l (hidden_states[l + 1]), not its input",
    ),
    Mutation(
        "tap-last-layer-after-the-final-norm",
        "dflash_fast/target/taps.py",
        "self._keep(self.num_layers - 1, args[0])",
        "self._keep(self.num_layers - 1, self.norm.forward(args[0]))",
        [T_EXTRACT_TAPS, T_EVAL_TAPS],
        "hidden_states[L] is after the final norm",
    ),
    Mutation(
        "teacher-from-an-intermediate-layer",
        "dflash_fast/extract/capture.py",
        "hidden, last = self.taps.take()",
        "hidden, last = self.taps.take(); last = hidden[..., 0, :]",
        [T_EXTRACT_LAST],
        "last is the final layer's pre-norm residual",
    ),
    Mutation(
        "eval-last-from-an-intermediate-layer",
        "dflash_fast/evaluate/decode.py",
        "return Step(out.logits[0], hidden[0], last[0], cache)",
        "return Step(out.logits[0], hidden[0], hidden[0, :, 0], cache)",
        [T_EVAL_TAPS],
        "last is the final layer's pre-norm residual",
    ),
    Mutation(
        "stored-last-after-the-final-norm",
        "dflash_fast/target/taps.py",
        "self._last.append(args[0])",
        "self._last.append(self.norm.forward(args[0]))",
        [T_EXTRACT_LAST],
        "last is BEFORE the final norm (the teacher applies it once)",
    ),
    # ---- spec.md §1: the export's layer-id convention
    Mutation(
        "export-layer-ids-not-shifted",
        "dflash_fast/serve/layouts.py",
        '"aux_hidden_state_layer_ids": [i + 1 for i in cfg.layer_ids],',
        '"aux_hidden_state_layer_ids": list(cfg.layer_ids),',
        [T_EXPORT],
        "speculators ids = ours + 1",
    ),
    Mutation(
        "import-layer-ids-not-shifted",
        "dflash_fast/serve/views.py",
        '"layer_ids": [i - 1 for i in aux],',
        '"layer_ids": list(aux),',
        [T_EXPORT],
        "speculators ids = ours + 1",
    ),
    # ---- issue #43: bugs the suite did not notice before, and the fixes it asked for
    Mutation(
        "nullable-reads-a-falsy-value-as-null",
        "dflash_fast/errors.py",
        "return None if value is None else _problem(value, schema.schema, path, root)",
        "return None if not value else _problem(value, schema.schema, path, root)",
        ["tests/test_json_trust.py::test_a_falsy_value_of_the_wrong_type_in_a_nullable_key_is_refused_not_read_as_null"],
        "a nullable key holds null or its type: \"\", 0, false, [] are wrong types",
    ),
    Mutation(
        "serve-target-accepts-a-long-payload",
        "dflash_fast/extract/serve.py",
        "if len(payload) != 4 * sum(lengths):",
        "if len(payload) < 4 * sum(lengths):",
        ["tests/test_serve_target.py::test_the_server_answers_a_bad_request_with_an_error_not_a_crash"],
        "a request's ids fill exactly its lengths (extra ids must not join the last document)",
    ),
    Mutation(
        "lock-takeover-keeps-the-stale-tail",
        "dflash_fast/lock.py",
        "os.ftruncate(fd, 0)",
        None,
        ["tests/test_lock.py::test_a_taken_over_lock_holds_only_the_new_record_not_the_stale_tail"],
        "a taken-over lock holds only the new record (readable JSON)",
    ),
    Mutation(
        "failed-run-leaves-its-output-dir",
        "dflash_fast/lock.py",
        "if failed:",
        "if False:",
        ["tests/test_lock.py::test_a_training_run_that_cannot_start_creates_no_output_dir"],
        "a run that cannot start creates nothing",
    ),
    Mutation(
        "zlab-export-taps-the-last-layer",
        "dflash_fast/serve/engines.py",
        "problems += zlab_tap_problems(cfg.layer_ids, cfg.target_num_layers)",
        "pass",
        ["tests/test_zlab_layout.py::test_a_zlab_export_of_a_drafter_tapping_the_last_layer_is_refused_naming_the_layer"],
        "z-lab reads layer id L-1 after the final norm (spec.md §1: HF hidden_states[L] is post-norm)",
    ),
    Mutation(
        "zlab-scalings-read-unchecked",
        "dflash_fast/serve/engines.py",
        "_check_zlab_neutral(config)",
        "pass",
        ["tests/test_zlab_layout.py::test_a_zlab_config_scaling_what_we_do_not_is_refused_naming_the_key"],
        "an export is served as it trains and evaluates",
    ),
    Mutation(
        "vllm-asked-for-more-positions-than-the-target-has",
        "dflash_fast/extract/vllm_runner.py",
        "if positions is not None and longest + 1 > positions:",
        "if False:",
        ["tests/test_vllm_extract.py::test_vllm_is_never_asked_for_more_positions_than_the_target_has"],
        "--engine vllm asks for at most the target's positions, or one error naming --max-seq-len",
    ),
]


def target_line_numbers(text: str, mutation: Mutation) -> List[int]:
    """0-based indices of the lines whose stripped text is the mutation's target."""
    return [i for i, line in enumerate(text.splitlines()) if line.strip() == mutation.line]


def mutate(text: str, mutation: Mutation) -> str:
    """The file text with the target line replaced (or deleted); ValueError unless it occurs exactly once."""
    found = target_line_numbers(text, mutation)
    if len(found) != 1:
        raise ValueError(
            f"mutation {mutation.name}: the line {mutation.line!r} occurs {len(found)} times in {mutation.path} "
            f"(expected once): update the mutation list in scripts/mutation_check.py to the code as it is now"
        )
    lines = text.splitlines(keepends=True)
    old = lines[found[0]]
    indent = old[: len(old) - len(old.lstrip())]
    lines[found[0]] = "" if mutation.mutant is None else indent + mutation.mutant + "\n"
    return "".join(lines)


def copy_repo(dest: str) -> None:
    """The files git tracks plus untracked ones it does not ignore, into `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = os.path.join(REPO, rel)
        if not os.path.isfile(src):  # deleted in the working tree but still in the index
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))
    os.symlink(os.path.join("..", "kernels"), os.path.join(dest, "dflash_fast", "kernels"))


def environment() -> Dict[str, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return env


def check_imports_from(copy: str) -> None:
    """Both packages must import from the copy, or the mutations would not be what runs."""
    probe = (
        "import importlib.util, dflash_fast; "
        "print(dflash_fast.__file__); print(importlib.util.find_spec('dflash_fast.kernels.fc_concat').origin)"
    )
    env = dict(environment(), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, check=True, capture_output=True, text=True)
    for path in out.stdout.split():
        if not os.path.realpath(path).startswith(os.path.realpath(copy) + os.sep):
            raise RuntimeError(f"the copy imports {path} from outside {copy}: the mutations would not run")


def run_tests(copy: str, tests: Sequence[str], timeout: float, stop_at_first: bool) -> Dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"] + ["-x"] * stop_at_first + list(tests)
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=environment(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": None, "seconds": time.time() - start, "failed": [], "tail": f"timed out after {timeout} s"}
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    return {"rc": proc.returncode, "seconds": time.time() - start, "failed": failed, "tail": proc.stdout[-2000:]}


def verdict(result: Dict) -> str:
    if result["rc"] == 1:  # pytest: tests ran and some failed
        return "killed"
    if result["rc"] == 0:
        return "survived"
    return "error"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    p.add_argument("--list", action="store_true", help="print the mutations and exit")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    p.add_argument("--all-failures", action="store_true", help="run every selected test (default: stop at the first)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (default 600)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutation(s) {sorted(unknown)}; --list shows them")
    if args.list:
        for m in selected:
            print(f"{m.name}\n    {m.path}: {m.line}\n    -> {m.mutant}\n    tests: {' '.join(m.tests)}\n    ({m.why})")
        return 0
    for m in selected:  # every target must apply before anything runs
        with open(os.path.join(REPO, m.path)) as f:
            mutate(f.read(), m)

    results = []
    with tempfile.TemporaryDirectory(prefix="dflash-mutation-") as copy:
        copy_repo(copy)
        check_imports_from(copy)
        if not args.no_baseline:
            tests = sorted({t for m in selected for t in m.tests})
            base = run_tests(copy, tests, args.timeout * 2, stop_at_first=False)
            print(f"baseline (unmutated): {verdict(base).replace('survived', 'passes')} in {base['seconds']:.0f} s")
            if base["rc"] != 0:
                print(base["tail"])
                return 2
        for m in selected:
            path = os.path.join(copy, m.path)
            with open(path) as f:
                original = f.read()
            with open(path, "w") as f:
                f.write(mutate(original, m))
            try:
                result = run_tests(copy, m.tests, args.timeout, stop_at_first=not args.all_failures)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            result.update(name=m.name, verdict=verdict(result))
            results.append(result)
            killer = result["failed"][0] if result["failed"] else ""
            print(f"{result['verdict']:>8}  {m.name:<42} {result['seconds']:5.0f} s  {killer}", flush=True)
            if result["verdict"] == "error":
                print(result["tail"])
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("killed", "survived", "error")}
    print(f"{counts['killed']} killed, {counts['survived']} survived, {counts['error']} errors "
          f"of {len(results)} mutations")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: r[k] for k in ("name", "verdict", "seconds", "failed")} for r in results], f, indent=1)
    return 0 if counts["killed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
