"""Real block speculative decoding (spec.md §6) on tiny dense and hybrid targets, and the plot command."""
import json

import pytest
import torch
from oracles import hf_taps
from tiny_targets import make_tiny_target, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_fast.cli import main
from dflash_fast.drafter.model import build_drafter
from dflash_fast.evaluate.decode import TargetRunner, greedy_generate, speculative_generate
from dflash_fast.evaluate.evaluate import evaluate, offline_tau, response_row
from dflash_fast.evaluate.plot import plot_recipes, plot_run, read_metrics, read_recipes
from dflash_fast.evaluate.report import acceptance_by_context, acceptance_by_position, context_bucket, summary
from dflash_fast.serve.export import export_drafter

B = 4
LAYER_IDS = [1, 3, 5]  # 5 = L-1 of the 6-layer tiny targets: tapped before the final norm
PROMPTS = ["def parse_args(self, args=None):", "the drafter reads the hidden state of", "class JSONDecoder(object):"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_tiny_target(tmp_path_factory.mktemp(arch), arch=arch)
        return made[arch]

    return get


def load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def random_drafter(path, seed=0):
    torch.manual_seed(seed)
    return build_drafter(path, LAYER_IDS, mask_token_id=0, num_layers=1, block_size=B).eval()


def future_greedy(model):
    """ids [T+1] -> the target's own next B-1 greedy tokens after them."""
    runner = TargetRunner(model, LAYER_IDS)
    return lambda ids: greedy_generate(runner, ids.tolist(), B - 1)[0]


def scripted_proposer(model, right_per_block):
    """Block i gets right_per_block(i) correct tokens, then tokens the target never picks."""
    future, calls, vocab = future_greedy(model), [], model.config.vocab_size

    def propose(_hidden, _anchor, ids):
        k = right_per_block(len(calls))
        calls.append(k)
        f = future(ids)
        return torch.tensor(f[:k] + [(t + 1) % vocab for t in f[k:]])

    return propose


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gpt_oss"])  # gpt-oss: sliding layers of window 8
def test_speculative_greedy_equals_hf_generate(targets, arch):
    model, tok = load(targets(arch))
    drafter = random_drafter(targets(arch))
    runner = TargetRunner(model, LAYER_IDS)
    eos = [tok.eos_token_id]
    for text in PROMPTS:
        ids = tok(text).input_ids
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)[0, len(ids):].tolist()
        spec = speculative_generate(runner, ids, lambda h, a, _c: drafter.propose(h, a), B, 20, eos)
        assert spec.tokens == want, f"{arch}: speculative output differs from generate(do_sample=False) on {text!r}"
        assert greedy_generate(runner, ids, 20, eos)[0] == want


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_taps_through_the_cache_are_hf_hidden_states_at_id_plus_one(targets, arch):
    """Against one plain HF forward (tests/oracles.py), not against extraction: both share the tap rule."""
    model, tok = load(targets(arch))
    ids = tok(PROMPTS[2]).input_ids
    want_hidden, want_last = hf_taps(model, ids, LAYER_IDS)
    runner = TargetRunner(model, LAYER_IDS)
    head = runner.forward(ids[:5])
    tail = runner.forward(ids[5:], head.cache)
    torch.testing.assert_close(torch.cat([head.hidden, tail.hidden]), want_hidden, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([head.last, tail.last]), want_last, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_partial_acceptance_rolls_the_cache_back_exactly(targets, arch):
    model, tok = load(targets(arch))
    runner = TargetRunner(model, LAYER_IDS)
    ids = tok(PROMPTS[0]).input_ids
    spec = speculative_generate(runner, ids, scripted_proposer(model, lambda i: i % B), B, 30)
    assert spec.accepted == [i % B for i in range(len(spec.accepted))], (
        "a block accepted more or less than its correct prefix"
    )
    assert spec.tokens == greedy_generate(runner, ids, 30)[0]
    assert spec.anchors == [len(ids) + sum(n + 1 for n in spec.accepted[:i]) for i in range(len(spec.accepted))]
    rejected = sum(n < B - 1 for n in spec.accepted[:-1])
    assert spec.recompute_forwards == (rejected if arch == "qwen3_5" else 0), "only non-croppable caches recompute"


def test_oracle_proposer_reaches_tau_b_and_always_wrong_gives_tau_1(targets, tmp_path):
    path = targets("qwen3")
    model, _ = load(path)
    future = future_greedy(model)
    records = [{"text": t} for t in PROMPTS[:2]] + [{"conversations": [{"role": "user", "content": "hi"}]}]
    data = write_jsonl(tmp_path / "prompts.jsonl", records)
    oracle = lambda _h, _a, ids: torch.tensor(future(ids))
    wrong = lambda _h, _a, ids: torch.tensor([(t + 1) % model.config.vocab_size for t in future(ids)])
    best = evaluate(path, data, oracle, block_size=B, layer_ids=LAYER_IDS, max_new_tokens=25, progress=False)
    assert best["tau"] == B and best["acceptance_histogram"][:-1] == [0] * (B - 1)
    assert best["greedy_mismatches"] == 0 and best["tau_offline"] is None
    worst = evaluate(path, data, wrong, block_size=B, layer_ids=LAYER_IDS, max_new_tokens=25, progress=False)
    assert worst["tau"] == 1 and worst["acceptance_histogram"][1:] == [0] * (B - 1)
    assert worst["verify_forwards"] == worst["new_tokens"] - worst["prompts"], (
        "one token per verification after the prefill's"
    )
    for report, tau in ((best, B), (worst, 1)):  # per prompt: its own tau, blocks, output and greedy identity
        rows = report["per_prompt"]
        assert len(rows) == 3 and all(r["tau"] == tau and r["greedy_match"] for r in rows)
        assert sum(r["blocks"] for r in rows) == report["verify_forwards"]
        assert sum(len(r["tokens"]) for r in rows) == report["new_tokens"]


def test_acceptance_by_context_and_position_by_hand():
    # Contexts (anchor + 1) 11 | 64, 65 | 131, 201 fall in buckets 0-63 | 64-127 | 128-255 (first edge 64, doubling).
    assert [context_bucket(n) for n in (11, 63, 64, 127, 128, 201, 256)] == [
        (0, 64), (0, 64), (64, 128), (64, 128), (128, 256), (128, 256), (256, 512)]
    buckets = {128: [1, 1, 0, 0], 0: [1, 0, 0, 0], 64: [0, 0, 1, 1]}  # accepted 0 | 2, 3 | 1, 0 drafts
    assert acceptance_by_context(buckets) == [
        {"context": "0-63", "blocks": 1, "tau": 1.0, "acceptance_histogram": [1, 0, 0, 0]},
        {"context": "64-127", "blocks": 2, "tau": 3.5, "acceptance_histogram": [0, 0, 1, 1]},
        {"context": "128-255", "blocks": 2, "tau": 1.5, "acceptance_histogram": [1, 1, 0, 0]},
    ]
    # 10 blocks accepting 0, 0, 0, 0, 1, 1, 2, 3, 3, 3 drafts: 6 of 10 accept draft 1, 4 of those 6 draft 2, ...
    assert acceptance_by_position([4, 2, 1, 3]) == [
        {"position": 1, "accepted": 0.6, "conditional": 0.6},
        {"position": 2, "accepted": 0.4, "conditional": 4 / 6},
        {"position": 3, "accepted": 0.3, "conditional": 0.75},
    ]
    assert acceptance_by_position([0, 0, 0]) == [{"position": 1, "accepted": None, "conditional": None},
                                                 {"position": 2, "accepted": None, "conditional": None}]
    assert acceptance_by_position([2, 0, 0]) == [{"position": 1, "accepted": 0.0, "conditional": 0.0},
                                                 {"position": 2, "accepted": 0.0, "conditional": None}]


def test_eval_reports_acceptance_by_context_and_position(targets):
    """Blocks accept 0, 1, 2, 3, 0, 1, ... drafts: 12 blocks for 30 tokens (1 + 3 x 10), every count 3 times."""
    path = targets("qwen3")
    model, tok = load(path)
    prompt = PROMPTS[0]
    while len(tok(prompt).input_ids) < 52:  # then block 5's context is 52 + 1 + 11 = 64, the first of bucket 64-127
        prompt += " x"
    assert len(tok(prompt).input_ids) == 52
    report = evaluate(path, [{"text": prompt}], scripted_proposer(model, lambda i: i % B), block_size=B,
                      layer_ids=LAYER_IDS, max_new_tokens=30, progress=False)
    assert report["acceptance_histogram"] == [3, 3, 3, 3]
    assert report["acceptance_by_position"] == [
        {"position": 1, "accepted": 0.75, "conditional": 0.75},
        {"position": 2, "accepted": 0.5, "conditional": 6 / 9},
        {"position": 3, "accepted": 0.25, "conditional": 0.5},
    ]
    # Block i's context is the prompt, the prefill's token and the n + 1 tokens of each block before it.
    p = len(tok(prompt).input_ids)
    contexts = [p + 1 + sum(k % B + 1 for k in range(i)) for i in range(12)]
    assert contexts[4:6] == [63, 64]
    expected = {}
    for i, c in enumerate(contexts):
        expected.setdefault(context_bucket(c)[0], [0] * B)[i % B] += 1
    assert report["acceptance_by_context"] == acceptance_by_context(expected)
    assert sum(b["blocks"] for b in report["acceptance_by_context"]) == report["verify_forwards"] == 12
    text = summary(report)
    assert "tau 2.500 over 12 blocks" in text and "    1: 0.750 (0.750)" in text
    assert all(f"{b['context']:>11}: {b['tau']:.2f} ({b['blocks']} blocks)" in text
               for b in report["acceptance_by_context"])


def test_offline_acceptance_matches_real_blocks_of_a_fitted_drafter(targets):
    path = targets("qwen3")
    model, tok = load(path)
    runner = TargetRunner(model, LAYER_IDS)
    ids = tok(PROMPTS[1]).input_ids
    response = greedy_generate(runner, ids, 40)[0]
    drafter = random_drafter(path)
    full = ids + response
    row = {k: v.clone() for k, v in response_row(runner.forward(full), full, len(ids)).items()}
    anchors = torch.arange(len(ids), len(full) - 1)[None]
    batch = dict(row, anchors=anchors, anchor_valid=torch.ones_like(anchors, dtype=torch.bool))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(40):  # fit this one response a little: some blocks must accept drafts for the check to bite
        drafter(batch, loss_kind="ce").loss.backward()
        opt.step()
        opt.zero_grad()
    spec = speculative_generate(runner, ids, lambda h, a, _c: drafter.propose(h, a), B, 40)
    assert spec.tokens == response
    assert sum(spec.accepted[:-1]) > 0, "the fitted drafter accepts nothing: the comparison below would be vacuous"
    for a, n in zip(spec.anchors[:-1], spec.accepted[:-1]):
        tau_sum, blocks = offline_tau(runner, drafter, ids, response, anchors=[a])
        assert (tau_sum, blocks) == (n + 1, 1), f"anchor {a}: offline accepts {tau_sum - 1:.0f}, real decoding {n}"


def test_eval_cli_loads_an_export_and_writes_the_report(targets, tmp_path):
    path = targets("qwen3")
    export_drafter(random_drafter(path), str(tmp_path / "export"), verifier=path, dtype=torch.float32)
    data = write_jsonl(
        tmp_path / "prompts.jsonl", [{"conversations": [{"role": "user", "content": t}]} for t in PROMPTS]
    )
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "eval",
                "--target",
                path,
                "--drafter",
                str(tmp_path / "export"),
                "--data",
                str(data),
                "--max-new-tokens",
                "12",
                "--num-prompts",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and report["block_size"] == B and report["layer_ids"] == LAYER_IDS
    assert report["greedy_mismatches"] == 0
    histogram = report["acceptance_histogram"]
    assert sum(histogram) == report["verify_forwards"] > 0
    assert report["tau"] == sum((n + 1) * c for n, c in enumerate(histogram)) / sum(histogram)
    assert report["new_tokens"] == 2 * 12
    blocks, tau_offline = offline_tau_by_hand(path, random_drafter(path), [PROMPTS[0], PROMPTS[1]], 12)
    assert report["offline_blocks"] == blocks and report["tau_offline"] == pytest.approx(tau_offline)
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["target_tokens_per_s"])


