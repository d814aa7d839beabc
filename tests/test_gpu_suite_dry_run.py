"""`bash bench/gpu_suite.sh --dry-run` runs every part of the GPU suite on the CPU, so a renamed module, a lost
flag or a bench that stops writing its report fails CI, not the one device run (issue 44). The dry run is
~1.5-3 minutes here (most of it bench_online's three trainers); the broken-suite test runs three parts of a
mutated copy in one call (~20 s)."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(REPO, "bench", "gpu_suite.sh")
sys.path.insert(0, REPO)

from launch_env import launch_env  # noqa: E402

from bench.harness import report_problems  # noqa: E402


def all_parts(suite=SUITE):
    """ALL_PARTS of the suite script, in its order."""
    with open(suite) as f:
        return re.search(r"^ALL_PARTS=\(([^)]*)\)", f.read(), re.M).group(1).split()


def dry_run(suite, results, *parts):
    """Run `suite --dry-run PARTS` into results -> (exit status, output, {part label: verdict})."""
    # The device starts each part from a clean shell: no launcher variables. Tests before this one may have
    # initialised torch.distributed in this process, which sets RANK / MASTER_PORT (its port, still bound here).
    env = launch_env("OUT")
    env.update(PYTHON=sys.executable, RESULTS=str(results))
    proc = subprocess.run(["bash", suite, "--dry-run", *parts], env=env, capture_output=True, text=True,
                          timeout=1500)
    verdicts = {}
    if os.path.exists(os.path.join(results, "summary.md")):
        with open(os.path.join(results, "summary.md")) as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 3 and cells[2].isdigit():
                    verdicts[cells[0]] = cells[1]
    return proc.returncode, proc.stdout + proc.stderr, verdicts


@pytest.fixture(scope="module")
def full_dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("dry") / "gpu-dry"
    return (results, *dry_run(SUITE, results))


def test_headline_parts_run_first():
    """The first ~8 minutes of the device run: our step beside speculators', then the loss and attention kernels."""
    parts = all_parts()
    assert parts[:3] == ["step", "lm_head_loss", "attention"]
    assert len(set(parts)) == len(parts)


def test_readme_gives_every_part_its_cap_and_expected_time():
    with open(os.path.join(REPO, "bench", "README.md")) as f:
        readme = f.read()
    table = {m.group(1): m.group(0) for m in re.finditer(r"^\| \d+ \| `(\w+)` \|.*$", readme, re.M)}
    assert list(table) == all_parts(), "bench/README.md's table of parts must list ALL_PARTS in the suite's order"


@pytest.mark.slow
def test_dry_run_runs_every_part_and_summarises_its_reports(full_dry_run):
    results, rc, output, verdicts = full_dry_run
    assert rc == 0, output[-6000:]
    assert len(verdicts) == len(all_parts()) and set(verdicts.values()) == {"ok"}, verdicts
    reports = sorted(f[:-5] for f in os.listdir(results) if f.endswith(".json"))
    assert reports == ["bench_attention", "extract_smoke", "fc_concat_smoke", "lm_head_dflash2", "lm_head_loss",
                       "online_smoke", "step_kl_lilicorr_smoke", "step_kl_smoke", "step_kl_smollm2-135m_smoke",
                       "step_kl_topk_smoke"]
    assert report_problems(str(results)) == []
    with open(os.path.join(results, "summary.md")) as f:
        summary = f.read()
    for name in reports:  # harness.py's table has a row from every report
        assert f"| {name} |" in summary, name
    for xml in ("pytest_gpu.xml", "pytest_vllm.xml", "pytest_vllm_serve.xml"):
        assert os.path.getsize(os.path.join(results, xml)) > 0, xml
    packed = f"{results}.out"  # OUT's default in a dry run: the device run's packing is exercised too
    (archive,) = [f for f in os.listdir(packed) if f.endswith(".tar.gz")]
    with tarfile.open(os.path.join(packed, archive)) as tar:
        assert f"{results.name}/summary.md" in tar.getnames()
    assert {"summary.md", "suite.log"} <= set(os.listdir(packed))


