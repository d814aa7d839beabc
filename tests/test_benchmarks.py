"""`dflash-fast eval --benchmark`: each public benchmark read in its dataset's own columns (tiny made-up files in
tests/fixtures/benchmarks, nothing downloaded) and rendered as z-lab's benchmark renders it; mt-bench's second turn
asked after the target's own first answer; --thinking reaching the chat template; both tau definitions; the
published-table layout; one end-to-end run of two benchmarks on the embedded target; `plot --benchmarks`."""
import json
import os
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from tiny_targets import HARMONY_TEMPLATE
from transformers import AutoTokenizer

import dflash_fast
from dflash_fast.cli import main
from dflash_fast.drafter.model import build_drafter
from dflash_fast.evaluate.benchmarks import (
    BENCHMARKS,
    benchmark_name,
    decode_suite,
    load_suites,
    markdown_table,
    read_rows,
    render,
)
from dflash_fast.evaluate.decode import SpecResult
from dflash_fast.evaluate.plot import plot_benchmarks
from dflash_fast.evaluate.report import Tally, cut_acceptance_lengths, tau_zlab
from dflash_fast.serve.export import export_drafter
from dflash_fast.target.prompts import Prompt, encode_prompt

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "benchmarks"
TARGET = str(Path(dflash_fast.__file__).resolve().parent / "assets" / "target")
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# the first record of each fixture file, rendered: z-lab dflash 0.1.0 benchmark.py's formats (gsm8k, math500,
# humaneval, mbpp, mt-bench), SpecForge's (aime, livecodebench, alpaca), the dataset's own turns (arena-hard,
# SPEED-Bench)
EXPECTED = {
    "gsm8k": ["Ann has 3 apples and buys 4 more. How many apples does she have?" + BOXED],
    "math500": ["What is $2^{10}$?" + BOXED],
    "aime": ["Find the remainder when $7^{100}$ is divided by $1000$." + BOXED],
    "humaneval": ["Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
                  "def add(a: int, b: int) -> int:\n    \"\"\"Return a + b.\"\"\"\n\n```"],
    "mbpp": ["Write a function to find the shared elements of two lists."],
    "livecodebench": ["Given two integers A and B, print A + B.\n\nInput\nA B"],
    "mt-bench": ["Write a short poem about the sea.", "Now rewrite it so every line starts with the letter S."],
    "alpaca": ["### Instruction:\nGive three tips for staying healthy.\n\n### Response:"],
    "arena-hard": ["Write a Python one-liner that reverses a string."],
    "speed-bench": ["Explain what a Python list comprehension is."],
}


def test_every_benchmark_of_the_table_has_a_fixture_and_renders_its_first_record_as_published():
    assert set(EXPECTED) == set(BENCHMARKS)
    for name in BENCHMARKS:
        where, record = read_rows(str(FIXTURES / f"{name}.jsonl"))[0]
        assert render(name, where, record) == EXPECTED[name], name
        assert all(c in record for c in BENCHMARKS[name].columns[:1]), f"{name}: the fixture lacks its column"


def test_alternative_columns_and_inputs_render_too():
    assert render("alpaca", "x", {"instruction": "Translate.", "input": "Good morning."}) == [
        "### Instruction:\nTranslate.\n\n### Input:\nGood morning.\n\n### Response:"]
    # arena-hard v0.1 (turns of {content}), FastChat's mt-bench (turns), mbpp's full config (text), AIME 2024 (Problem)
    assert render("arena-hard", "x", {"question_id": "q", "turns": [{"content": "Hi?"}]}) == ["Hi?"]
    assert render("mt-bench", "x", {"question_id": 81, "turns": ["a", "b"]}) == ["a", "b"]
    assert render("mbpp", "x", {"task_id": 1, "text": "Write f."}) == ["Write f."]
    assert render("aime", "x", {"ID": "2024-I-1", "Problem": "P?"}) == ["P?" + BOXED]


def test_a_record_without_the_columns_names_file_line_and_columns():
    with pytest.raises(ValueError, match=r"f.jsonl:3: not a gsm8k record: has none of the columns question .*"
                                         r"public dataset's columns \(question\)"):
        render("gsm8k", "f.jsonl:3", {"problem": "2+2?"})
    with pytest.raises(ValueError, match=r"f.jsonl:1: not a mt-bench record: prompt must be a string or a non-empty"):
        render("mt-bench", "f.jsonl:1", {"prompt": []})


