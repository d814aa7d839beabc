"""The fused fc-concat kernel equals its eager twin (dflash_fast.drafter.eager.fc_concat).

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest) in fp32 and fp16 with 32-wide
tiles, so the odd shapes below cover several tiles, partial tiles and the even-tile fast paths.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from dflash_fast.kernels.fc_concat import fc_concat, fc_concat_forward, split_layers

from dflash_fast.drafter import eager, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# Max |actual - expected| relative to max |expected|.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_inputs(n, k, h_t, h, dtype, seed=0):
    """-> hidden [N, K, H_t], fc_weight [H, K*H_t], norm_weight [H] (both requiring grad), d_ctx [N, H]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, k, h_t, generator=g)
    fc_weight = torch.randn(h, k * h_t, generator=g) / (k * h_t) ** 0.5
    norm_weight = 1 + 0.1 * torch.randn(h, generator=g)
    d_ctx = torch.randn(n, h, generator=g)
    to = lambda t: t.to(device=DEVICE, dtype=dtype)
    return to(hidden), to(fc_weight).requires_grad_(), to(norm_weight).requires_grad_(), to(d_ctx)


def forward_backward(fn, hidden, fc_weight, norm_weight, d_ctx, **kwargs):
    """-> (ctx, d_fc_weight, d_norm_weight)."""
    ctx = fn(hidden, fc_weight, norm_weight, EPS, **kwargs)
    return (ctx, *torch.autograd.grad(ctx, (fc_weight, norm_weight), d_ctx))


