"""The target's final norm and the RMSNorm every stage computes (spec.md §1-2): `last` is the final norm's INPUT, and
`teacher_logits = lm_head(final_norm(last))`, so the norm's kind and eps travel with every store and export.

    rms_norm            Qwen3/Llama RMSNorm (fp32 statistics): the target's final norm, and every drafter norm's twin
    NORM_KINDS          y = rms(x) * w, or zero-centred y = rms(x) * (1 + w) (Qwen3-Next, Qwen3.5)
    final_norm_weight   the effective scale of a norm of one kind
    final_norm_module   the model's final norm module, found by name
    detect_norm_kind    which kind a norm module computes, probed on random inputs
"""

import copy
from typing import Tuple

import torch

# Final-norm kinds a store can describe: y = rms(x) * w, or zero-centred y = rms(x) * (1 + w).
NORM_KINDS = ("rmsnorm", "rmsnorm_zero_centred")


def final_norm_weight(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The effective RMSNorm scale of a final norm of `kind`: `w`, or `1 + w` when zero-centred.

    weight: [H] -> [H]; use with `dflash_fast.drafter.eager.rms_norm(last, scale, eps)`.
    """
    if kind == "rmsnorm":
        return weight
    if kind == "rmsnorm_zero_centred":
        return 1 + weight
    raise ValueError(f"unknown final norm kind {kind!r}; expected one of {NORM_KINDS}")


def final_norm_module(model):
    """The final norm of a causal LM (`model.model.norm`) and its dotted name."""
    for name in ("model.norm", "model.language_model.norm"):
        module = model
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.Module):
            return module, name
    raise ValueError(f"{type(model).__name__}: cannot find the final norm (looked for model.norm); unsupported target")


def detect_norm_kind(norm) -> Tuple[str, float]:
    """Which RMSNorm formula the final norm computes: 'rmsnorm' (x*w) or 'rmsnorm_zero_centred' (x*(1+w)).

    Probed on a copy with random weights: class names lie, the arithmetic does not.
    """
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if eps is None or weight is None or weight.dim() != 1:
        raise ValueError(f"final norm {type(norm).__name__} is not an RMSNorm with (weight, eps); unsupported target")
    probe = copy.deepcopy(norm).to(device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(weight.shape, generator=gen))
        x = torch.randn(4, weight.shape[0], generator=gen)
        y = probe(x)
        for kind in NORM_KINDS:
            if torch.allclose(rms_norm(x, final_norm_weight(probe.weight, kind), eps), y, rtol=1e-5, atol=1e-6):
                return kind, float(eps)
    raise ValueError(f"final norm {type(norm).__name__} computes neither x*w nor x*(1+w) RMSNorm; unsupported target")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3/Llama RMSNorm: statistics in fp32, scale applied in the input dtype.

    x: [..., H], weight: [H] -> [..., H] (x.dtype). For zero-centred norms
    (Qwen3-Next, Qwen3.5: `x * (1 + w)`) pass the effective weight `1 + w`.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
