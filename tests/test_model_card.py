"""`dflash-fast export` writes a model card, README.md: hub front matter, the target, the drafter, its data and recipe,
the steps, the serving commands, and the benchmark table of `--card-from eval.json`; every reader of an export
takes an export that holds it."""
import json
import os

import pytest
import torch
import yaml
from safetensors.torch import save_file
from test_export import make_drafter

from dflash_fast import cli
from dflash_fast.serve.export import export_drafter, load_exported
from dflash_fast.train.checkpoint import WEIGHTS, write_marker
from dflash_fast.train.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = {"tau": 3.25, "tau_offline": 3.5, "tokens_per_s": 120.0, "target_tokens_per_s": 50.0, "speedup": 2.4,
          "prompts": 8, "max_new_tokens": 64, "engine": "hf", "per_prompt": []}


def checkpoint(root, target="Qwen/Qwen3-8B", provenance=True):
    """A run directory as the trainer leaves it: a checkpoint at step 7 of configs/tiny.yaml's recipe, and
    OUT/provenance.json naming a hub dataset."""
    d = make_drafter()
    run = os.path.join(str(root), "run")
    path = os.path.join(run, "checkpoints", "step00000007")
    os.makedirs(path)
    save_file({n: p.detach() for n, p in d.named_parameters()}, os.path.join(path, WEIGHTS))
    config = load_config(os.path.join(REPO, "configs", "tiny.yaml")).to_dict()
    write_marker(path, {"drafter": d.config.to_dict(), "verifier": target, "step": 7, "loss_kind": "kl",
                        "config": config})
    if provenance:
        with open(os.path.join(run, "provenance.json"), "w") as f:
            json.dump({"config": config, "code": {"git": {"commit": "abc123", "dirty": False}},
                       "data": {"data": "HuggingFaceH4/ultrachat_200k", "data_sha256": "f00d"}}, f)
    return run, d