def broken_copy(root):
    """A copy of bench/ (beside links to tests/ and configs/) with three faults a rename or an edit could bring."""
    shutil.copytree(os.path.join(REPO, "bench"), root / "bench", ignore=shutil.ignore_patterns("results", "wheels"))
    for name in ("tests", "configs"):
        os.symlink(os.path.join(REPO, name), root / name)
    bench = root / "bench"
    # a flag the suite passes (step_topk: --impls triton,eager) renamed in the script
    step = (bench / "bench_step.py").read_text()
    (bench / "bench_step.py").write_text(step.replace('"--impls"', '"--contenders"'))
    # a module a bench imports renamed (attention)
    (bench / "attention_model.py").rename(bench / "attention_model_renamed.py")
    # a bench that exits 0 but no longer writes its report (fc_concat)
    fc = (bench / "bench_fc_concat.py").read_text()
    call = 'print(write_results("fc_concat_smoke" if args.smoke else "fc_concat", rows, args.out))'
    assert call in fc
    (bench / "bench_fc_concat.py").write_text(fc.replace(call, "print(rows)"))
    return str(bench / "gpu_suite.sh")


def test_dry_run_fails_on_a_lost_flag_a_renamed_module_and_a_missing_report(tmp_path):
    suite = broken_copy(tmp_path)
    rc, output, verdicts = dry_run(suite, tmp_path / "results", "step_topk", "attention", "fc_concat")
    assert rc == 1, output[-4000:]
    assert verdicts["bench_step kl_topk"] == "exit 2", verdicts  # argparse: unrecognized arguments
    assert "unrecognized arguments: --impls" in output
    assert verdicts["bench_attention"] == "exit 1", verdicts
    assert "No module named 'bench.attention_model'" in output
    assert verdicts["bench_fc_concat"].startswith("wrote no report"), verdicts


def test_dry_run_fails_on_an_unknown_part(tmp_path):
    rc, output, verdicts = dry_run(SUITE, tmp_path / "results", "no_such_part")
    assert rc == 1 and verdicts == {"no_such_part": "unknown part"}, output[-2000:]


def test_strict_summary_rejects_failed_empty_and_unreadable_reports(tmp_path):
    def write(name, text):
        (tmp_path / name).write_text(text)

    assert report_problems(str(tmp_path)) == [f"no result JSON in {tmp_path}"]
    write("good.json", json.dumps({"rows": [{"impl": "triton", "step_ms": 1.0}]}))
    assert report_problems(str(tmp_path)) == []
    write("peer.json", json.dumps({"rows": [{"impl": "speculators", "note": "failed: TypeError: x\nmore"}]}))
    write("empty.json", json.dumps({"rows": []}))
    write("torn.json", '{"rows": [')
    problems = report_problems(str(tmp_path))
    assert problems[0] == "empty.json: no rows"
    assert problems[1] == "peer.json: row 'speculators' failed: TypeError: x"
    assert problems[2].startswith("torn.json: unreadable")
    assert len(problems) == 3


def test_every_test_file_that_needs_vllm_runs_in_ci_and_in_the_suite():
    """A test file that DFLASH_REQUIRE_VLLM=1 turns from a skip into a failure must be named by .ci/run's vLLM venv
    step and by a vLLM part of the GPU suite, or a new file's tests only ever skip there."""
    tests = os.path.join(REPO, "tests")
    needs_vllm = {f"tests/{name}" for name in os.listdir(tests) if name.endswith(".py")
                  and name != os.path.basename(__file__)
                  and "DFLASH_REQUIRE_VLLM" in open(os.path.join(tests, name)).read()}
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = set(re.findall(r"tests/test_\w+\.py", f.read()))
    with open(SUITE) as f:
        parts = re.findall(r"^\s+vllm\w*\) vllm_part .*$", f.read(), re.M)
    suite = set(re.findall(r"tests/test_\w+\.py", " ".join(parts)))
    assert "tests/test_vllm.py" in needs_vllm
    assert needs_vllm - ci == set() and needs_vllm - suite == set()
