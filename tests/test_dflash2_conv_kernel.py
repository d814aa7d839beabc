"""The Triton grouped dynamic convolution (kernels/grouped_dynamic_conv.py) equals its eager twin
(dflash_fast.drafter.conv.grouped_dynamic_conv): forward and the gradients of x, delta and base.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest) in fp32 and fp16, with 64-row tiles of ~256
channels: the shapes below have partial row tiles, partial group tiles and a group size that is not a power of two.
"""
import pytest
import torch
import torch.nn.functional as F
from dflash_fast.kernels.grouped_dynamic_conv import grouped_dynamic_conv as triton_conv
from dflash_fast.kernels.grouped_dynamic_conv import projected_conv as triton_projected

from dflash_fast.drafter import ops
from dflash_fast.drafter.conv import DynamicConv, conv_impl, projected_conv_impl
from dflash_fast.drafter.conv import grouped_dynamic_conv as eager_conv
from dflash_fast.drafter.conv import projected_conv as eager_projected

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |actual - expected| relative to max |expected| (the eager twin rounds after every tap in 16-bit).
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def eager_ragged(x, delta, base, block_size, group_size, residual=None):
    """The eager twin for N rows not a multiple of block_size: zero rows pad the last block (a causal convolution
    never reads a later slot, so the real rows' outputs do not change), then they are cut off."""
    n = x.shape[1]
    pad = -n % block_size
    y = eager_conv(F.pad(x, (0, 0, 0, pad)), F.pad(delta, (0, 0, 0, 0, 0, pad)), base, block_size, group_size,
                   None if residual is None else F.pad(residual, (0, 0, 0, pad)))
    return y[:, :n]


