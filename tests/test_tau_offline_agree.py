"""The trainer's val tau_offline and `dflash-fast eval`'s tau_offline are one metric (spec.md §6): on the same documents
they give the same sums. The trainer scores a store's held-out rows (stored taps and `last`, anchors sampled per row,
the drafter's training forward, slot_metrics); eval's offline_tau runs the live target over prompt + response and
scores an anchor at every response position. With every eligible anchor sampled, both must count the same blocks and
the same leading matches: a gap between a run's val tau_offline and its eval tau_offline is then a gap between the
texts they score (docs/training.md), never between two ways of counting. scripts/tau_offline_texts.py, which
measures that split on a run, reports the same two sums."""
import importlib.util
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from tiny_targets import make_tiny_target, write_jsonl

from dflash_fast.data.batches import row_batches
from dflash_fast.data.config import DataConfig
from dflash_fast.drafter.model import build_drafter, slot_metrics
from dflash_fast.evaluate.decode import TargetRunner
from dflash_fast.evaluate.evaluate import offline_tau
from dflash_fast.extract.extract import extract
from dflash_fast.serve.export import export_drafter
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.target.prompts import load_model
from dflash_fast.train.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "tau_offline_texts.py")
spec = importlib.util.spec_from_file_location("tau_offline_texts", SCRIPT)
tau_offline_texts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tau_offline_texts)

LAYER_IDS = [1, 2]
SEQ_LEN = 64
ANCHORS = SEQ_LEN - 1  # a row's most: every eligible anchor is drawn
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
    return SimpleNamespace(target=str(target), store=HiddenStateStore(str(root / "store")), root=root,
                           prompts=str(root / "data.jsonl"))


def test_val_tau_offline_equals_evals_offline_tau_on_the_same_documents(tiny):
    batches = row_batches(tiny.store, DataConfig(seq_len=SEQ_LEN, num_anchors=ANCHORS, batch_rows=2, **SPLIT), 0,
                          split="val", with_last=True)
    val = [batches[s] for s in range(len(batches))]
    for b in val:  # every eligible anchor is drawn (spec.md §3: a and a + 1 trained, in one document)
        m, doc = b["loss_mask"], b["document_ids"]
        eligible = (m[:, :-1] & m[:, 1:] & (doc[:, :-1] == doc[:, 1:])).sum(-1)
        assert torch.equal(b["anchor_valid"].sum(-1), eligible)
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

    run = tiny.root / "run"  # the script on a run of this store and drafter reports the same two sums
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), [
        f"data.store={tiny.store.path}", f"model.target={tiny.target}", f"data.seq_len={SEQ_LEN}",
        f"data.num_anchors={ANCHORS}", "data.batch_rows=2", f"data.val_fraction={SPLIT['val_fraction']}",
        f"data.split_seed={SPLIT['split_seed']}", "model.mask_token_id=383", f"output_dir={run}"])
    os.makedirs(run)
    with open(run / "config.yaml", "w") as f:
        yaml.safe_dump(cfg.to_dict(), f)
    export_drafter(drafter, str(run / "export"), verifier=tiny.target, dtype=torch.float32)
    result = tau_offline_texts.measure(str(run), tiny.prompts, max_new_tokens=8, num_prompts=2)
    json.dumps(result)
    assert result["val_trainer"]["blocks"] == trainer[1]
    assert result["val_trainer"]["tau_offline"] == pytest.approx(trainer[0] / trainer[1])
    assert result["val_documents"]["blocks"] == evaluated[1] and result["val_documents"]["skipped"] == 0
    assert result["val_documents"]["tau_offline"] == pytest.approx(evaluated[0] / evaluated[1])
    assert [d["document"] for d in result["val_documents"]["per_document"]] == documents
    assert result["prompts"]["prompts"] == 2 and result["prompts"]["blocks"] > 0
    # `seen`: of reply tokens 2, 3, 4 after prompt 1, the 3-gram ending at 3 is a training one, the one at 4 is not
    assert tau_offline_texts.seen_fraction({(1, 2, 3)}, [1], [2, 3, 4], 3) == 0.5
