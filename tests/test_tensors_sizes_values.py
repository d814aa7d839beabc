"""Drafter weights, sizes and values read from files a user may receive (exports, checkpoints, target configs) or
types (the training config): every tensor checked before use, a size no weight backs refused before anything is
built, a number that means nothing refused by name (dflash_fast/drafter/weights.py: check_tensors;
dflash_fast/drafter/config.py: value_problems)."""
import json
import math
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter import small_config
from test_export import edit_config, make_drafter
from tiny_targets import make_tiny_target

from dflash_fast import cli
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.model import DFlashDrafter, build_drafter
from dflash_fast.drafter.weights import TENSORS_PER_LAYER, trainable_parameters, trainable_shapes
from dflash_fast.evaluate.evaluate import load_drafter
from dflash_fast.serve.export import export_drafter, load_exported
from dflash_fast.serve.layouts import ExportError
from dflash_fast.train.checkpoint import WEIGHTS, CheckpointError, load_drafter_for_export, write_marker, write_weights
from dflash_fast.train.config import ConfigError, load_config


@pytest.fixture()
def spec_export(tmp_path):
    return export_drafter(make_drafter(), str(tmp_path / "export"), "tiny-target", torch.float32)


def edit_weights(path, edit):
    weights = load_file(path)
    edit(weights)
    save_file(weights, path)


def made_checkpoint(root, drafter_config=None, weights=None):
    """A checkpoint as the trainer lays out the files export and eval read (drafter.safetensors and a marker with
    every file's sha256), of make_drafter() unless `drafter_config` (a dict, forged or not) / `weights` are given."""
    d = make_drafter()
    path = os.path.join(str(root), "run", "checkpoints", "step00000001")
    os.makedirs(path)
    save_file(weights if weights is not None else {n: p.detach() for n, p in d.named_parameters()},
              os.path.join(path, WEIGHTS))
    write_marker(path, {"drafter": drafter_config or d.config.to_dict(), "verifier": "tiny-target"})
    return path


# ---------------------------------------------------------------- every tensor checked, none exempt


def test_the_shapes_and_count_computed_from_a_config_are_the_built_drafters():
    cfg = small_config(num_layers=3, layer_types=["full", "sliding", "full"], sliding_window=8)
    built = {n: tuple(p.shape) for n, p in DFlashDrafter(cfg).named_parameters()}
    assert trainable_shapes(cfg) == built and len(built) == TENSORS_PER_LAYER * 3 + 3
    assert trainable_parameters(cfg) == sum(math.prod(s) for s in built.values())


@pytest.mark.parametrize("heads", [dict(markov_rank=8, markov_head_type=kind, confidence_head=True)
                                   for kind in ("vanilla", "gated", "rnn")]
                         + [dict(confidence_head=True, confidence_head_with_markov=False)],
                         ids=["vanilla", "gated", "rnn", "confidence_alone"])
def test_the_shapes_computed_from_a_dspark_config_include_its_heads(heads):
    cfg = small_config(num_layers=1, **heads)
    built = {n: tuple(p.shape) for n, p in DFlashDrafter(cfg).named_parameters()}
    assert trainable_shapes(cfg) == built
    assert trainable_parameters(cfg) == sum(math.prod(s) for s in built.values())


def test_a_non_finite_value_in_any_exported_tensor_is_refused_naming_it(spec_export):
    path = os.path.join(spec_export, "model.safetensors")
    original = load_file(path)
    for name in original:  # fc.weight was exempt
        save_file(dict(original, **{name: original[name].clone().fill_(float("nan"))}), path)
        with pytest.raises(ExportError, match=rf"model\.safetensors .*\n  - {name} holds non-finite values"):
            load_exported(spec_export)


@pytest.mark.parametrize("name", ["fc.weight", "layers.1.mlp.down_proj.weight", "norm.weight"])
def test_an_exported_tensor_of_an_integer_dtype_is_refused_naming_it(spec_export, name):
    edit_weights(os.path.join(spec_export, "model.safetensors"), lambda w: w.update({name: w[name].to(torch.int32)}))
    with pytest.raises(ExportError, match=rf"{name} has dtype I32, not a floating-point weight"):
        load_exported(spec_export)