def front_matter(text):
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.mark.parametrize("fmt", ["speculators", "zlab"])
def test_export_writes_a_card_with_the_recipe_serving_commands_and_the_eval_table(fmt, tmp_path, capsys):
    run, d = checkpoint(tmp_path)
    report = tmp_path / "eval.json"
    report.write_text(json.dumps(REPORT))
    out = str(tmp_path / "export")
    assert cli.main(["export", "--checkpoint", run, "--out", out, "--format", fmt, "--dtype", "fp32",
                     "--card-from", str(report)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    card = open(os.path.join(out, "README.md")).read()
    meta = front_matter(card)
    assert meta["base_model"] == ["Qwen/Qwen3-8B"] and meta["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    assert "dflash" in meta["tags"] and "speculative-decoding" in meta["tags"]
    cfg = d.config
    for fact in (f"| block size | {cfg.block_size} |", f"| layers | {cfg.num_layers} |", f"| layout | `{fmt}` |",
                 "| target layer ids | " + ", ".join(map(str, cfg.layer_ids)) + " |", "| steps | 7 |",
                 "| loss | kl, weighting dpace |", "| data sha256 | `f00d` |", "| dflash-fast commit | `abc123` |",
                 f'vllm serve Qwen/Qwen3-8B --speculative-config \'{{"method": "dflash", "model": "{out}", '
                 f'"num_speculative_tokens": {cfg.block_size - 1}}}\'',
                 "| 3.250 | 3.500 | 120.0 | 50.0 | 2.40 |", "on 8 prompts, 64 new tokens each (hf)"):
        assert fact in card, fact
    sglang = f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {cfg.block_size}"
    assert (sglang in card) == (fmt == "zlab")
    back = load_exported(out)
    for (name, p), (_, q) in zip(d.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name


def test_an_export_with_its_card_is_replaced_by_the_next_export(tmp_path):
    out = str(tmp_path / "export")
    export_drafter(make_drafter(), out, "t", torch.float32, card="# a card\n")
    export_drafter(make_drafter(seed=1), out, "t", torch.float32, card="# the next card\n")
    assert open(os.path.join(out, "README.md")).read() == "# the next card\n"
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_a_local_target_and_data_stay_out_of_the_hub_metadata_and_a_run_without_provenance_still_has_a_card(
        tmp_path, capsys):
    run, _ = checkpoint(tmp_path, target=str(tmp_path), provenance=False)
    out = str(tmp_path / "export")
    assert cli.main(["export", "--checkpoint", run, "--out", out, "--dtype", "fp32"]) == 0
    capsys.readouterr()
    card = open(os.path.join(out, "README.md")).read()
    meta = front_matter(card)
    assert "base_model" not in meta and "datasets" not in meta
    assert "| steps | 7 |" in card and "## Benchmark" not in card


def test_a_bad_eval_report_is_refused_naming_the_field_before_anything_is_written(tmp_path, capsys):
    run, _ = checkpoint(tmp_path)
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"tau": "3.2"}))
    out = str(tmp_path / "export")
    assert cli.main(["export", "--checkpoint", run, "--out", out, "--card-from", str(report)]) == 1
    assert "tau" in capsys.readouterr().err and not os.path.exists(out)


@pytest.mark.parametrize("source, extraction, config_reasoning, line", [
    ("store", {"reasoning": "mask"}, "train", "| reasoning | `mask`: the reasoning stayed in the context without"),
    ("store", {}, "drop", "| reasoning | not recorded (a store extracted before dflash-fast recorded it"),
    ("online", {}, "drop", "| reasoning | `drop`: the reasoning was removed"),
])
def test_the_card_states_how_the_data_treated_reasoning(tmp_path, capsys, source, extraction, config_reasoning, line):
    """The store's extract --reasoning (data.reasoning of a config is not what a store was extracted with), or
    data.reasoning for online rows, as OUT/provenance.json records it (trackers.provenance)."""
    from dflash_fast.train.trackers import provenance

    run, _ = checkpoint(tmp_path)
    config = load_config(os.path.join(REPO, "configs", "tiny.yaml")).to_dict()
    config["data"].update(source=source, reasoning=config_reasoning)
    record = provenance(config, {"extraction": extraction}, {}, 0, 1)
    with open(os.path.join(run, "provenance.json"), "w") as f:
        json.dump(record, f)
    out = str(tmp_path / "export")
    assert cli.main(["export", "--checkpoint", run, "--out", out, "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert line in open(os.path.join(out, "README.md")).read()


@pytest.mark.parametrize("options,fmt,title,method,tokens,sglang,note", [
    ({}, "zlab", "DFlash", "dflash", 7, True, None),
    ({}, "speculators", "DFlash", "dflash", 7, False, "SGLang reads the zlab layout"),
    (dict(markov_rank=8, sample_from_anchor=True), "speculators", "DSpark", "dspark", 8, False,
     "Only vLLM serves DSpark (its DSparkDraftModel, V2 model runner)"),
    (dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4), "zlab", "DFlash2", "dflash", 7,
     True, None),
    (dict(lilicorr_candidate_topk=4, lilicorr_hidden_size=16, lilicorr_num_heads=2), "zlab", "LiLiCorr", "dflash", 7,
     False, "Only vLLM serves LiLiCorr (its LiLiCorrDraftModel, V2 model runner)"),
])
def test_the_cards_family_and_serving_commands_are_its_serving_homes(options, fmt, title, method, tokens, sglang,
                                                                     note):
    """Each family's title, vLLM method and drafted tokens (a DSpark drafter sampling from the anchor drafts the whole
    block: vLLM's `dspark` method), and SGLang's command only where SGLang reads the export."""
    from dflash_fast.serve.model_card import model_card

    cfg = make_drafter(block_size=8, **options).config
    card = model_card(cfg, "Qwen/Qwen3-8B", fmt, "/exports/d")
    assert card.splitlines()[[line.startswith("# ") for line in card.splitlines()].index(True)].startswith(
        f"# {title}")
    spec = json.loads(card.split("--speculative-config '")[1].split("'")[0])
    assert (spec["method"], spec["num_speculative_tokens"]) == (method, tokens)
    assert ("sglang.launch_server" in card) == sglang
    assert note is None or note in card