def offline_tau_by_hand(path, drafter, prompts, max_new_tokens):
    """spec.md §6 tau_offline of the target's greedy replies, one anchor at a time through `propose`: per
    anchor a of the reply (a + 1 in it), 1 + the leading guesses equal to the reply's next tokens."""
    model, tok = load(path)
    runner = TargetRunner(model, LAYER_IDS)
    total, blocks = 0, 0
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False).input_ids
        full = ids + greedy_generate(runner, ids, max_new_tokens)[0]
        hidden = runner.forward(full).hidden
        for a in range(len(ids), len(full) - 1):
            leading = 0
            for j, guess in enumerate(drafter.propose(hidden[:a], full[a]).tolist(), start=1):
                if a + j >= len(full) or guess != full[a + j]:
                    break
                leading += 1
            total, blocks = total + 1 + leading, blocks + 1
    return blocks, total / blocks


def test_plot_writes_loss_tau_and_per_slot_accuracy(tmp_path):
    records = [
        {"step": s, "split": "train", "loss": 5.0 / s, "tau_offline": 1 + s / 10, "acc": [0.5, 0.3, 0.1]}
        for s in range(1, 6)
    ]
    records += [{"step": 5, "split": "val", "loss": 1.2, "tau_offline": 1.4, "acc_1": 0.4, "acc_2": 0.2, "acc_3": 0.05}]
    lines = [json.dumps(r) for r in records] + ['{"step": 6, "loss": 0.']  # a torn last line is skipped
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    written = plot_run(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["acc.png", "loss.png", "tau_offline.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_any_known_metric_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    with pytest.raises(ValueError, match="no loss, tau_offline or acc_j"):
        plot_run(str(tmp_path))


# ---------------------------------------------------------------- DSpark (spec.md §8): the Markov chain and calibration


def test_confidence_calibration_is_predicted_and_measured_acceptance_over_the_blocks_reaching_each_position(targets):
    """Blocks accept 0, 1, 2, 3, 0, ... drafts; draft j is predicted to be accepted with probability j / 10."""
    path = targets("qwen3")
    model, _ = load(path)
    scripted = scripted_proposer(model, lambda i: i % B)
    propose = lambda h, a, ids: (scripted(h, a, ids), torch.tensor([0.1, 0.2, 0.3]))
    report = evaluate(path, [{"text": PROMPTS[0]}], propose, block_size=B, layer_ids=LAYER_IDS, max_new_tokens=30,
                      progress=False)
    assert report["acceptance_histogram"] == [3, 3, 3, 3]
    calibration = report["confidence_calibration"]
    assert [c["blocks"] for c in calibration] == [12, 9, 6]
    assert [c["measured"] for c in calibration] == [p["conditional"] for p in report["acceptance_by_position"]]
    assert [round(c["predicted"], 6) for c in calibration] == [0.1, 0.2, 0.3]
    assert "    1: 0.100 vs 0.750 (12)" in summary(report)
    assert evaluate(path, [{"text": PROMPTS[0]}], scripted_proposer(model, lambda i: i % B), block_size=B,
                    layer_ids=LAYER_IDS, max_new_tokens=8, progress=False)["confidence_calibration"] is None


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
def test_dspark_decodes_greedy_exact_and_its_markov_chain_accepts_what_training_scores(targets, sample_from_anchor):
    """Real decoding drafts slot k from the token drafted at k - 1; on an accepted prefix those are the
    ground-truth tokens the training forward conditions on, so each block accepts exactly its offline count."""
    path = targets("qwen3")
    model, tok = load(path)
    runner = TargetRunner(model, LAYER_IDS)
    ids = tok(PROMPTS[1]).input_ids
    response = greedy_generate(runner, ids, 40)[0]
    torch.manual_seed(0)
    drafter = build_drafter(path, LAYER_IDS, mask_token_id=0, num_layers=1, block_size=B,
                            sample_from_anchor=sample_from_anchor, markov_rank=8, confidence_head=True).eval()
    full = ids + response
    row = {k: v.clone() for k, v in response_row(runner.forward(full), full, len(ids)).items()}
    anchors = torch.arange(len(ids), len(full) - 2)[None]
    batch = dict(row, anchors=anchors, anchor_valid=torch.ones_like(anchors, dtype=torch.bool))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(40):
        drafter(batch, loss_kind="kl").loss.backward()
        opt.step()
        opt.zero_grad()
    block = B + int(sample_from_anchor)
    spec = speculative_generate(runner, ids, lambda h, a, _c: drafter.propose(h, a, True), block, 40)
    assert spec.tokens == response and len(spec.confidence[0]) == block - 1
    assert sum(spec.accepted[:-1]) > 0, "the fitted drafter accepts nothing: the comparison below would be vacuous"
    for a, n in zip(spec.anchors[:-1], spec.accepted[:-1]):
        tau_sum, blocks = offline_tau(runner, drafter, ids, response, anchors=[a])
        assert (tau_sum, blocks) == (n + 1, 1), f"anchor {a}: offline accepts {tau_sum - 1:.0f}, real decoding {n}"
    report = evaluate(path, [{"text": PROMPTS[1]}], drafter, max_new_tokens=20, progress=False)
    assert report["greedy_mismatches"] == 0 and report["block_size"] == block
    assert len(report["confidence_calibration"]) == block - 1


def test_plot_recipes_draws_real_tau_per_arm_from_compare_recipes_results_or_panels(tmp_path):
    results = {"decay + AdamW": {"0": {"tau": 1.02, "tau_offline": 1.0}, "1": {"tau": 1.04, "tau_offline": 1.0}},
               "D-PACE + Muon": {"0": {"tau": 1.10}, "1": {"tau": 1.20}, "2": {"tau": 1.30}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    [(_, arms)] = read_recipes(str(tmp_path / "results.json"))
    assert [a for a, _ in arms] == ["decay + AdamW", "D-PACE + Muon"]
    assert arms[1][1] == {"mean": pytest.approx(1.2), "min": 1.1, "max": 1.3, "seeds": [1.1, 1.2, 1.3]}
    panels = {"panels": [{"title": "a", "arms": {"x": {"tau": {"mean": 1.5, "std": 0.1, "min": 1.4, "max": 1.6}}}},
                         {"title": "b", "arms": {"y": {"tau": [2.0]}}}]}
    (tmp_path / "panels.json").write_text(json.dumps(panels))
    read = read_recipes(str(tmp_path / "panels.json"))
    assert [(t, a) for t, [(a, _)] in read] == [("a", "x"), ("b", "y")]
    assert read[0][1][0][1] == {"mean": 1.5, "min": 1.4, "max": 1.6, "seeds": None}
    [png] = plot_recipes(str(tmp_path / "panels.json"), str(tmp_path / "img"))
    assert png == str(tmp_path / "img" / "recipes.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_recipes_names_the_file_and_arm_of_a_bad_tau(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"panels": [{"arms": {"decay": {"tau": "1.02"}}}]}))
    with pytest.raises(ValueError, match=r"r.json: 'decay': tau must be a list"):
        read_recipes(str(tmp_path / "r.json"))
    (tmp_path / "l.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"l.json holds a list"):
        read_recipes(str(tmp_path / "l.json"))


def test_plot_takes_a_run_dir_or_recipes_not_both_nor_neither(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps({"a": {"0": {"tau": 1.1}}}))
    assert main(["plot"]) == 2
    assert main(["plot", str(tmp_path), "--recipes", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("error: dflash-fast plot takes RUN_DIR or --recipes RESULTS.json") == 2
    assert main(["plot", "--recipes", str(tmp_path / "r.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "recipes.png").exists()


def test_plot_skips_a_metrics_line_nested_too_deeply_as_it_skips_a_torn_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n' + "[" * 100_000 + "\n" + '{"step": 2, "loss": 1.5}\n')
    assert read_metrics(str(path))["train"]["loss"] == [(1, 2.0), (2, 1.5)]
