"""The drafter's decoder layer (spec.md §4): Qwen3-style RMSNorm, RoPE (HF's rotate-half, partial rotary), attention
whose queries come from the block and keys/values from [ctx ; block] through `ops.anchored_attention`, and the
SwiGLU MLP. `DFlashDrafter` stacks `DecoderLayer`s."""
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast.drafter import ops
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.conv import DynamicConv
from dflash_fast.target.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """RoPE over the first `rotary_dim` channels of each head (partial_rotary_factor), HF's rotate-half layout."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        params = cfg.rope_parameters
        rope_type = params.get("rope_type", params.get("type", "default"))
        self.rotary_dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_type == "default":
            dim = self.rotary_dim
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scaling = 1.0
        else:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = Qwen3Config(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=self.rotary_dim,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters=dict(params, partial_rotary_factor=1.0),
            )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [...] -> cos, sin [..., 1, rotary_dim] (broadcast over heads)."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype)[..., None, :], (emb.sin() * self.scaling).to(dtype)[..., None, :]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., heads, D] rotated on its first rotary_dim channels."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.hq * d, bias=False)
        self.k_proj = nn.Linear(h, self.hkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.hkv * d, bias=False)
        self.o_proj = nn.Linear(self.hq * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: Rope, cos_sin):
        """x [R, S, H] -> k, v [R, S, Hkv, D]; the same projections serve ctx and block."""
        r, s, _ = x.shape
        k = rope.rotate(self.k_norm(self.k_proj(x).view(r, s, self.hkv, self.d)), *cos_sin)
        return k, self.v_proj(x).view(r, s, self.hkv, self.d)

    def forward(self, x, ctx, rope: Rope, blk_cos_sin, ctx_cos_sin, attn: Dict) -> torch.Tensor:
        r, q_len, _ = x.shape
        q = rope.rotate(self.q_norm(self.q_proj(x).view(r, q_len, self.hq, self.d)), *blk_cos_sin)
        k_blk, v_blk = self.kv(x, rope, blk_cos_sin)
        k_ctx, v_ctx = self.kv(ctx, rope, ctx_cos_sin)  # ctx gets no input_layernorm (spec.md §4)
        out = ops.anchored_attention(q, k_ctx, v_ctx, k_blk, v_blk, scale=self.d**-0.5, **attn)
        return self.o_proj(out.reshape(r, q_len, self.hq * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.window = cfg.sliding_window if cfg.layer_types[index] == "sliding" else None
        self.window_from = cfg.window_from
        self.causal_in_block = cfg.causal_in_block[index]
        if cfg.conv_kernel_size:  # DFlash2 (spec.md §9): norm -> conv_in -> sublayer -> conv_out, around both sublayers
            conv = (cfg.hidden_size, cfg.block_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv, self.mlp_conv = DynamicConv(*conv), DynamicConv(*conv)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, ctx, rope, blk_cos_sin, ctx_cos_sin, attn: Dict) -> torch.Tensor:
        attn = dict(attn, window=self.window, window_from=self.window_from, causal_in_block=self.causal_in_block)
        attention = lambda y: self.self_attn(y, ctx, rope, blk_cos_sin, ctx_cos_sin, attn)
        x = self.sublayer(attention, self.attention_conv, self.input_layernorm(x), x)
        return self.sublayer(self.mlp, self.mlp_conv, self.post_attention_layernorm(x), x)

    @staticmethod
    def sublayer(fn, conv, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + fn(y), or with DFlash2's convolution residual + conv_out(fn(conv_in(y))), the add inside
        conv_out (`DynamicConv.finish`: the kernel writes the sum once)."""
        if conv is None:
            return residual + fn(y)
        y, delta = conv.prepare(y)
        return conv.finish(fn(y), delta, residual)
