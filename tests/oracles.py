"""spec.md written out a second time, by hand, for the tests: plain loops over slots and keys.

Nothing here imports dflash_fast. An oracle that calls the code it checks (`slot_targets`,
`gather_rows`, `context_visibility`, `block_visibility`, `tapped_layers`, ...) repeats that code's
bugs instead of catching them, so every rule below is spelled out again from the spec.md section it
cites, in the most literal form a reader can check line by line. Arithmetic runs in float64.
"""
import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


def _ints(x) -> List[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


# ---------------------------------------------------------------- spec.md §4: who sees what


def visible_keys(
    anchors: Sequence[int],
    anchor_valid: Sequence[bool],
    document_ids: Sequence[int],
    block_size: int,
    window: Optional[int] = None,
    causal_in_block: bool = False,
    window_from: str = "anchor",
) -> torch.Tensor:
    """One row -> [A*B, T + A*B] bool: query (block i, slot j) against context keys 0..T-1, then
    the block keys of every block (slot j' of block i' at column T + i'*B + j').

    window_from "anchor" is spec.md §4's window: W keys before the anchor, the same for every slot. "query" is
    a standard sliding window of the query's own position a + j (vLLM, SGLang, z-lab): a key at p is in it
    iff a + j - p < W, so slot j sees j + 1 fewer context keys than the anchor's window."""
    anchors, valid, doc = _ints(anchors), [bool(v) for v in anchor_valid], _ints(document_ids)
    t, a_count, b = len(doc), len(anchors), block_size
    mask = torch.zeros(a_count * b, t + a_count * b, dtype=torch.bool)
    for i, a in enumerate(anchors):
        if not valid[i]:
            continue  # an invalid anchor's queries see nothing
        for j in range(b):
            query = i * b + j
            for p in range(t):
                same_document = doc[p] == doc[a]
                before_anchor = p < a  # strictly: the target has not produced the anchor's hidden state yet
                if window is None:
                    in_window = True
                elif window_from == "anchor":
                    in_window = p >= a - window
                else:
                    in_window = (a + j) - p < window
                mask[query, p] = same_document and before_anchor and in_window
            for j_key in range(b):  # only the query's own block
                mask[query, t + i * b + j_key] = (not causal_in_block) or j_key <= j
    return mask


def attention(q, k_ctx, v_ctx, k_blk, v_blk, masks: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """Softmax attention one query at a time over the keys `masks[r][query]` allows.

    q: [R, A*B, Hq, D]; k_ctx, v_ctx: [R, T, Hkv, D]; k_blk, v_blk: [R, A*B, Hkv, D]; masks: R of
    [A*B, T + A*B] -> [R, A*B, Hq, D] float64; a query that sees nothing gets zeros. Query head h
    reads kv head h // (Hq / Hkv) (GQA)."""
    r_count, n_q, hq, d = q.shape
    group = hq // k_ctx.shape[2]
    out = torch.zeros(r_count, n_q, hq, d, dtype=torch.float64)
    for r in range(r_count):
        keys = torch.cat([k_ctx[r], k_blk[r]]).double()
        values = torch.cat([v_ctx[r], v_blk[r]]).double()
        for query in range(n_q):
            seen = masks[r][query].nonzero().flatten()
            if len(seen) == 0:
                continue
            for h in range(hq):
                scores = keys[seen, h // group] @ q[r, query, h].double() * scale
                out[r, query, h] = torch.softmax(scores, 0) @ values[seen, h // group]
    return out


# ---------------------------------------------------------------- spec.md §5: which slots train, on what


def trained_slots(batch, block_size: int, sample_from_anchor: bool = False) -> Iterator[Tuple[int, int, int, int]]:
    """Every trained slot of a collated batch as (row r, block i, slot j, predicted position p = a_i + j).

    Slot 0 never trains; nor does an invalid anchor's block, a position past the row, in another
    document than the anchor's, or with loss_mask 0.
    spec.md §8 sample_from_anchor: slot j predicts p = a_i + j + 1, slot 0 included; the same masks at that p."""
    for r in range(batch["anchors"].shape[0]):
        doc, loss_mask = _ints(batch["document_ids"][r]), _ints(batch["loss_mask"][r])
        t = len(doc)
        for i, (a, valid) in enumerate(zip(_ints(batch["anchors"][r]), _ints(batch["anchor_valid"][r]))):
            if not valid:
                continue
            for j in range(0 if sample_from_anchor else 1, block_size):
                p = a + j + (1 if sample_from_anchor else 0)
                if p < t and doc[p] == doc[a] and loss_mask[p]:
                    yield r, i, j, p


def slot_mask(batch, block_size: int, sample_from_anchor: bool = False) -> torch.Tensor:
    """[R, A, B] bool, True exactly on `trained_slots`."""
    r_count, a_count = batch["anchors"].shape
    mask = torch.zeros(r_count, a_count, block_size, dtype=torch.bool)
    for r, i, j, _ in trained_slots(batch, block_size, sample_from_anchor):
        mask[r, i, j] = True
    return mask


def position_weight(j: int, gamma: float, sample_from_anchor: bool = False) -> float:
    """w_0 = 0, w_j = exp(-(j - 1) / gamma); with sample_from_anchor (speculators' dflash_loss_decay)
    w_j = exp(-j / gamma)."""
    if sample_from_anchor:
        return math.exp(-j / gamma)
    return 0.0 if j == 0 else math.exp(-(j - 1) / gamma)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def teacher_logits(last_row: torch.Tensor, final_norm_weight, lm_head, eps: float) -> torch.Tensor:
    """lm_head(final_norm(last)) of one position: [H] -> [V] (the norm applied exactly once)."""
    return lm_head.double() @ rms_norm(last_row, final_norm_weight, eps)


def soft_cross_entropy(teacher: torch.Tensor, drafter: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log q_v with p = softmax(teacher logits), q = softmax(drafter logits); [V], [V] -> scalar."""
    return -(torch.softmax(teacher.double(), 0) * torch.log_softmax(drafter.double(), 0)).sum()


def entropy(teacher: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(teacher.double(), 0)
    return -(p * torch.log(p)).sum()


def hard_cross_entropy(label: int, drafter: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(drafter.double(), 0)[int(label)]


def topk_cross_entropy(ids, logits, lse, drafter: torch.Tensor) -> torch.Tensor:
    """kl_topk of one slot: p_i = exp(z_i - lse) on the k stored ids, the rest mass 1 - sum_i p_i on
    "every other token", whose drafter probability is 1 - sum_i q_i:
    -(sum_i p_i log q_i + (1 - sum_i p_i) log(1 - sum_i q_i))."""
    q = torch.softmax(drafter.double(), 0)
    p = [math.exp(float(z) - float(lse)) for z in logits]
    ce = -sum(p_i * torch.log(q[int(v)]) for p_i, v in zip(p, ids))
    p_rest = 1 - sum(p)
    q_rest = 1 - sum(q[int(v)] for v in ids)
    return ce - p_rest * torch.log(q_rest) if p_rest > 0 else ce


def topk_self_entropy(logits, lse) -> float:
    """sum_i p_i log p_i + p_rest log p_rest: the stored top-k teacher's negative entropy."""
    p = [math.exp(float(z) - float(lse)) for z in logits]
    p_rest = 1 - sum(p)
    return sum(p_i * math.log(p_i) for p_i in p) + (p_rest * math.log(p_rest) if p_rest > 0 else 0.0)


def divergence(kind: str, teacher: torch.Tensor, drafter: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """One slot's loss against the full teacher, p = softmax(teacher), q = softmax(drafter) logits [V] -> scalar,
    differentiable in `drafter`. The formulas of vllm-project/speculators 0.9.0 `src/speculators/losses/eager.py`
    (tv_loss, neg_log_acceptance_loss, lk_hybrid_loss, reverse_kl_div_loss, js_div_loss; kl_div_loss is the KL
    inside lk_hybrid), written as sums over the vocabulary; `kl` is spec.md §5's soft cross-entropy."""
    p, q = torch.softmax(teacher.double(), 0), torch.softmax(drafter.double(), 0)
    ids = range(len(p))
    alpha = sum(torch.minimum(p[v], q[v]) for v in ids)  # the acceptance rate: 1 - TV(p, q)
    if kind == "kl":
        return -sum(p[v] * torch.log(q[v]) for v in ids)
    if kind == "tv":
        return 1 - alpha
    if kind == "lk":  # negative log-acceptance, clamped at 1e-5 as speculators clamps it
        return -torch.log(torch.clamp(alpha, min=1e-5))
    if kind == "lk_hybrid":  # lambda KL(p||q) + (1 - lambda) TV, lambda = exp(-eta sg[alpha])
        kl = sum(p[v] * (torch.log(p[v]) - torch.log(q[v])) for v in ids)
        lam = math.exp(-eta * float(alpha.detach()))
        return lam * kl + (1 - lam) * (1 - alpha)
    if kind == "rkl":  # KL(q||p)
        return sum(q[v] * (torch.log(q[v]) - torch.log(p[v])) for v in ids)
    if kind == "jsd":  # (KL(p||m) + KL(q||m)) / 2, m = (p + q) / 2
        m = [(p[v] + q[v]) / 2 for v in ids]
        return 0.5 * sum(p[v] * torch.log(p[v] / m[v]) + q[v] * torch.log(q[v] / m[v]) for v in ids)
    raise ValueError(f"unknown loss kind {kind!r}")


def overlap(teacher: torch.Tensor, drafter: torch.Tensor) -> float:
    """alpha = sum_v min(p_v, q_v) of one slot (p, q: softmax of the teacher's and the drafter's logits [V])."""
    p, q = torch.softmax(teacher.double(), 0), torch.softmax(drafter.double(), 0)
    return sum(min(float(p[v]), float(q[v])) for v in range(len(p)))


def dpace_weight_loops(confidence: Sequence[float], mask: Sequence[bool], alpha: float, block_size: int) -> List[float]:
    """spec.md §5 D-PACE weights, block by block: s_j = (1 - alpha) c_j + alpha on trained slots and 1 elsewhere,
    P_j = prod_{i <= j} s_i, w_j = sum_{i >= j} P_i m_i on trained slots, 0 elsewhere."""
    weights = []
    for start in range(0, len(mask), block_size):
        c = [float(x) for x in confidence[start : start + block_size]]
        m = [bool(x) for x in mask[start : start + block_size]]
        s = [(1 - alpha) * c_j + alpha if m_j else 1.0 for c_j, m_j in zip(c, m)]
        reach = [math.prod(s[: j + 1]) for j in range(len(s))]
        weights += [sum(reach[i] for i in range(j, len(s)) if m[i]) if m[j] else 0.0 for j in range(len(s))]
    return weights


def slot_loss(kind: str, batch, r: int, p: int, logits: torch.Tensor, final_norm_weight, lm_head, eps: float):
    """spec.md §5 loss of the slot at position p of row r, whose drafter logits are `logits` [V]. Its
    teacher is the target's next-token distribution at p - 1; ce_data's label is the token at p."""
    t = p - 1
    if kind == "kl":
        return soft_cross_entropy(teacher_logits(batch["last"][r, t], final_norm_weight, lm_head, eps), logits)
    if kind == "ce":  # the stored argmax, else the argmax of the teacher computed from `last`
        if "teacher_topk_ids" in batch:
            return hard_cross_entropy(batch["teacher_topk_ids"][r, t, 0], logits)
        return hard_cross_entropy(teacher_logits(batch["last"][r, t], final_norm_weight, lm_head, eps).argmax(), logits)
    if kind == "ce_data":
        return hard_cross_entropy(batch["input_ids"][r, p], logits)
    if kind == "kl_topk":
        stored = batch["teacher_topk_ids"][r, t], batch["teacher_topk_logits"][r, t], batch["teacher_lse"][r, t]
        return topk_cross_entropy(*stored, logits)
    raise ValueError(f"unknown loss kind {kind!r}")


def slot_kl(kind: str, batch, r: int, p: int, logits: torch.Tensor, final_norm_weight, lm_head, eps: float):
    """The KL(p||q) metric of one slot (kl, kl_topk): its soft cross-entropy minus the teacher's entropy."""
    t = p - 1
    if kind == "kl":
        teacher = teacher_logits(batch["last"][r, t], final_norm_weight, lm_head, eps)
        return soft_cross_entropy(teacher, logits) - entropy(teacher)
    stored = batch["teacher_topk_ids"][r, t], batch["teacher_topk_logits"][r, t], batch["teacher_lse"][r, t]
    return topk_cross_entropy(*stored, logits) + topk_self_entropy(*stored[1:])


def drafter_logits(drafter, batch, eps: float) -> torch.Tensor:
    """[R, A*B, V] float64: the drafter's own block states through its norm and the frozen lm_head.

    What the loss scores, computed without the loss op: the oracles above decide what it is scored against."""
    x = drafter.batch_states(batch)
    return rms_norm(x, drafter.norm.weight, eps) @ drafter.lm_head.double().T


def batch_loss(kind: str, batch, logits: torch.Tensor, block_size: int, gamma: float, final_norm_weight=None,
               lm_head=None, eps: float = 1e-6):
    """spec.md §5 loss = sum(l * w * mask) / sum(mask) of a batch, and the KL metric likewise (None for the ce kinds).

    logits: [R, A*B, V] the drafter's logits of every slot."""
    slots = list(trained_slots(batch, block_size))
    loss = kl = 0.0
    for r, i, j, p in slots:
        slot = (batch, r, p, logits[r, i * block_size + j], final_norm_weight, lm_head, eps)
        loss = loss + position_weight(j, gamma) * slot_loss(kind, *slot)
        if kind in ("kl", "kl_topk"):
            kl = kl + position_weight(j, gamma) * slot_kl(kind, *slot)
    count = max(len(slots), 1)
    return loss / count, (kl / count if kind in ("kl", "kl_topk") else None)


# ---------------------------------------------------------------- spec.md §8: DSpark, after speculators 0.9.0
# (models/dspark/core.py DSparkDraftModel.forward, model_definitions.py MarkovHead / ConfidenceHead,
# metrics.py compute_metrics), one block and one slot at a time.


def dspark_prev_tokens(block_tokens: Sequence[int], sample_from_anchor: bool) -> List[int]:
    """The Markov head's previous token of each slot, from the ground-truth tokens at a..a+B-1 of a block:
    the block's own tokens with sample_from_anchor (slot k predicts a+k+1, conditions on a+k), else shifted
    by one with slot 0 repeating its own token."""
    tokens = _ints(block_tokens)
    return tokens if sample_from_anchor else tokens[:1] + tokens[:-1]


def _linear(weight, bias, x):
    return weight.double() @ x + (0 if bias is None else bias.double())


def dspark_block_heads(heads, prev: Sequence[int], hidden: torch.Tensor):
    """One block: prev ids [B], hidden [B, H] (the normed states, the lm_head's input) -> (bias [B, V],
    confidence logit [B] or None), float64. `heads`: dict of tensors named as speculators names them
    (type, w1 [V, r], w2 [V, r], gate_w/gate_b, joint_w/joint_b, conf_w/conf_b, conf_with_markov)."""
    w1, w2, kind = heads["w1"].double(), heads["w2"].double(), heads["type"]
    rank = w1.shape[1]
    state = torch.zeros(rank, dtype=torch.float64)
    bias, conf = [], []
    for k, token in enumerate(prev):
        e_prev, h = w1[token], hidden[k].double()
        if kind == "vanilla":
            e = e_prev
        elif kind == "gated":
            e = torch.sigmoid(_linear(heads["gate_w"], heads["gate_b"], torch.cat([h, e_prev]))) * e_prev
        else:  # rnn: gate, candidate and output from [state; e_prev; hidden] before the state moves on
            z = _linear(heads["joint_w"], heads["joint_b"], torch.cat([state, e_prev, h]))
            gate, candidate, out = z[:rank], z[rank : 2 * rank], z[2 * rank :]
            e = torch.tanh(out)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(candidate)
        bias.append(w2 @ e)
        if "conf_w" in heads:
            features = torch.cat([h, e_prev]) if heads["conf_with_markov"] else h
            conf.append(_linear(heads["conf_w"], heads["conf_b"], features)[0])
    return torch.stack(bias), (torch.stack(conf) if conf else None)


def dspark_batch_loss(batch, hidden: torch.Tensor, heads, block_size: int, gamma: float, sample_from_anchor: bool,
                      final_norm_weight, lm_head, eps: float, alpha: float, dpace_alpha: Optional[float] = None):
    """spec.md §8 `kl` loss of a batch -> (loss, confidence BCE, {(r, i, j): (biased logits [V], acceptance,
    confidence logit)}). hidden: [R, A*B, H] normed drafter states; the teacher of the token at p is the
    target at p - 1; acceptance = sum_v min(q_v, p_v); BCE weighted with the decay, / trained slots.
    dpace_alpha given: the `kl` terms take D-PACE weights per block (`dpace_weight_loops`) from the confidence
    exp(-CE) of the biased logits against the teacher's argmax (spec.md §5); the BCE keeps the decay (speculators)."""
    r_count, a_count = batch["anchors"].shape
    slots = list(trained_slots(batch, block_size, sample_from_anchor))
    terms, confidence, decay = {}, {}, {}
    bce = 0.0
    seen = {}
    for r, i, j, p in slots:
        a = int(batch["anchors"][r, i])
        prev = dspark_prev_tokens(batch["input_ids"][r, a : a + block_size], sample_from_anchor)
        block = hidden[r, i * block_size : (i + 1) * block_size]
        bias, conf = dspark_block_heads(heads, prev, block)
        logits = lm_head.double() @ block[j].double() + bias[j]
        teacher = teacher_logits(batch["last"][r, p - 1], final_norm_weight, lm_head, eps)
        w = decay[r, i, j] = position_weight(j, gamma, sample_from_anchor)
        terms[r, i, j] = soft_cross_entropy(teacher, logits)
        confidence[r, i, j] = float(torch.exp(-hard_cross_entropy(int(teacher.argmax()), logits.detach())))
        acceptance = torch.minimum(torch.softmax(logits, 0), torch.softmax(teacher, 0)).sum().detach()
        if conf is not None:
            sigma = torch.sigmoid(conf[j])
            bce = bce - w * (acceptance * torch.log(sigma) + (1 - acceptance) * torch.log(1 - sigma))
        seen[(r, i, j)] = (logits, acceptance, None if conf is None else conf[j])
    weights = decay
    if dpace_alpha is not None:
        keys = [(r, i, j) for r in range(r_count) for i in range(a_count) for j in range(block_size)]
        w = dpace_weight_loops([confidence.get(k, 0.0) for k in keys], [k in confidence for k in keys],
                               dpace_alpha, block_size)
        weights = dict(zip(keys, w))
    loss = sum(weights[k] * terms[k] for k in terms)
    count = max(len(slots), 1)
    return loss / count + alpha * bce / count, bce / count, seen


# ---------------------------------------------------------------- spec.md §9: DFlash2, after speculators 0.9.0
# (models/dflash2/model_definitions.py grouped_dynamic_conv, GroupedDynamicCausalConv, Qwen3DFlash2DecoderLayer,
# CandidateSelector; metrics.py selector_training_candidates, compute_selector_loss; core.py DFlash2DraftModel.forward),
# one block, one slot and one tap at a time.


def dflash2_conv(x_block: torch.Tensor, delta_block: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """One block: x [B, H], delta [B, taps, G] (output slot s's coefficients), base [taps, H] -> y [B, H] float64,
    y_s = sum over taps t <= s of x_{s-t} * (base[t] + delta_s[t, group of the channel])."""
    b, h = x_block.shape
    rows = []
    for s in range(b):
        y = torch.zeros(h, dtype=torch.float64)
        for t in range(base.shape[0]):
            if t > s:
                continue  # the tap would reach into the block before: it does not exist
            per_channel = torch.stack([delta_block[s, t, c // group_size] for c in range(h)]).double()
            y = y + x_block[s - t].double() * (base[t].double() + per_channel)
        rows.append(y)
    return torch.stack(rows)


def dflash2_sublayer(y: torch.Tensor, fn, projection: torch.Tensor, base: torch.Tensor, block_size: int,
                     group_size: int) -> torch.Tensor:
    """One sublayer of one row: its normed input y [A*B, H] -> conv_out(fn(conv_in(y))). delta = y @ projection.T
    read as [2, taps, G] per slot: [0] drives conv_in (base[0]), [1] conv_out (base[1]), both from the input."""
    taps, h = base.shape[1], y.shape[-1]
    delta = (y.double() @ projection.double().T).view(-1, 2, taps, h // group_size)
    blocks = range(0, y.shape[0], block_size)
    conv_in = torch.cat([dflash2_conv(y[i : i + block_size], delta[i : i + block_size, 0], base[0], group_size)
                         for i in blocks])
    z = fn(conv_in)
    return torch.cat([dflash2_conv(z[i : i + block_size], delta[i : i + block_size, 1], base[1], group_size)
                      for i in blocks])


def unary_top_k(unary: torch.Tensor, top_k: int) -> List[int]:
    """The K ids of the largest unary logits [V], best first."""
    return sorted(range(len(unary)), key=lambda v: -float(unary[v].detach()))[:top_k]


def dflash2_candidates(unary: torch.Tensor, label: int, top_k: int) -> Tuple[List[int], int, bool]:
    """The selector's training candidates of one slot from its unary logits [V]: the K best ids in order; if the
    label is not among them it takes the K-th place -> (ids, the label's index, whether it was among them)."""
    ranked = unary_top_k(unary, top_k)
    if label in ranked:
        return ranked, ranked.index(label), True
    return ranked[:-1] + [label], top_k - 1, False


def dflash2_scores(unary: torch.Tensor, hidden: torch.Tensor, prev: int, ids: Sequence[int], selector) -> torch.Tensor:
    """score(c) = unary[c] + sum_r P[prev, r] (W_h hidden)_r S[c, r] for each candidate c -> [K] float64.
    selector: dict of P, S [V, r] and W_h [r, H]."""
    projected = selector["W_h"].double() @ hidden.double()
    out = []
    for c in ids:
        transition = sum(selector["P"][prev, k].double() * projected[k] * selector["S"][c, k].double()
                         for k in range(len(projected)))
        out.append(unary[c].double() + transition)
    return torch.stack(out)


def dflash2_batch_loss(kind: str, batch, hidden: torch.Tensor, selector, lm_head, block_size: int, top_k: int,
                       sample_from_anchor: bool, final_norm_weight, eps: float, selector_alpha: float,
                       gamma: float = 7.0, dpace_alpha: Optional[float] = None):
    """spec.md §9 loss of a batch -> (loss, selector loss, {(r, i, j): (unary logits [V], candidate ids, scores [K],
    label index, contains, the selector's serving pick)}). hidden: [R, A*B, H] normed drafter states.

    Unary loss: `divergence` against the teacher at p - 1 for the dense kinds, the hard CE against the stored
    argmax for `ce`. Label: the teacher's argmax (stored for `ce`). Weights: the decay, or D-PACE per block
    (`dpace_weight_loops`) from exp(-CE) against the label for the unary loss and from exp(-selector CE) for the
    selector (speculators' compute_selector_loss). Both sums / the trained slot count."""
    r_count, a_count = batch["anchors"].shape
    slots = list(trained_slots(batch, block_size, sample_from_anchor))
    unary_l, sel_l, unary_c, sel_c, seen = {}, {}, {}, {}, {}
    for r, i, j, p in slots:
        a = int(batch["anchors"][r, i])
        prev = dspark_prev_tokens(batch["input_ids"][r, a : a + block_size], sample_from_anchor)[j]
        h = hidden[r, i * block_size + j]
        unary = lm_head.double() @ h.double()
        teacher = teacher_logits(batch["last"][r, p - 1], final_norm_weight, lm_head, eps)
        if kind == "ce":
            label = int(batch["teacher_topk_ids"][r, p - 1, 0])
            unary_l[r, i, j] = hard_cross_entropy(label, unary)
        else:
            label = int(teacher.argmax())
            unary_l[r, i, j] = divergence(kind, teacher, unary)
        unary_c[r, i, j] = float(torch.exp(-hard_cross_entropy(label, unary.detach())))
        ids, index, contains = dflash2_candidates(unary, label, top_k)
        scores = dflash2_scores(unary, h, prev, ids, selector)
        sel_l[r, i, j] = -torch.log_softmax(scores, 0)[index]
        sel_c[r, i, j] = float(torch.exp(-sel_l[r, i, j].detach()))
        serving_ids = unary_top_k(unary, top_k)  # what inference re-ranks: no label injected
        serving = dflash2_scores(unary, h, prev, serving_ids, selector)
        seen[r, i, j] = (unary, ids, scores, index, contains, serving_ids[int(serving.argmax())])

    def weights(confidence):
        if dpace_alpha is None:
            return {key: position_weight(key[2], gamma, sample_from_anchor) for key in confidence}
        keys = [(r, i, j) for r in range(r_count) for i in range(a_count) for j in range(block_size)]
        w = dpace_weight_loops([confidence.get(k, 0.0) for k in keys], [k in confidence for k in keys],
                               dpace_alpha, block_size)
        return dict(zip(keys, w))

    count = max(len(slots), 1)
    w_unary, w_sel = weights(unary_c), weights(sel_c)
    unary_loss = sum(w_unary[k] * unary_l[k] for k in unary_l) / count
    selector_loss = sum(w_sel[k] * sel_l[k] for k in sel_l) / count
    return unary_loss + selector_alpha * selector_loss, selector_loss, seen


# ---------------------------------------------------------------- spec.md §1: layer ids


def hf_taps(model, input_ids: Sequence[int], layer_ids: Sequence[int]):
    """The target's layer outputs for `layer_ids`, straight from one HF forward -> (taps [n, K, H], last [n, H]).

    Layer id l is HF hidden_states[l + 1] (hidden_states[0] is the embedding output); the last
    layer's output is read as the final norm's input (HF's hidden_states[L] is after the norm)."""
    captured = []
    handle = model.model.norm.register_forward_pre_hook(lambda _module, args: captured.append(args[0][0].clone()))
    try:
        with torch.no_grad():
            states = model(torch.tensor([list(input_ids)]), output_hidden_states=True, use_cache=False).hidden_states
    finally:
        handle.remove()
    (last,) = captured
    num_layers = len(states) - 1
    taps = [last if layer == num_layers - 1 else states[layer + 1][0] for layer in layer_ids]
    return torch.stack(taps, dim=1), last