def test_names_aliases_and_unknown_names():
    assert [benchmark_name(n) for n in ("MT_Bench", "mtbench", "SPEED-Bench", "aime25", "arena-hard-v2")] == [
        "mt-bench", "mt-bench", "speed-bench", "aime", "arena-hard"]
    with pytest.raises(ValueError, match="--benchmark gsm9k: unknown benchmark; known: gsm8k, math500"):
        benchmark_name("gsm9k")


def test_suites_read_from_a_dir_or_a_path_and_subset_as_z_lab_does(tmp_path):
    rows = [{"question": f"q{i}"} for i in range(10)]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    suites = load_suites(f"gsm8k={tmp_path / 'g.jsonl'},mt_bench", str(FIXTURES), num_prompts=3)
    assert [s.name for s in suites] == ["gsm8k", "mt-bench"]
    order = list(range(10))
    random.Random(42).shuffle(order)  # z-lab benchmark.py's _select_dataset
    assert [c[0] for c in suites[0].conversations] == [f"q{i}" + BOXED for i in order[:3]]
    assert suites[0].max_new_tokens == 2048 and len(suites[1].conversations) == 2
    with pytest.raises(FileNotFoundError, match=r"--benchmark alpaca: none of alpaca.jsonl, alpaca.parquet in .*; "
                                                r"download tatsu-lab/alpaca split train there"):
        load_suites("alpaca", str(tmp_path))
    with pytest.raises(ValueError, match="give its file as gsm8k=PATH or a --benchmark-dir"):
        load_suites("gsm8k")


