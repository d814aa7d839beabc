"""The z-lab layout is served by readers that tap and scale differently from dflash-fast in two places: layer id
L-1 (z-lab reads HF's hidden_states[L], after the final norm; SGLang never captures it) and z-lab's scaling keys
(input_embedding_scale, output_multiplier, final_logit_softcapping). Export refuses the first, reading refuses the
second, each naming what it refuses."""
import os
import shutil

import pytest
import torch
from test_export import edit_config, make_drafter, written_config

from dflash_fast.serve.export import export_drafter, load_exported
from dflash_fast.serve.layouts import ExportError


def test_a_zlab_export_of_a_drafter_tapping_the_last_layer_is_refused_naming_the_layer(tmp_path):
    drafter = make_drafter(layer_ids=[0, 3], target_num_layers=4)
    with pytest.raises(ExportError) as e:
        export_drafter(drafter, str(tmp_path / "zlab"), "tiny-target", torch.float32, fmt="zlab")
    assert "the zlab format cannot serve this drafter as it trained" in str(e.value)
    assert "layer id 3 (the target's last layer, L = 4)" in str(e.value) and "AFTER the final norm" in str(e.value)
    assert not os.path.exists(tmp_path / "zlab")
    # The speculators layout (vLLM taps aux id L before the norm) writes it; a zlab drafter without L-1 exports.
    out = export_drafter(drafter, str(tmp_path / "speculators"), "tiny-target", torch.float32, fmt="speculators")
    assert written_config(out)["aux_hidden_state_layer_ids"] == [1, 4]
    out = export_drafter(make_drafter(layer_ids=[0, 2], target_num_layers=4), str(tmp_path / "ok"), "tiny-target",
                         torch.float32, fmt="zlab")
    assert written_config(out)["dflash_config"]["target_layer_ids"] == [0, 2]


@pytest.fixture(scope="module")
def zlab_export(tmp_path_factory):
    return export_drafter(make_drafter(), str(tmp_path_factory.mktemp("zlab") / "export"), "tiny-target",
                          torch.float32, fmt="zlab")


@pytest.mark.parametrize("edit, named", [
    (lambda c: c["dflash_config"].update(input_embedding_scale=2.0), "dflash_config.input_embedding_scale=2.0"),
    (lambda c: c.update(output_multiplier=0.5), "output_multiplier=0.5"),
    (lambda c: c["dflash_config"].update(final_logit_softcapping=30.0), "dflash_config.final_logit_softcapping=30.0"),
    (lambda c: c.update(final_logit_softcapping=0), "final_logit_softcapping=0"),
])
def test_a_zlab_config_scaling_what_we_do_not_is_refused_naming_the_key(zlab_export, tmp_path, edit, named):
    out = str(tmp_path / "export")
    shutil.copytree(zlab_export, out)
    edit_config(out, edit)
    with pytest.raises(ExportError, match=f"config.json: {named}: z-lab's DFlashDraftModel would apply it"):
        load_exported(out)


def test_a_zlab_config_with_the_neutral_scalings_loads(zlab_export, tmp_path):
    out = str(tmp_path / "export")
    shutil.copytree(zlab_export, out)
    edit_config(out, lambda c: (c.update(output_multiplier=1, final_logit_softcapping=None),
                                c["dflash_config"].update(input_embedding_scale=1.0)))
    assert load_exported(out).config.layer_ids == [0, 1, 2]
