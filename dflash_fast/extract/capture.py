"""One forward of the frozen target per batch -> per-document arrays in the store's layout (spec.md §2).

Per token: the tapped layers (`hidden`) and the residual entering the final norm (`last`), kept by hooks as the
forward runs (target.LayerTaps: no other layer's states, no [T, V] logits), and the teacher's next-token summary
(top-k ids and logits, the full log-sum-exp) from `last` through the target's own final norm and lm_head, a chunk
of rows at a time (`teacher_summary`; the engine path computes it the same way). Every `parity_every` batches (and
on the first) `lm_head(final_norm(last))` with the norm kind the manifest records is checked against the model's
own logits, which the forward computes at PARITY_POSITIONS positions of such a batch only; an fp8 store's `last`
is checked once more as training will read it back. Extraction writes what TargetRunner returns; the online mode
trains on it directly.
"""
import inspect
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dflash_fast.errors import UserError
from dflash_fast.store.format import DTYPES, Layout
from dflash_fast.store.fp8 import FP8, SCALE_FIELDS, dequantize_fp8, quantize_fp8
from dflash_fast.target.norm import detect_norm_kind, final_norm_weight, rms_norm
from dflash_fast.target.records import Example
from dflash_fast.target.taps import LayerTaps

# Parity tolerance on |lm_head(norm(last)) - logits|, relative to the largest |logit|.
PARITY_RTOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
# The same check on `last` as an fp8 store holds it (dequantised): e4m3 moves each element by up to 2^-4 of
# itself, so the logits move by a few percent of their scale; 2^-3 is twice the per-element bound and still
# far below what a wrong tensor gives (tests/test_extract.py measures both).
PARITY_RTOL_FP8 = 0.125
# Rows of `last` per teacher chunk: the chunk's fp32 logits [c, V] and logsumexp's fp32 temporary (8 bytes an
# entry) are what the teacher adds to `last`, 2.5 GB at V = 151936, whatever T is (dflash_fast/train/memory.py).
LOGIT_CHUNK = 2048
# Positions of a parity batch (spread over its length) at which the forward keeps the model's own logits.
PARITY_POSITIONS = 256


def head_chunks(norm, lm_head, last: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
    """lm_head(norm(last)) of last [n, H], LOGIT_CHUNK rows at a time, through the target's own final norm and
    lm_head as its forward applies them -> (first row, fp32 logits [c, V]) pairs; never [n, V] at once."""
    for a in range(0, last.shape[0], LOGIT_CHUNK):
        yield a, lm_head(norm(last[a : a + LOGIT_CHUNK])).float()


def teacher_summary(norm, lm_head, last: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's next-token summary of last [n, H] (spec.md §2): top-k ids [n, k] int32 and logits [n, k] fp32,
    descending, and the full log-sum-exp [n] fp32, from head_chunks."""
    ids, values, lse = [], [], []
    for _, logits in head_chunks(norm, lm_head, last):
        v, i = torch.topk(logits, k, dim=-1, sorted=True)
        ids.append(i.to(torch.int32))
        values.append(v)
        lse.append(torch.logsumexp(logits, dim=-1))
    return torch.cat(ids), torch.cat(values), torch.cat(lse)


def parity_positions(length: int) -> torch.Tensor:
    """[P] positions of a padded length at which a parity batch keeps the model's own logits: every one up to
    PARITY_POSITIONS, else PARITY_POSITIONS spread evenly from the first to the last."""
    return torch.linspace(0, length - 1, min(length, PARITY_POSITIONS)).round().long()


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
        self.taps = LayerTaps(model, self.layer_ids)
        self.norm, self.norm_name = self.taps.norm, self.taps.norm_name
        self.norm_kind, self.norm_eps = detect_norm_kind(self.norm)
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = next(model.parameters()).device
        self.batches_run = 0
        # A model whose forward cannot limit its logits (remote code without logits_to_keep) computes all of them.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _forward(self, examples, positions: Optional[torch.Tensor]):
        """Right-padded forward -> hidden [b, T, K, H], last [b, T, H], and the model's own logits [b, P, V] at
        `positions` [P] (None: none)."""
        t = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), t), dtype=torch.long)
        for r, e in enumerate(examples):
            ids[r, : len(e.input_ids)] = torch.from_numpy(e.input_ids)
            mask[r, : len(e.input_ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        keep = {}
        if self._logits_to_keep:
            keep["logits_to_keep"] = positions.to(self.device) if positions is not None else 1
        with self.taps:
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False, **keep)
        hidden, last = self.taps.take()
        if positions is None:
            return hidden, last, None
        return hidden, last, out.logits if self._logits_to_keep else out.logits[:, positions.to(self.device)]

    def check_parity(self, logits, positions, last, lengths, rtol=None, what="last") -> None:
        """lm_head(final_norm(last)) must reproduce the model's own logits, with the recorded norm kind.

        logits [b, P, V] at positions [P], last [b, T, H]; row r is valid up to lengths[r]. rtol: relative to the
        largest |logit|, default PARITY_RTOL of the logits' dtype.
        """
        scale = final_norm_weight(self.norm.weight, self.norm_kind)
        rtol = PARITY_RTOL[logits.dtype] if rtol is None else rtol
        last, positions = last.to(logits.dtype), positions.to(last.device)
        for r, n in enumerate(lengths):
            valid = positions < n
            got = self.lm_head(rms_norm(last[r, positions[valid]], scale, self.norm_eps)).float()
            want = logits[r, valid].float()
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
        lengths = [len(e.input_ids) for e in examples]
        positions = parity_positions(max(lengths)) if self.batches_run % self.parity_every == 0 else None
        hidden, last, logits = self._forward(examples, positions)
        stored = self._as_stored("hidden", hidden)
        del hidden  # `stored` holds it (the same tensor where the dtypes agree) until its host copy below
        if self.layout.has_last:
            stored.update(self._as_stored("last", last))
        if positions is not None:
            self.check_parity(logits, positions, last, lengths)
            if self.layout.has_last and self.layout.dtype == FP8:
                # What training will read back must still reproduce the teacher, at fp8's tolerance.
                stored_last = dequantize_fp8(stored["last"], stored["last_scale"], logits.dtype)
                self.check_parity(logits, positions, stored_last, lengths, PARITY_RTOL_FP8, "last as stored in fp8")
            del logits
        self.batches_run += 1
        stored = {name: _to_numpy(x) for name, x in stored.items()}  # host copies: the device keeps only `last`
        out = []
        for r, e in enumerate(examples):
            n = len(e.input_ids)
            top_i, top_v, lse = teacher_summary(self.norm, self.lm_head, last[r, :n], self.layout.topk)
            out.append({
                "input_ids": e.input_ids,
                "loss_mask": e.loss_mask,
                **{name: x[r, :n] for name, x in stored.items()},
                "teacher_topk_ids": top_i.cpu().numpy(),
                "teacher_topk_logits": top_v.cpu().numpy(),
                "teacher_lse": lse.cpu().numpy(),
            })
        return out


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU numpy copy; bf16 and fp8 keep their bits as uint16 and uint8 (numpy has neither)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    elif t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.cpu().numpy()
