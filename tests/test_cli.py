"""What a user sees when a command fails: one `error: ...` line, exit 2 for usage and 1 for data; the traceback only
with --debug or DFLASH_DEBUG=1, or when the exception is a bug's (dflash_fast/errors.py). Configs that cannot
train are refused at validation, naming the key."""
import os
import subprocess
import sys

import pytest
import torch
from tiny_targets import write_jsonl

from dflash_fast import cli
from dflash_fast.drafter.model import build_drafter
from dflash_fast.evaluate import plot
from dflash_fast.evaluate.quickstart import TARGET
from dflash_fast.serve.export import export_drafter
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.train import trainer
from dflash_fast.train.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, "configs", "tiny.yaml")


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_engine_vllm_without_vllm_installed_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "def f():"}])
    drafter = build_drafter(TARGET, [1, 3, 5], num_layers=1, block_size=4)
    export = export_drafter(drafter, str(tmp_path / "export"), TARGET, torch.float32)
    for argv in (["eval", "--engine", "vllm", "--target", TARGET, "--drafter", export, "--data", str(prompts)],
                 ["regenerate", "--engine", "vllm", "--target", TARGET, "--data", str(prompts), "--out",
                  str(tmp_path / "r.jsonl")]):
        assert cli.main(argv) == 1, argv
        assert "--engine vllm needs vLLM" in one_error_line(capsys.readouterr().err), argv


def test_engine_vllm_on_a_cpu_refuses_a_mixed_drafter_that_its_v1_runner_cannot_serve(tmp_path, capsys):
    drafter = build_drafter(TARGET, [1, 3, 5], num_layers=2, block_size=4, layer_types=["sliding", "full"],
                            sliding_window=8, causal_in_block=[True, False], window_from="query")
    export = export_drafter(drafter, str(tmp_path / "export"), TARGET, torch.float32, fmt="zlab")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "def f():"}])
    assert cli.main(["eval", "--engine", "vllm", "--target", TARGET, "--drafter", export, "--data", str(prompts)]) == 1
    assert "vLLM serves that only with its V2 model runner" in one_error_line(capsys.readouterr().err)


def test_user_errors_of_every_command_end_in_one_error_line_with_exit_1(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "def f():"}])
    missing = str(tmp_path / "missing")
    for argv, message in [
        (["export", "--checkpoint", missing, "--out", str(tmp_path / "e")], "is not a run directory"),
        (["verify", missing], "manifest.json is missing: not a store"),
        (["eval", "--target", missing, "--drafter", missing, "--data", str(prompts)], f"{missing} does not exist"),
        (["regenerate", "--target", missing, "--data", str(prompts), "--out", str(tmp_path / "r.jsonl")], "not exist"),
        (["extract", "--target", TARGET, "--data", missing, "--out", str(tmp_path / "s")], "No such file"),
        (["plot", missing], "metrics.jsonl"),
    ]:
        assert cli.main(argv) == 1, argv
        assert message in one_error_line(capsys.readouterr().err), argv


def open_store_only(cfg, _device_memory=None, _real_acceptance=None):
    """trainer.train as far as its first data error: the store (no process group, no DeepSpeed engine)."""
    HiddenStateStore(cfg.data.store)


def test_train_py_ends_a_data_error_in_one_line_exit_1_and_a_config_error_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trainer, "train", open_store_only)
    with pytest.raises(SystemExit) as stop:
        trainer.main(["--config", TINY_YAML, f"data.store={tmp_path / 'nope'}", f"output_dir={tmp_path / 'run'}"])
    assert stop.value.code == 1
    assert "manifest.json is missing: not a store" in one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as stop:
        trainer.main(["--config", TINY_YAML, "optimizer.lr=inf"])
    assert stop.value.code == 2
    assert one_error_line(capsys.readouterr().err) == "error: optimizer.lr=inf is not a finite number\n"


def test_debug_flag_or_environment_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "train", open_store_only)
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not a store"):
        cli.main(["--debug", "verify", missing])
    with pytest.raises(FileNotFoundError, match="not a store"):
        cli.main(["verify", missing, "--debug"])
    with pytest.raises(FileNotFoundError, match="not a store"):
        trainer.main(["--config", TINY_YAML, f"data.store={missing}", "--debug"])
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="not a store"):
        cli.main(["verify", missing])


def test_an_exception_that_is_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(_args):
        raise TypeError("a bug, not a user error")

    monkeypatch.setattr(plot, "run", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["plot", str(tmp_path)])


def test_a_real_process_prints_only_the_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_fast.cli", "verify", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: {tmp_path / 'missing' / 'manifest.json'} is missing: not a store\n"


def test_an_eval_prompt_holding_a_lone_surrogate_is_named_by_file_and_line(tmp_path, capsys):
    torch.manual_seed(0)
    drafter = build_drafter(TARGET, [1, 3, 5], num_layers=1, block_size=4)
    export_drafter(drafter, str(tmp_path / "export"), verifier=TARGET, dtype=torch.float32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "def f():"}\n{"text": "x = \\ud800"}\n')
    argv = ["eval", "--target", TARGET, "--drafter", str(tmp_path / "export"), "--data", str(prompts)]
    assert cli.main(argv) == 1
    want = f"error: {prompts}:2: 'text' holds a lone surrogate U+D800 at character 4, which is not Unicode text\n"
    assert one_error_line(capsys.readouterr().err) == want


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=inf", "optimizer.lr=inf is not a finite number"),
        ("optimizer.lr=nan", "optimizer.lr=nan is not a finite number"),
        ("optimizer.betas=[0.9,inf]", r"optimizer.betas\[1\]=inf is not a finite number"),
        ("schedule.epochs=inf", "schedule.epochs=inf is not a finite number"),
        ("data.noise_std=inf", "data.noise_std=inf is not a finite number"),
        ("data.seq_len=7", r"data.seq_len=7 cannot hold one anchor and its block of model.block_size=8 tokens"),
        ("model.window_from=slot", r"model.window_from='slot' is not one of \('anchor', 'query'\)"),
        ("model.layer_types=[sliding,sliding,sliding] model.sliding_window=5 model.window_from=query",
         r"model.window_from=query needs model.sliding_window >= model.block_size .*: got 5 < 8"),
    ],
)
def test_configs_that_cannot_train_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_YAML, override.split())


def test_the_shortest_row_that_holds_a_block_is_accepted():
    # tiny.yaml: model.block_size 8; a row of 8 tokens holds at most 7 anchors
    assert load_config(TINY_YAML, ["data.seq_len=8", "data.num_anchors=7"]).data.seq_len == 8


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "does not exist"),
        ("model: [1\n", "is not valid YAML"),
        ("- model\n", "holds a list, not a mapping of sections"),
    ],
)
def test_a_config_file_that_cannot_be_read_is_a_config_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path} {message}"):
        load_config(str(path))


def test_an_empty_config_file_is_all_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(str(path), ["data.store=/x"]) == load_config(None, ["data.store=/x"])