def test_parquet_rows_are_read_through_pyarrow_and_without_it_one_error_line(tmp_path, monkeypatch):
    path = str(tmp_path / "gsm8k.parquet")
    open(path, "wb").close()  # the stand-in pyarrow below reads no bytes
    table = types.SimpleNamespace(to_pylist=lambda: [{"question": "Q?", "answer": "#### 1"}])
    parquet = types.ModuleType("pyarrow.parquet")
    parquet.read_table = lambda p: table if p == path else None
    monkeypatch.setitem(sys.modules, "pyarrow", types.ModuleType("pyarrow"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    assert load_suites("gsm8k", str(tmp_path))[0].conversations == [["Q?" + BOXED]]
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # not installed
    monkeypatch.delitem(sys.modules, "pyarrow.parquet")
    with pytest.raises(RuntimeError, match=r"gsm8k.parquet: reading parquet needs pyarrow \(pip install pyarrow\), "
                                           r"or convert the file to JSONL"):
        load_suites(f"gsm8k={path}")


def test_the_second_mt_bench_turn_follows_the_targets_own_first_answer():
    suite = load_suites("mt-bench,speed-bench", str(FIXTURES))
    seen = []

    def encode(prompt):
        seen.append(prompt.messages)
        return [len(seen)]

    def decode(encoded, budget, tally):
        assert budget == 2048
        for ids in encoded:  # the "answer" to prompt k is token 100 + k
            tally.add_speculative(SpecResult([100 + ids[0]], [0], [5], 0, 0.0))

    tally = decode_suite(suite[0], 4, encode, decode, lambda tokens: f"answer {tokens[0]}")
    assert len(tally.results) == 4
    first = {m[0]["content"]: m for m in seen[:2]}
    poem = first["Write a short poem about the sea."]
    second = next(m for m in seen[2:] if m[0] == poem[0])
    k = seen.index(poem) + 1
    assert second == [poem[0], {"role": "assistant", "content": f"answer {100 + k}"},
                      {"role": "user", "content": "Now rewrite it so every line starts with the letter S."}]
    seen.clear()
    decode_suite(suite[1], 4, encode, decode, lambda _tokens: "a")  # one single-turn and one two-turn record
    assert [len(m) for m in seen] == [1, 1, 3]


QWEN3_THINKING = (  # Qwen3's switch as its template writes it: thinking off -> an empty think block is prefilled
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_thinking_on_and_off_reach_the_chat_templates_switch():
    tokenizer = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    prompt = Prompt(0, {}, messages=[{"role": "user", "content": "def f():"}])

    def text(thinking):
        return tokenizer.decode(encode_prompt(tokenizer, prompt, thinking))

    tokenizer.chat_template = QWEN3_THINKING
    assert text(False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert text(True).endswith("assistant\n") and text(None) == text(True)
    tokenizer.chat_template = HARMONY_TEMPLATE  # gpt-oss: reasoning effort high / low
    assert "Reasoning: high" in text(True) and "Reasoning: low" in text(False) and "Reasoning: medium" in text(None)
    with pytest.raises(ValueError, match="a {'text': ...} prompt has no template"):
        encode_prompt(tokenizer, Prompt(0, {}, text="x = 1"), True)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="--thinking on: the target's chat template has no thinking switch"):
        text(True)
    assert text(None) == "def f():"


def spec(tokens, accepted, first_anchor=10):
    anchors, a = [], first_anchor
    for n in accepted:
        anchors.append(a)
        a += n + 1
    return SpecResult(tokens, accepted, anchors, 0, 0.0)


def test_tau_zlab_cuts_blocks_at_the_stop_token_and_limit_and_averages_per_prompt():
    # 1 + 4 + 2 + 4 = 11 tokens decoded (the first from the prefill), the output cut to 8: the last block counts 1
    assert cut_acceptance_lengths(spec(list(range(8)), [3, 1, 3])) == [4, 2, 1]
    assert cut_acceptance_lengths(spec(list(range(5)), [3])) == [4]
    prompts = [spec(list(range(8)), [3, 1, 3]), spec(list(range(3)), [1]), spec([7], [])]
    tally = Tally(4)
    for s in prompts:
        tally.add_speculative(s)
    assert tau_zlab(prompts) == pytest.approx(((4 + 2 + 1) / 3 + 2) / 2)  # the prompt without blocks is left out
    pooled = (4 + 2 + 4 + 2) / 4
    assert sum((n + 1) * c for n, c in enumerate(tally.histogram)) / sum(tally.histogram) == pooled


def test_the_markdown_table_has_benchmarks_as_columns():
    rows = [{"benchmark": "gsm8k", "tau": 3.5, "tau_zlab": 3.25, "prompts": 2, "turns": 2,
             "acceptance_by_position": [{"accepted": 0.75}, {"accepted": 0.5}]},
            {"benchmark": "mt-bench", "tau": None, "tau_zlab": None, "prompts": 1, "turns": 2,
             "acceptance_by_position": [{"accepted": None}, {"accepted": None}]}]
    assert markdown_table({"benchmarks": rows}).splitlines() == [
        "| | gsm8k | mt-bench |",
        "| --- | ---: | ---: |",
        "| tau (pooled) | 3.50 | - |",
        "| tau_zlab (per-prompt mean, cut) | 3.25 | - |",
        "| accepted @1 | 0.750 | - |",
        "| accepted @2 | 0.500 | - |",
        "| prompts (turns) | 2 (2) | 1 (2) |",
    ]


def test_eval_two_benchmarks_on_the_embedded_target_then_plot_them(tmp_path, capsys):
    torch.manual_seed(0)
    drafter = build_drafter(TARGET, [1, 3, 5], mask_token_id=3, num_layers=1, block_size=4).eval()
    export_drafter(drafter, str(tmp_path / "export"), verifier=TARGET, dtype=torch.float32)
    out = tmp_path / "bench.json"
    argv = ["eval", "--target", TARGET, "--drafter", str(tmp_path / "export"), "--benchmark", "gsm8k,mt-bench",
            "--benchmark-dir", str(FIXTURES), "--num-prompts", "1", "--max-new-tokens", "4", "--no-offline",
            "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["tau_definitions"]) == {"tau", "tau_zlab"} and report["block_size"] == 4
    gsm8k, mt = report["benchmarks"]
    assert (gsm8k["benchmark"], gsm8k["prompts"], gsm8k["turns"]) == ("gsm8k", 1, 1)
    assert (mt["benchmark"], mt["prompts"], mt["turns"]) == ("mt-bench", 1, 2)  # both turns of the one conversation
    assert (gsm8k["dataset"], mt["dataset"], mt["rendering"]) == ("openai/gsm8k", "HuggingFaceH4/mt_bench_prompts",
                                                                  "z-lab (both turns)")
    for row in (gsm8k, mt):
        assert row["greedy_mismatches"] == 0 and row["max_new_tokens"] == 4
        assert row["tau"] is not None and row["tau_zlab"] is not None and len(row["acceptance_by_position"]) == 3
        assert all(len(p["tokens"]) <= 4 for p in row["per_prompt"])
    assert (tmp_path / "bench.md").read_text() == report["table"] + "\n"
    assert "| | gsm8k | mt-bench |" in capsys.readouterr().err

    assert plot_benchmarks([str(out)]) == [str(tmp_path / "benchmarks.png")]
    assert os.path.getsize(tmp_path / "benchmarks.png") > 0
    assert main(["plot", "--benchmarks", str(out), str(out), "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "benchmarks.png").exists()


def test_eval_flags_data_or_benchmark_and_thinking_on_a_template_without_a_switch(tmp_path, capsys):
    base = ["eval", "--target", TARGET, "--drafter", str(tmp_path)]
    assert main(base) == 2
    assert main(base + ["--data", "x.jsonl", "--benchmark", "gsm8k"]) == 2
    err = capsys.readouterr().err
    assert err.count("error: dflash-fast eval takes --data PROMPTS.jsonl or --benchmark NAME,...") == 2
    (tmp_path / "r.json").write_text(json.dumps({"tau": 2.0}))
    assert main(["plot", "--benchmarks", str(tmp_path / "r.json")]) == 1
    assert "no \"benchmarks\" rows" in capsys.readouterr().err


def test_engine_vllm_asks_the_same_benchmark_prompts_turn_by_turn_with_the_thinking_switch_and_budgets(
        tmp_path, monkeypatch):
    """`eval --engine vllm --benchmark`, vLLM replaced by a recorder (tests/test_vllm_eval.py runs the real one): the
    prompts it is asked are our encoder's (the thinking switch set through the template), mt-bench's second turn after
    vLLM's own first answer, each benchmark at its budget; the plain engine is asked exactly the same prompts; one row
    per benchmark, the markdown beside the JSON."""
    import shutil

    from dflash_fast.evaluate import vllm as vllm_engine

    target = tmp_path / "target"
    shutil.copytree(TARGET, target)
    (target / "chat_template.jinja").write_text(QWEN3_THINKING)
    tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    torch.manual_seed(0)
    drafter = build_drafter(TARGET, [1, 3, 5], mask_token_id=3, num_layers=1, block_size=4).eval()
    export_drafter(drafter, str(tmp_path / "export"), verifier=TARGET, dtype=torch.float32)
    asked = []

    def generate(llm, encoded, budget, _eos, _temperature=0.0, _top_p=1.0):
        asked.append((llm, [tokenizer.decode(ids) for ids in encoded], budget))
        answer = tokenizer.encode(" the answer", add_special_tokens=False)
        metrics = types.SimpleNamespace(per_step_accepted=[1, 0])
        return ([types.SimpleNamespace(outputs=[types.SimpleNamespace(spec_decode_metrics=metrics)])] * len(encoded),
                [list(answer) for _ in encoded])

    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: types.SimpleNamespace(__version__="0.0-recorder"))
    monkeypatch.setattr(vllm_engine, "load_engine", lambda _t, speculative, _d, _c, _r, seed: (
        "spec" if speculative else "plain", seed))
    monkeypatch.setattr(vllm_engine, "generate", generate)
    out = tmp_path / "bench.json"
    assert main(["eval", "--engine", "vllm", "--target", str(target), "--drafter", str(tmp_path / "export"),
                 "--benchmark", "gsm8k,mt-bench", "--benchmark-dir", str(FIXTURES), "--num-prompts", "1",
                 "--thinking", "off", "--seed", "7", "--out", str(out)]) == 0
    spec = [a for a in asked if a[0] == ("spec", 7)]
    assert [a[1:] for a in asked if a[0] == ("plain", 7)] == [a[1:] for a in spec], "the plain engine asked the same"
    assert [(len(p), budget) for _, p, budget in spec] == [(1, 2048)] * 3
    gsm8k, mt_first, mt_second = (p[0] for _, p, _ in spec)
    assert gsm8k.endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    poem = load_suites("mt-bench", str(FIXTURES), 1)[0].conversations[0]
    assert poem[0] in mt_first and poem[1] not in mt_first
    assert mt_second.endswith(f"{poem[0]}<|im_end|>\n<|im_start|>assistant\n the answer<|im_end|>\n<|im_start|>user\n"
                              f"{poem[1]}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    report = json.loads(out.read_text())
    assert report["engine"] == "vllm 0.0-recorder" and report["thinking"] == "off" and report["block_size"] == 4
    assert [(r["benchmark"], r["turns"], r["tau"], r["greedy_mismatches"]) for r in report["benchmarks"]] == [
        ("gsm8k", 1, 1.5, 0), ("mt-bench", 2, 1.5, 0)]
    assert (tmp_path / "bench.md").read_text() == report["table"] + "\n"


def sampled_report(accept_rate, runs, blocks=12, positions=3, seed=0):
    """A made-up report of `runs` sampled runs whose blocks accept each next draft with probability accept_rate."""
    gen = random.Random(seed)
    per_prompt = []
    for _ in range(runs):
        accepted = []
        for _ in range(blocks):
            n = 0
            while n < positions and gen.random() < accept_rate:
                n += 1
            accepted.append(n)
        per_prompt.append({"accepted": accepted, "tau": 1 + sum(accepted) / blocks, "tokens": [gen.random()]})
    return {"per_prompt": per_prompt, "acceptance_by_position": [{}] * positions, "tau": None, "temperature": 1.0}


def test_engine_agreement_at_t1_holds_for_one_distribution_and_fails_for_a_shifted_one():
    """The statistical tolerance of `--engine both --temperature 1` (evaluate/vllm.py agreement): two reports drawn
    from one acceptance distribution agree (20 pairs of seeds, each a 4-sigma test per compared mean), one whose
    acceptance rate moved from 0.5 to 0.65 does not."""
    from dflash_fast.evaluate.vllm import agreement, two_sample

    for seed in range(20):
        same = agreement(sampled_report(0.5, 48, seed=seed), sampled_report(0.5, 48, seed=100 + seed))
        assert same["agree"] and set(same["compared"]) == {"new_tokens", "tau", "accepted@1", "accepted@2",
                                                           "accepted@3"}, seed
    shifted = agreement(sampled_report(0.5, 48), sampled_report(0.65, 48, seed=1))
    assert shifted["agree"] is False and shifted["compared"]["tau"]["z"] > 4
    assert two_sample([1.0, 1.0], [1.0, 1.0])["z"] == 0 and two_sample([1.0, 1.0], [2.0, 2.0])["z"] == float("inf")
    assert agreement(sampled_report(0.5, 1), sampled_report(0.5, 1))["agree"] is None, "one run has no spread"
    few = agreement(sampled_report(0.5, 9), sampled_report(0.9, 9, seed=1))
    assert few["agree"] is None and few["compared"]["tau"]["z"] > 4, "9 runs: the means reported, no verdict"
    # `--engine both --benchmark` at T > 0: each benchmark row compared (the temperature is the run's, not the row's)
    from dflash_fast.evaluate.vllm import side_by_side

    def run(*rows):
        return {"temperature": 1.0, "benchmarks": [dict(r, benchmark=f"b{i}", temperature=None)
                                                    for i, r in enumerate(rows)]}

    rows = side_by_side(run(sampled_report(0.5, 48), sampled_report(0.5, 48, seed=2)),
                        run(sampled_report(0.5, 48, seed=1), sampled_report(0.65, 48, seed=3)))["benchmarks"]
    assert [(r["benchmark"], r["agreement"]["agree"]) for r in rows] == [("b0", True), ("b1", False)]


def test_the_side_by_side_table_holds_ours_then_vllms_value_in_each_cell():
    ours = {"benchmarks": [{"benchmark": "gsm8k", "tau": 2.5, "tau_zlab": 2.25, "prompts": 1, "turns": 1,
                            "acceptance_by_position": [{"accepted": 0.75}]}]}
    vllm = {"benchmarks": [dict(ours["benchmarks"][0], tau=2.0, acceptance_by_position=[{"accepted": 0.5}])]}
    assert markdown_table(ours, vllm).splitlines()[2:] == [
        "| tau (pooled) | 2.50 / 2.00 |",
        "| tau_zlab (per-prompt mean, cut) | 2.25 / 2.25 |",
        "| accepted @1 | 0.750 / 0.500 |",
        "| prompts (turns) | 1 (1) / 1 (1) |",
    ]