def assert_matches(actual, expected, dtype):
    for name, a, e in zip(("ctx", "d_fc_weight", "d_norm_weight"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{name}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
        err = ((a.float() - e.float()).abs().max() / e.float().abs().max()).item()
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "n,k,h_t,h",
    [(37, 1, 40, 48), (37, 3, 40, 48), (37, 5, 40, 48), (64, 2, 64, 40)],
    ids=["K1", "K3", "K5", "even_tiles_H_lt_Ht"],
)
def test_forward_and_weight_grads_match_eager(n, k, h_t, h, dtype):
    inputs = make_inputs(n, k, h_t, h, dtype)
    assert_matches(forward_backward(fc_concat, *inputs), forward_backward(eager.fc_concat, *inputs), dtype)


def _store_slice(hidden):
    """As the store lays out a token: [N, K+1, H_t+8] with `last` and padding, sliced to [N, K, H_t]."""
    n, k, h_t = hidden.shape
    big = torch.zeros(n, k + 1, h_t + 8, dtype=hidden.dtype, device=hidden.device)
    big[:, :k, :h_t] = hidden
    return big[:, :k, :h_t]


VIEWS = {
    "store_slice": _store_slice,
    "layer_major_transpose": lambda x: x.transpose(0, 1).contiguous().transpose(0, 1),
    "strided_last_dim": lambda x: x.permute(0, 2, 1).contiguous().permute(0, 2, 1),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_noncontiguous_hidden_matches_eager(view):
    hidden, fc_weight, norm_weight, d_ctx = make_inputs(37, 3, 40, 48, torch.float32)
    strided = VIEWS[view](hidden)
    assert not strided.is_contiguous() and torch.equal(strided, hidden)
    expected = forward_backward(eager.fc_concat, hidden, fc_weight, norm_weight, d_ctx)
    assert_matches(forward_backward(fc_concat, strided, fc_weight, norm_weight, d_ctx), expected, torch.float32)


def test_list_of_layers_matches_eager():
    hidden, fc_weight, norm_weight, d_ctx = make_inputs(37, 3, 40, 48, torch.float16)
    wide = torch.zeros(37, 56, dtype=hidden.dtype, device=DEVICE)
    wide[:, 8:48] = hidden[:, 1]
    layers = [hidden[:, 0].clone(), wide[:, 8:48], hidden[:, 2].clone()]  # separate storages, one row-strided
    assert_matches(
        forward_backward(fc_concat, layers, fc_weight, norm_weight, d_ctx),
        forward_backward(eager.fc_concat, hidden, fc_weight, norm_weight, d_ctx),
        torch.float16,
    )


@pytest.mark.parametrize("form", ["tensor", "list"])
def test_hidden_gets_no_gradient(form):
    hidden, fc_weight, norm_weight, d_ctx = make_inputs(37, 3, 40, 48, torch.float32)
    hidden.requires_grad_(True)
    arg = hidden if form == "tensor" else list(hidden.unbind(1))
    fc_concat(arg, fc_weight, norm_weight, EPS).backward(d_ctx)
    assert hidden.grad is None
    assert fc_weight.grad is not None and norm_weight.grad is not None


def test_frozen_fc_weight_still_trains_norm_weight():
    hidden, fc_weight, norm_weight, d_ctx = make_inputs(37, 3, 40, 48, torch.float32)
    fc_weight.requires_grad_(False)
    ctx = fc_concat(hidden, fc_weight, norm_weight, EPS)
    (d_norm,) = torch.autograd.grad(ctx, norm_weight, d_ctx)
    (expected,) = torch.autograd.grad(eager.fc_concat(hidden, fc_weight, norm_weight, EPS), norm_weight, d_ctx)
    err = ((d_norm - expected).abs().max() / expected.abs().max()).item()
    assert err <= TOL[torch.float32]


def noise_of(n, k, h_t, noise_std, seed):
    """The noise the kernel adds, read back exactly: zero hidden states through an identity fc -> [N, K, H_t]."""
    hidden = torch.zeros(n, k, h_t, device=DEVICE)
    eye = torch.eye(k * h_t, device=DEVICE)
    _, y, _ = fc_concat_forward(split_layers(hidden), eye, torch.ones(k * h_t, device=DEVICE), EPS, noise_std, seed)
    return y.view(n, k, h_t)


def test_noise_is_uniform_within_bounds():
    std = 0.5
    noise = noise_of(64, 3, 38, std, seed=11)  # H_t = 38: two tiles, not a multiple of 4
    assert noise.abs().max() <= std
    assert noise.min() < -0.95 * std and noise.max() > 0.95 * std
    assert noise.mean().abs() < 4 * std / 3**0.5 / noise.numel() ** 0.5
    assert abs(noise.var().item() / (std**2 / 3) - 1) < 0.1
    counts = torch.histc(noise.cpu(), bins=10, min=-std, max=std)
    assert (counts - noise.numel() / 10).abs().max() < 0.2 * noise.numel() / 10
    assert noise.unique().numel() == noise.numel(), "two elements drew the same random number"


def test_noise_depends_on_seed_and_only_on_seed():
    a, b, again = (noise_of(16, 2, 40, 0.1, seed) for seed in (1, 2, 1))
    assert torch.equal(a, again)
    assert (a != b).float().mean() > 0.99


def test_zero_noise_std_is_no_noise():
    inputs = make_inputs(37, 3, 40, 48, torch.float32)
    noiseless = forward_backward(fc_concat, *inputs, noise_std=0.0, seed=123)
    assert_matches(noiseless, forward_backward(eager.fc_concat, *inputs), torch.float32)


def test_backward_sees_the_forward_noise():
    n, k, h_t, std, seed = 37, 3, 38, 0.3, 5
    hidden, fc_weight, norm_weight, d_ctx = make_inputs(n, k, h_t, 48, torch.float32)
    noisy = hidden + noise_of(n, k, h_t, std, seed)
    assert_matches(
        forward_backward(fc_concat, hidden, fc_weight, norm_weight, d_ctx, noise_std=std, seed=seed),
        forward_backward(eager.fc_concat, noisy, fc_weight, norm_weight, d_ctx),
        torch.float32,
    )


def test_ops_switch_runs_triton_kernel():
    hidden, fc_weight, norm_weight, d_ctx = make_inputs(37, 3, 40, 48, torch.float32)
    ops.set_backend(fc_concat="triton")
    try:
        assert ops.backend_of("fc_concat") == "triton"
        got = forward_backward(ops.fc_concat, hidden, fc_weight, norm_weight, d_ctx)
    finally:
        ops.set_backend(fc_concat="auto")
    assert "FcConcatFunction" in got[0].grad_fn.name()
    assert_matches(got, forward_backward(eager.fc_concat, hidden, fc_weight, norm_weight, d_ctx), torch.float32)


def test_rejects_fc_weight_of_wrong_width():
    hidden, fc_weight, norm_weight, _ = make_inputs(8, 3, 40, 48, torch.float32)
    with pytest.raises(ValueError, match=r"K\*H_t = 2\*40 = 80"):
        fc_concat(hidden[:, :2], fc_weight, norm_weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("noise_std", [0.0, 0.2])
def test_bf16_on_gpu_matches_eager(noise_std):
    n, k, h_t, h, seed = 1000, 5, 384, 256, 3
    inputs = make_inputs(n, k, h_t, h, torch.bfloat16)
    hidden, fc_weight, norm_weight, d_ctx = inputs
    noisy = (hidden.float() + noise_of(n, k, h_t, noise_std, seed)).bfloat16() if noise_std else hidden
    assert_matches(
        forward_backward(fc_concat, *inputs, noise_std=noise_std, seed=seed),
        forward_backward(eager.fc_concat, noisy, fc_weight, norm_weight, d_ctx),
        torch.bfloat16,
    )


def test_bench_smoke_writes_results(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(REPO, "bench", "bench_fc_concat.py"), "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    with open(tmp_path / "fc_concat_smoke.json") as f:
        rows = json.load(f)["rows"]
    assert {r["impl"] for r in rows} >= {"eager", "triton"}
    assert all(r["fwd_bwd_ms"] > 0 for r in rows)
