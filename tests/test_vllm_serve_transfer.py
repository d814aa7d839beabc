"""The reading end of data.source=vllm_serve without vLLM: files in hs_connectors' formats (file, FP8) are read,
waited for behind their lock, checked and removed; the config names its keys. The served path itself, with real
`vllm serve` replicas: tests/test_vllm_serve_replicas.py."""
import fcntl
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from dflash_fast.extract.vllm_serve import FP8_SCALES, ReplicaDown, parse_servers, read_hidden_states, vllm_serve_flags
from dflash_fast.train.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hs_connectors_fp8(hidden):
    """hs_connectors.fp8_utils.quantize_tensor_to_fp8, as its FP8HiddenStatesConnector writes: one scale a token."""
    scale = (hidden.abs().amax(dim=(1, 2), keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (hidden / scale).to(torch.float8_e4m3fn), scale


def test_a_file_transfer_is_read_and_removed(tmp_path):
    hidden, ids = torch.randn(5, 3, 8), torch.arange(5)
    path = str(tmp_path / "req.safetensors")
    save_file({"hidden_states": hidden, "token_ids": ids}, path)
    got, got_ids, stored = read_hidden_states(path, torch.float32, 1.0)
    assert torch.equal(got, hidden) and torch.equal(got_ids, ids) and stored == "float32"
    assert os.listdir(tmp_path) == []


def test_an_fp8_transfer_is_dequantized_as_hs_connectors_does(tmp_path):
    hidden = torch.randn(5, 3, 8) * torch.tensor([1.0, 10.0, 100.0, 0.1, 3.0])[:, None, None]
    fp8, scale = hs_connectors_fp8(hidden)
    path = str(tmp_path / "req.safetensors")
    save_file({"hidden_states": fp8, FP8_SCALES: scale, "token_ids": torch.arange(5)}, path)
    got, _, stored = read_hidden_states(path, torch.float32, 1.0)
    assert stored == "fp8"
    assert torch.equal(got, fp8.to(torch.float32) * scale)  # hs_connectors.fp8_utils.dequantize_fp8_tensor
    assert ((got - hidden).abs() <= 2**-3 * hidden.abs() + 1e-6).all()  # within one e4m3 step
    assert os.listdir(tmp_path) == []


def test_a_locked_file_is_read_only_once_the_writer_releases_its_lock(tmp_path):
    path = str(tmp_path / "req.safetensors")
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as vLLM's connector holds it from the request's first step

    with open(path, "wb") as f:  # the writer has begun: a reader that does not wait reads half a file
        f.write(b"\x10\x00\x00")

    def write_then_release():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(2, 1, 4), "token_ids": torch.arange(2)}, path)
        os.close(fd)

    writer = threading.Thread(target=write_then_release)
    writer.start()
    got, _, _ = read_hidden_states(path, torch.float32, 10.0)
    writer.join()
    assert torch.equal(got, torch.ones(2, 1, 4))
    assert os.listdir(tmp_path) == [], "the file and its lock are removed once read"


def test_a_file_that_never_comes_is_the_replicas_failure(tmp_path):
    with pytest.raises(ReplicaDown, match="did not appear within 0.2 s"):
        read_hidden_states(str(tmp_path / "never.safetensors"), torch.float32, 0.2)


def test_the_server_flags_ask_vllm_for_our_layers_in_its_aux_numbering():
    flags = vllm_serve_flags([0, 3, 7], 8, 96, "/shared/hs", transfer="fp8", device="gpu")
    spec = flags[flags.index("--speculative-config") + 1]
    kv = flags[flags.index("--kv-transfer-config") + 1]
    assert '"method": "extract_hidden_states"' in spec and '"eagle_aux_hidden_state_layer_ids": [1, 4, 8]' in spec
    assert '"FP8HiddenStatesConnector"' in kv and '"shared_storage_path": "/shared/hs"' in kv
    assert flags[flags.index("--max-model-len") + 1] == "97"


@pytest.mark.parametrize("overrides, match", [
    ([], "data.source=vllm_serve needs data.online.servers"),
    (["data.online.servers=10.0.0.5:8000"], "is not a URL"),
    (["data.online.servers=http://a:8000", "data.online.transfer=mooncake"], "data.online.transfer='mooncake'"),
])
def test_data_source_vllm_serve_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["data.source=vllm_serve", "model.target=T",
                                                                 "data.jsonl=x.jsonl", *overrides])


def test_several_servers_parse_from_one_override():
    assert parse_servers("http://a:8000, http://b:8000/") == ["http://a:8000", "http://b:8000/"]


def test_the_memory_plan_counts_our_lm_head_on_the_trainer_and_no_vllm_share():
    from dflash_fast.data.config import OnlineConfig
    from dflash_fast.evaluate.quickstart import TARGET
    from dflash_fast.train.memory import online_target

    served = online_target(TARGET, torch.float32, OnlineConfig(), 3, "vllm_serve", limit=int(141e9))
    in_process = online_target(TARGET, torch.float32, OnlineConfig(), 3, "vllm", limit=int(141e9))
    assert served.engine_bytes == 0 and in_process.engine_bytes > 0
    assert served.weight_bytes == in_process.weight_bytes == (2048 + 1) * 128 * 4  # lm_head [V, H] and the norm
