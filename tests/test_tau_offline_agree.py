"""The trainer's val tau_offline and `dflash-fast eval`'s tau_offline are one metric (SPEC §6): on the same documents
they give the same sums. The trainer scores a store's held-out rows (stored taps and `last`, anchors sampled per row,
the drafter's training forward, slot_metrics); eval's offline_tau runs the live target over prompt + response and
scores an anchor at every response position. With every eligible anchor sampled, both must count the same blocks and
the same leading matches: a gap between a run's val tau_offline and its eval tau_offline is then a gap between the
texts they score (docs/training.md), never between two ways of counting."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_targets import make_tiny_target, write_jsonl

from dflash_fast.data.batches import row_batches
from dflash_fast.drafter.model import build_drafter, slot_metrics
from dflash_fast.evaluate.decode import TargetRunner
from dflash_fast.evaluate.evaluate import offline_tau
from dflash_fast.extract.extract import extract
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.target.prompts import load_model

LAYER_IDS = [1, 2]
SEQ_LEN = 64
SPLIT = dict(val_fraction=0.25, split_seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer Qwen3 target (H = 32, V = 384) and an fp32 store of 16 one-turn chats (the loss mask a suffix)."""
    root = tmp_path_factory.mktemp("tau_offline_agree")
    target = make_tiny_target(root / "target", num_layers=4, hidden_size=32)
    rng = np.random.default_rng(0)
    words = "the a block of tokens drafts target accepts each anchor and its next".split()
    records = [{"conversations": [{"role": "user", "content": " ".join(rng.choice(words, 6))},
                                  {"role": "assistant", "content": " ".join(rng.choice(words, 14))}]}
               for _ in range(16)]
    write_jsonl(root / "data.jsonl", records)
    extract(target, root / "data.jsonl", root / "store", layer_ids=LAYER_IDS, dtype="fp32", max_seq_len=SEQ_LEN,
            progress=False)
    return SimpleNamespace(target=str(target), store=HiddenStateStore(str(root / "store")))


def test_val_tau_offline_equals_evals_offline_tau_on_the_same_documents(tiny):
    batches = row_batches(tiny.store, SEQ_LEN, SEQ_LEN, 2, 0, split="val", with_last=True, **SPLIT)
    val = [batches[s] for s in range(len(batches))]
    assert all(int(b["anchor_valid"].sum(-1).max()) < SEQ_LEN for b in val), "every eligible anchor is sampled"
    torch.manual_seed(0)
    drafter = build_drafter(tiny.target, LAYER_IDS, mask_token_id=383, num_layers=1, block_size=4)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(30):  # fitted to these rows a little: some drafts must match for the sums to say anything
        for batch in val:
            drafter(batch, loss_kind="kl").loss.backward()
        opt.step()
        opt.zero_grad()
    drafter.eval()
    with torch.no_grad():
        sums = [slot_metrics(drafter(batch, loss_kind="kl")) for batch in val]
    trainer = (sum(float(m["tau_sum"]) for m in sums), sum(int(m["blocks"]) for m in sums))

    runner = TargetRunner(load_model(tiny.target, "cpu", "fp32"), LAYER_IDS)
    documents = sorted({item for s in range(len(batches)) for item in batches.documents(s)})
    evaluated = [0.0, 0]
    for item in documents:
        ids, mask = (np.asarray(tiny.store[item][k]) for k in ("input_ids", "loss_mask"))
        start = int(mask.argmax())
        assert mask[start:].all() and not mask[:start].any(), "a one-turn chat's loss mask is the reply, a suffix"
        tau_sum, blocks = offline_tau(runner, drafter, ids[:start].tolist(), ids[start:].tolist())
        evaluated[0] += tau_sum
        evaluated[1] += blocks
    assert trainer[0] > trainer[1], "no draft matched: the comparison would be vacuous"
    assert evaluated[1] == trainer[1] and evaluated[0] == pytest.approx(trainer[0], abs=1e-6)
