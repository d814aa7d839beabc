"""One forward of the frozen target per batch -> per-document arrays in the store's layout (SPEC §2).

Per token: the tapped layers (`hidden`), the residual entering the final norm (`last`, captured by a pre-hook on
the norm), and the teacher's next-token summary (top-k ids and logits, the full log-sum-exp) taken from the
logits the forward computes anyway. Every `parity_every` batches (and on the first) `lm_head(final_norm(last))`
is checked against the model's own logits with the norm kind the manifest records; an fp8 store's `last` is
checked once more as training will read it back. Extraction writes what TargetRunner returns; the online mode
trains on it directly.
"""
from typing import Dict, List, Sequence

import numpy as np
import torch

from dflash_fast.eager import rms_norm
from dflash_fast.errors import UserError
from dflash_fast.fp8 import FP8, SCALE_FIELDS, dequantize_fp8, quantize_fp8
from dflash_fast.records import Example
from dflash_fast.store_format import DTYPES, Layout
from dflash_fast.target import detect_norm_kind, final_norm_module, final_norm_weight, tapped_layers

# Parity tolerance on |lm_head(norm(last)) - logits|, relative to the largest |logit|.
PARITY_RTOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
# The same check on `last` as an fp8 store holds it (dequantised): e4m3 moves each element by up to 2^-4 of
# itself, so the logits move by a few percent of their scale; 2^-3 is twice the per-element bound and still
# far below what a wrong tensor gives (tests/test_extract.py measures both).
PARITY_RTOL_FP8 = 0.125
LOGIT_CHUNK = 2048  # tokens per fp32 top-k / lse chunk: bounds the fp32 copy of [n, V]


class TargetRunner:
    """One forward of the target per batch; returns per-sequence arrays in the store's layout."""

    def __init__(self, model, layer_ids, layout: Layout, pad_id: int, parity_every: int):
        self.model = model
        self.config = model.config.get_text_config()
        self.num_layers = self.config.num_hidden_layers
        self.layer_ids = list(layer_ids)
        self.layout = layout
        self.pad_id = pad_id
        self.parity_every = parity_every
        self.norm, self.norm_name = final_norm_module(model)
        self.norm_kind, self.norm_eps = detect_norm_kind(self.norm)
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = next(model.parameters()).device
        self.batches_run = 0
        self._captured = []
        self.norm.register_forward_pre_hook(lambda _module, args: self._captured.append(args[0]))

    def _forward(self, examples):
        """Right-padded forward -> logits [b, T, V], hidden [b, T, K, H], last [b, T, H]."""
        t = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), t), dtype=torch.long)
        for r, e in enumerate(examples):
            ids[r, : len(e.input_ids)] = torch.from_numpy(e.input_ids)
            mask[r, : len(e.input_ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self._captured.clear()
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        if len(self._captured) != 1:
            raise UserError(
                f"the final norm {self.norm_name} ran {len(self._captured)} times in one forward, not once"
            )
        last = self._captured.pop()
        states = out.hidden_states
        if len(states) != self.num_layers + 1:
            raise UserError(f"the target returned {len(states)} hidden states, expected L+1 = {self.num_layers + 1}")
        return out.logits, torch.stack(tapped_layers(states, last, self.layer_ids), dim=2), last

    def check_parity(self, logits, last, lengths, rtol=None, what="last") -> None:
        """lm_head(final_norm(last)) must reproduce the model's own logits, with the recorded norm kind.

        logits [b, T, V], last [b, T, H]; row r is valid up to lengths[r]. rtol: relative to the largest
        |logit|, default PARITY_RTOL of the logits' dtype.
        """
        scale = final_norm_weight(self.norm.weight, self.norm_kind)
        rtol = PARITY_RTOL[logits.dtype] if rtol is None else rtol
        last = last.to(logits.dtype)
        for r, n in enumerate(lengths):
            for a in range(0, n, LOGIT_CHUNK):
                b = min(n, a + LOGIT_CHUNK)
                got = self.lm_head(rms_norm(last[r, a:b], scale, self.norm_eps)).float()
                want = logits[r, a:b].float()
                err = (got - want).abs().max().item()
                bound = rtol * max(want.abs().max().item(), 1.0)
                if not err <= bound:
                    raise UserError(
                        f"parity check failed: lm_head({self.norm_name}({what})) differs from the model's logits by "
                        f"{err:.3g} (tolerance {bound:.3g}, norm kind {self.norm_kind}); `last` is not the input of "
                        f"the final norm or the norm is mis-described. Nothing was written for this batch."
                    )

    def _as_stored(self, name: str, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """`hidden` or `last` in the store's dtype: {name: x} cast, or for fp8 {name: q, name_scale: scale}."""
        if self.layout.dtype == FP8:
            q, scale = quantize_fp8(x)
            return {name: q, SCALE_FIELDS[name]: scale}
        return {name: x.to(DTYPES[self.layout.dtype][1])}

    @torch.inference_mode()
    def __call__(self, examples: Sequence[Example]) -> List[Dict[str, np.ndarray]]:
        logits, hidden, last = self._forward(examples)
        stored = self._as_stored("hidden", hidden)
        if self.layout.has_last:
            stored.update(self._as_stored("last", last))
        if self.batches_run % self.parity_every == 0:
            lengths = [len(e.input_ids) for e in examples]
            self.check_parity(logits, last, lengths)
            if self.layout.has_last and self.layout.dtype == FP8:
                # What training will read back must still reproduce the teacher, at fp8's tolerance.
                stored_last = dequantize_fp8(stored["last"], stored["last_scale"], logits.dtype)
                self.check_parity(logits, stored_last, lengths, PARITY_RTOL_FP8, "last as stored in fp8")
        self.batches_run += 1
        stored = {name: _to_numpy(x) for name, x in stored.items()}
        k = self.layout.topk
        out = []
        for r, e in enumerate(examples):
            n = len(e.input_ids)
            top_v, top_i, lse = [], [], []
            for a in range(0, n, LOGIT_CHUNK):
                chunk = logits[r, a: min(n, a + LOGIT_CHUNK)].float()
                v, i = torch.topk(chunk, k, dim=-1, sorted=True)
                top_v.append(v)
                top_i.append(i)
                lse.append(torch.logsumexp(chunk, dim=-1))
            arrays = {
                "input_ids": e.input_ids,
                "loss_mask": e.loss_mask,
                **{name: x[r, :n] for name, x in stored.items()},
                "teacher_topk_ids": torch.cat(top_i).to(torch.int32).cpu().numpy(),
                "teacher_topk_logits": torch.cat(top_v).cpu().numpy(),
                "teacher_lse": torch.cat(lse).cpu().numpy(),
            }
            out.append(arrays)
        return out


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU numpy copy; bf16 and fp8 keep their bits as uint16 and uint8 (numpy has neither)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    elif t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.cpu().numpy()