def test_a_nan_checkpoint_weight_is_refused_by_export_and_eval_naming_file_and_tensor(tmp_path, capsys):
    weights = {n: p.detach().clone() for n, p in make_drafter().named_parameters()}
    weights["fc.weight"][0, 0] = float("nan")
    ckpt = made_checkpoint(tmp_path, weights=weights)
    with pytest.raises(CheckpointError, match=r"drafter\.safetensors:\n  - fc\.weight holds non-finite values"):
        load_drafter_for_export(ckpt)
    with pytest.raises(CheckpointError, match="fc.weight holds non-finite values"):
        load_drafter(ckpt, "never-read-target")  # eval: refused before the target is read
    assert cli.main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "export")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ckpt}/drafter.safetensors:") and "fc.weight holds non-finite values" in err
    assert "Traceback" not in err and not os.path.exists(tmp_path / "export")


def test_an_integer_checkpoint_weight_is_refused_naming_it(tmp_path):
    weights = {n: p.detach().clone() for n, p in make_drafter().named_parameters()}
    weights["hidden_norm.weight"] = weights["hidden_norm.weight"].to(torch.int64)
    with pytest.raises(CheckpointError, match=r"drafter\.safetensors:\n  - hidden_norm\.weight has dtype I64"):
        load_drafter_for_export(made_checkpoint(tmp_path, weights=weights))


def test_a_checkpoint_never_holds_weights_its_readers_would_refuse(tmp_path):
    d = make_drafter()
    weights = {n: p.detach().clone() for n, p in d.named_parameters()}
    weights["layers.0.self_attn.o_proj.weight"][1, 2] = float("inf")
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.o_proj\.weight holds non-finite values"):
        write_weights(str(tmp_path), weights, d.config)
    assert os.listdir(tmp_path) == []


def test_a_weight_of_an_out_of_range_magnitude_loads_with_one_warning_line_naming_file_and_tensor(
    spec_export, capsys
):
    path = os.path.join(spec_export, "model.safetensors")
    edit_weights(path, lambda w: w["layers.0.mlp.up_proj.weight"].__setitem__((0, 0), 3e5))
    drafter = load_exported(spec_export)
    assert drafter.layers[0].mlp.up_proj.weight[0, 0] == 3e5
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: {path}") and "layers.0.mlp.up_proj.weight" in lines[0]


# ---------------------------------------------------------------- sizes no weight backs: refused before building


def quick(fn):
    """fn() within a second or two: a size bomb is refused from the numbers, never allocated."""
    start = time.perf_counter()
    fn()
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "field, value",
    [("intermediate_size", 10**12), ("num_attention_heads", 10**9), ("num_hidden_layers", 10**5)],
)
def test_an_export_config_claiming_sizes_beyond_its_weights_is_refused_with_the_numbers(spec_export, field, value):
    def bomb(c):
        layer = c["transformer_layer_config"]
        layer[field] = value
        if field == "num_hidden_layers":
            layer["layer_types"] = ["full_attention"] * value

    edit_config(spec_export, bomb)
    with pytest.raises(ExportError, match=r"its config implies [\d,]+ trainable parameters in \d+ tensors \(\d+ "
                                          r"layers\) but the file holds 21,728 in 25 tensors: refused before building"):
        quick(lambda: load_exported(spec_export))
    if field == "num_hidden_layers":  # layers the file cannot hold are not even listed (10^6 names)
        with pytest.raises(ExportError, match=r"^[^\n]*$"):
            load_exported(spec_export)


def test_a_forged_checkpoint_marker_claiming_a_huge_drafter_is_refused_with_the_numbers(tmp_path):
    forged = dict(make_drafter().config.to_dict(), intermediate_size=10**12)
    ckpt = made_checkpoint(tmp_path, drafter_config=forged)
    with pytest.raises(CheckpointError, match=r"drafter\.safetensors:\n  - its config implies 192,000,000,[\d,]+ "
                                              r"trainable parameters in 25 tensors \(2 layers\) but the file holds"):
        quick(lambda: load_drafter_for_export(ckpt))


def test_a_target_config_that_implies_a_drafter_larger_than_the_target_is_refused(tmp_path):
    target = make_tiny_target(tmp_path / "target", num_layers=2, hidden_size=32, vocab_size=64)
    config = json.loads(open(os.path.join(target, "config.json")).read())
    config["intermediate_size"] = 10**12
    open(os.path.join(target, "config.json"), "w").write(json.dumps(config))
    with pytest.raises(ValueError, match=r"a drafter of [\d,]+ trainable parameters .*intermediate_size "
                                         r"1000000000000.* is larger than the target, whose safetensors hold [\d,]+"):
        quick(lambda: build_drafter(target, [0, 1], mask_token_id=3, num_layers=1))


