"""DFlash2's grouped dynamic causal convolution (spec.md §9), the part of the DFlash2 family that lives inside the
backbone's decoder layer (`layers.DecoderLayer` wraps both sublayers in a `DynamicConv` when `conv_kernel_size > 0`):
its eager twin, the switch to the kernel, and the module. The rest of the family (the candidate selector, its loss,
the proposal walk) is in `dflash2.py`.

    x -> norm -> conv_in -> attention | MLP -> conv_out -> + residual (one op: `finish`)
    delta = kernel_projection(norm(x)) [.., S, 2, taps, G]  (G = H / group groups, one coefficient each)
    y_s[c] = sum_{t < taps, t <= s} x_{s-t}[c] * (base[t, c] + delta_s[t, g(c)])   (s: slot in its block)
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast.drafter import ops


def grouped_dynamic_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The causal convolution inside each block: x [R, A*B, H] (the A blocks of B slots one after another),
    delta [R, A*B, taps, G] (each output slot's dynamic coefficients, G = H / group_size), base [taps, H]
    -> y [R, A*B, H] with y_s = sum_{t <= s} x_{s-t} * (base[t] + delta_s[t, group]); taps never reach into the
    block before. With residual [R, A*B, H]: residual + y (the decoder layer's residual add, which the kernel fuses
    into its one write)."""
    r, q, h = x.shape
    taps, groups = base.shape[0], h // group_size
    xb = x.view(r, q // block_size, block_size, groups, group_size)
    db = delta.view(r, q // block_size, block_size, taps, groups)
    y = torch.zeros_like(xb)
    for t in range(taps):
        shifted = F.pad(xb[:, :, : block_size - t], (0, 0, 0, 0, t, 0))  # x_{s-t}, zeros for s < t
        y = y + shifted * (base[t].to(x.dtype).view(groups, group_size) + db[:, :, :, t, :, None])
    return y.view(r, q, h) if residual is None else residual + y.view(r, q, h)


def projected_conv(
    x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel projection and conv_in of one sublayer: x [R, A*B, H] (its normed input), weight [2 taps G, H],
    base [taps, H] (conv_in's) -> (conv_in(x) [R, A*B, H], conv_out's delta [R, A*B, taps, G]), the projection's
    output delta = x W^T viewed [R, A*B, 2, taps, G] (index 0 conv_in's, 1 conv_out's)."""
    delta = F.linear(x, weight).view(*x.shape[:-1], 2, base.shape[0], x.shape[-1] // group_size)
    y = grouped_dynamic_conv(x, delta[..., 0, :, :], base, block_size, group_size)
    return y, delta[..., 1, :, :]


def conv_impl():
    """The convolution the ops backend `grouped_dynamic_conv` selects: kernels/grouped_dynamic_conv.py (one pass
    each way) or `grouped_dynamic_conv` above, its eager twin."""
    return ops.kernel_or("grouped_dynamic_conv", grouped_dynamic_conv)


def projected_conv_impl():
    """`projected_conv` on the same switch: the kernel module's (conv_in's dx and the projection's dgrad summed by
    one in-place addmm) or the one above."""
    return ops.kernel_or("grouped_dynamic_conv", projected_conv, name="projected_conv")


class DynamicConv(nn.Module):
    """The input- and output-side convolutions of one sublayer, both driven by one projection of its normed input."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity (base[0] = 1, the other taps and the projection 0): a fresh DFlash2 layer is a DFlash layer."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [R, A*B, H] (normed sublayer input) -> (conv_in(x) [R, A*B, H], the output side's delta
        [R, A*B, taps, G])."""
        return projected_conv_impl()(x, self.kernel_projection.weight, self.base_kernel[0], self.block_size,
                                     self.group_size)

    def finish(self, y: torch.Tensor, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual [R, A*B, H] + the sublayer's output y [R, A*B, H] through conv_out with the delta `prepare`
        computed: the decoder layer's residual add inside the convolution (the kernel writes the sum once)."""
        return conv_impl()(y, delta, self.base_kernel[1], self.block_size, self.group_size, residual)