def make_inputs(r, n, h, taps, group_size, dtype, seed=0, base_dtype=None):
    """-> x [R, N, H], delta [R, N, taps, H / group_size], base [taps, H] (all requiring grad), dy [R, N, H]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, n, h, generator=g)
    delta = 0.5 * torch.randn(r, n, taps, h // group_size, generator=g)
    base = torch.randn(taps, h, generator=g)
    dy = torch.randn(r, n, h, generator=g)
    to = lambda t, d=dtype: t.to(device=DEVICE, dtype=d)
    return (to(x).requires_grad_(), to(delta).requires_grad_(), to(base, base_dtype or dtype).requires_grad_(),
            to(dy))


def assert_close(got, want, dtype, name):
    err = (got.float() - want.float()).abs().max().item()
    scale = max(want.float().abs().max().item(), 1e-6)
    assert err <= TOL[dtype] * scale, f"{name}: max error {err:.3g} against max |want| {scale:.3g}"


def forward_and_grads(fn, x, delta, base, dy, block_size, group_size):
    y = fn(x, delta, base, block_size, group_size)
    return (y, *torch.autograd.grad(y, (x, delta, base), dy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "r, n, h, taps, group_size, block_size",
    [
        (1, 70, 40, 3, 8, 4),  # 2 row tiles, the last one partial; N not a multiple of B
        (2, 15, 24, 2, 24, 5),  # one group (group_size = H), a ragged last block per row run
        (1, 9, 300, 1, 1, 3),  # groups of one channel, 300 groups: several group tiles, the last partial
        (1, 13, 36, 3, 12, 3),  # group size not a power of two (masked lanes), taps = B
    ],
)
def test_kernel_forward_and_every_gradient_equal_the_eager_twin(r, n, h, taps, group_size, block_size, dtype):
    inputs = make_inputs(r, n, h, taps, group_size, dtype, seed=n)
    got = forward_and_grads(triton_conv, *inputs, block_size, group_size)
    want = forward_and_grads(eager_ragged, *inputs, block_size, group_size)
    for name, g, w in zip(("y", "dx", "d delta", "d base"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert_close(g, w, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "r, n, h, taps, group_size, block_size",
    [
        (1, 70, 40, 3, 8, 4),  # 2 row tiles, the last one partial; N not a multiple of B
        (2, 15, 24, 2, 24, 5),  # one group (group_size = H), a ragged last block per row run
        (1, 13, 36, 3, 12, 3),  # group size not a power of two (masked lanes), taps = B
    ],
)
def test_kernel_with_the_residual_add_fused_equals_residual_plus_the_eager_twin(r, n, h, taps, group_size,
                                                                               block_size, dtype):
    """conv_out with the decoder layer's residual add inside (`DynamicConv.finish`): residual + conv(x) forward, and
    the gradients of x, delta, base and the residual (dy itself)."""
    x, delta, base, dy = make_inputs(r, n, h, taps, group_size, dtype, seed=n)
    residual = (3 * torch.randn(r, n, h, generator=torch.Generator().manual_seed(1))).to(DEVICE, dtype)
    residual.requires_grad_()
    results = []
    for fn in (triton_conv, eager_ragged):
        y = fn(x, delta, base, block_size, group_size, residual)
        results.append((y, *torch.autograd.grad(y, (x, delta, base, residual), dy)))
    for name, g, w in zip(("y", "dx", "d delta", "d base", "d residual"), *results):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert_close(g, w, dtype, name)
    assert torch.equal(results[0][4], dy)


def test_the_fused_residual_gradient_is_dy_itself_not_a_copy():
    x, delta, base, dy = make_inputs(1, 12, 32, 2, 8, torch.float32)
    residual = torch.zeros_like(x).requires_grad_()
    (d_residual,) = torch.autograd.grad(triton_conv(x, delta, base, 4, 8, residual), (residual,), dy)
    assert d_residual.data_ptr() == dy.data_ptr()


def test_a_residual_of_another_dtype_is_refused():
    x, delta, base, _ = make_inputs(1, 8, 16, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="the residual"):
        triton_conv(x, delta, base, 4, 4, x.detach().half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "r, n, h, taps, group_size, block_size",
    [
        (1, 70, 40, 3, 8, 4),  # 2 row tiles, the last one partial
        (2, 15, 24, 2, 24, 5),  # one group (group_size = H)
        (1, 12, 36, 3, 12, 3),  # group size not a power of two (masked lanes), taps = B
    ],
)
def test_projection_and_conv_in_in_one_function_equal_the_eager_twin(r, n, h, taps, group_size, block_size, dtype):
    """`projected_conv` (DynamicConv.prepare): the kernel projection, conv_in, and conv_out's delta handed on; its
    backward writes conv_in's d delta into the projection's gradient and adds the projection's dgrad into conv_in's
    dx in place (addmm). Forward, both outputs, and the gradients of x, the projection weight and base, with
    conv_out's delta used downstream (its gradient joins the projection's) and not used at all."""
    if n % block_size:  # the eager twin's blocks are whole (the kernel's ragged last block is tested above)
        n -= n % block_size
    g = torch.Generator().manual_seed(n)
    x = torch.randn(r, n, h, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (0.3 * torch.randn(2 * taps * (h // group_size), h, generator=g)).to(DEVICE, dtype).requires_grad_()
    base = torch.randn(taps, h, generator=g).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(r, n, h, generator=g).to(DEVICE, dtype)
    d_out = torch.randn(r, n, taps, h // group_size, generator=g).to(DEVICE, dtype)
    for use_out in (True, False):
        results = []
        for fn in (triton_projected, eager_projected):
            y, delta_out = fn(x, weight, base, block_size, group_size)
            loss = (y * dy).sum() + ((delta_out * d_out).sum() if use_out else 0)
            results.append((y, delta_out, *torch.autograd.grad(loss, (x, weight, base))))
        for name, got, want in zip(("y", "delta_out", "dx", "d weight", "d base"), *results):
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert_close(got, want, dtype, name)


def test_an_fp32_base_with_fp16_activations_is_rounded_as_the_eager_twin_and_gets_an_fp32_gradient():
    inputs = make_inputs(1, 12, 32, 2, 8, torch.float16, base_dtype=torch.float32)
    got = forward_and_grads(triton_conv, *inputs, 4, 8)
    want = forward_and_grads(eager_conv, *inputs, 4, 8)
    assert got[3].dtype == torch.float32
    for name, g, w in zip(("y", "dx", "d delta", "d base"), got, want):
        assert_close(g, w, torch.float16, name)


def test_kernel_never_reaches_across_a_block_start():
    """Changing the last slot of block 0 (its x and its delta) changes nothing in block 1, forward, and no gradient
    flows from block 1's outputs into block 0's rows."""
    b, taps = 4, 4
    x, delta, base, _ = make_inputs(1, 3 * b, 16, taps, 4, torch.float32)
    x, delta, base = x.detach(), delta.detach(), base.detach()
    y = triton_conv(x, delta, base, b, 4)
    moved = x.clone()
    moved[0, b - 1] += 1
    assert torch.equal(triton_conv(moved, delta, base, b, 4)[0, b:], y[0, b:])
    assert not torch.equal(triton_conv(moved, delta, base, b, 4)[0, :b], y[0, :b])  # the change is seen in block 0
    x.requires_grad_()
    dy = torch.zeros_like(y)
    dy[0, b:2 * b] = 1  # only block 1's outputs
    (dx,) = torch.autograd.grad(triton_conv(x, delta, base, b, 4), (x,), dy)
    assert torch.count_nonzero(dx[0, :b]) == 0 and torch.count_nonzero(dx[0, 2 * b:]) == 0
    assert torch.count_nonzero(dx[0, b:2 * b]) > 0


def test_taps_beyond_the_block_size_are_refused():
    x, delta, base, _ = make_inputs(1, 8, 16, 3, 4, torch.float32)
    with pytest.raises(ValueError, match="taps = 3 must be in"):
        triton_conv(x, delta, base, 2, 4)


def test_dynamic_conv_runs_the_kernel_when_the_backend_is_triton():
    """DynamicConv.prepare / finish (delta read in place as a slice of the projection, the residual added inside
    conv_out) through the ops switch: the same outputs and gradients on both backends, and the switch really selects
    the kernel."""
    torch.manual_seed(0)
    conv = DynamicConv(32, 4, 2, 8).to(DEVICE)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
    x = torch.randn(2, 12, 32, device=DEVICE, requires_grad=True)
    results = {}
    for backend in ("eager", "triton"):
        with ops.backend(f"grouped_dynamic_conv={backend}"):
            assert conv_impl() is (triton_conv if backend == "triton" else eager_conv)
            assert projected_conv_impl() is (triton_projected if backend == "triton" else eager_projected)
            y, delta = conv.prepare(x)
            residual = 2 * x  # the layer's residual is the sublayer's input before its norm: its gradient joins x's
            z = conv.finish(torch.tanh(y), delta, residual)
            grads = torch.autograd.grad(z.square().sum(), (conv.base_kernel, conv.kernel_projection.weight, x))
            results[backend] = (z, *grads)
    for name, g, w in zip(("z", "d base_kernel", "d kernel_projection", "dx"), results["triton"], results["eager"]):
        assert_close(g, w, torch.float32, name)