def test_a_drafter_takes_no_memory_for_its_frozen_tensors_until_the_target_gives_them():
    d = DFlashDrafter(small_config(vocab_size=10**12, mask_token_id=0))
    assert d.embed_tokens.shape == d.lm_head.shape == (10**12, 32)
    assert d.embed_tokens.untyped_storage().nbytes() < 16
    small = make_drafter()  # set_frozen gave it the target's (here random) tensors
    assert small.embed_tokens.untyped_storage().nbytes() == 96 * 32 * 4 and small.embed_tokens.abs().sum() > 0


def test_more_anchors_than_a_row_can_hold_is_refused():
    with pytest.raises(ConfigError, match=r"data.num_anchors=64 is more than a row of data.seq_len=64 tokens can "
                                          r"hold \(63 anchors"):
        load_config(None, ["data.store=x", "data.seq_len=64", "data.num_anchors=64"])
    assert load_config(None, ["data.store=x", "data.seq_len=64", "data.num_anchors=63"]).data.num_anchors == 63


# ---------------------------------------------------------------- numbers that mean nothing


@pytest.mark.parametrize(
    "edit, error",
    [
        (dict(rope_parameters={"rope_type": "default", "rope_theta": math.inf}), "rope_theta=inf is not a finite"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta=-1.0 is not a number > 0"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": math.nan}), "rope_theta=nan is not a finite"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}),
         r"partial_rotary_factor=0.0 is not a number in \(0, 1\]"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}),
         "factor=-2.0 is not a number > 0"),
        (dict(rms_norm_eps=0.0), r"rms_norm_eps=0.0 is not a number in \(0, 1\)"),
        (dict(rms_norm_eps=math.nan), r"rms_norm_eps=nan is not a number in \(0, 1\)"),
        (dict(block_size=10**6), "block_size=1000000 is beyond 256"),
        (dict(head_dim=0), "head_dim=0 is not an integer >= 1"),
        (dict(max_position_embeddings=-5), "max_position_embeddings=-5 is not an integer >= 1"),
        (dict(layer_types=["full", "sliding"], sliding_window=-3), "sliding_window=-3 is not an integer >= 1"),
    ],
    ids=["theta_inf", "theta_negative", "theta_nan", "partial_zero", "factor_negative", "eps_zero", "eps_nan",
         "block_huge", "head_dim_zero", "positions_negative", "window_negative"],
)
def test_a_drafter_config_value_that_means_nothing_is_refused_by_name(edit, error):
    with pytest.raises(ValueError, match=error):
        DrafterConfig(**dict(small_config().to_dict(), **edit))


def test_an_export_with_a_meaningless_rope_theta_or_eps_is_refused_by_name(spec_export):
    def theta(c):
        c["transformer_layer_config"]["rope_parameters"]["rope_theta"] = -10000.0
        c["transformer_layer_config"]["rope_theta"] = -10000.0

    edit_config(spec_export, theta)
    with pytest.raises(ExportError, match=r"config.json:\n  - rope_parameters.rope_theta=-10000.0 is not a number > 0"):
        load_exported(spec_export)
    edit_config(spec_export, lambda c: c["transformer_layer_config"].update(rms_norm_eps=float("nan")))
    with pytest.raises(ExportError, match=r"rms_norm_eps=nan is not a number in \(0, 1\)"):
        load_exported(spec_export)


def test_a_forged_checkpoint_marker_with_an_infinite_rope_theta_is_refused_by_name(tmp_path):
    forged = make_drafter().config.to_dict()
    forged["rope_parameters"] = dict(forged["rope_parameters"], rope_theta=math.inf)
    with pytest.raises(CheckpointError, match=r"dflash_fast.json: its drafter config .*rope_theta=inf is not"):
        load_drafter_for_export(made_checkpoint(tmp_path, drafter_config=forged))


@pytest.mark.parametrize(
    "override, error",
    [
        ("model.mask_token_id=-1", "model.mask_token_id=-1 must be >= 0"),
        ("model.sliding_window=0", "model.sliding_window=0 must be >= 1"),
        ("model.block_size=100000", "model.block_size=100000 is beyond 256"),
        ("schedule.epochs=-1", "schedule.epochs=-1.0 must be >= 0"),
        ("optimizer.eps=nan", "optimizer.eps=nan is not a finite number"),
    ],
    ids=["mask_negative", "window_zero", "block_huge", "epochs_negative", "eps_nan"],
)
def test_a_training_config_number_that_means_nothing_is_refused_by_name(override, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, ["data.store=x", "data.seq_len=200000", "schedule.steps=5", override])
