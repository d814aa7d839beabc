"""LiLiCorr's head against vLLM 0.32's own (`vllm/model_executor/models/lilicorr.py` LiLiCorrHead, the candidates of
`LiLiCorrForCausalLM.compute_candidates`, the walk of `spec_decode/dflash2` CandidateSampler) on identical weights,
fp32, on the CPU: start and pair scores, the walk table, the candidates and their log-probabilities, the greedy walk,
for several K, block sizes, slot counts (B - 1 and the shorter drafts vLLM serves) and batch rows; and our exports
(the zlab layout as LiLiCorrDraftModel, with and without DFlash2's convolutions) built and loaded by vLLM itself (its
config loader, registry and LiLiCorrForCausalLM.load_weights) scoring and walking as the trained drafter. vLLM runs
in a process of its own (tests/vllm_lilicorr_on_cpu.py: its walk kernel in Triton's interpreter).

Runs where vLLM is installed (.ci/run's second venv, docs/vllm.md); DFLASH_REQUIRE_VLLM=1 turns the skip into a
failure there."""
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from test_drafter import small_config  # noqa: E402

from dflash_fast.drafter.lilicorr import LiLiCorrHead, lilicorr_walk, walk  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_KEYS = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_heads", "lilicorr_num_layers",
             "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")
# (K, block size, slots drafted, batch rows, lattice width: 0 = the drafter's 32)
CASES = [(4, 5, 4, 3, 16), (2, 6, 3, 1, 0), (8, 4, 3, 2, 16), (1, 5, 2, 4, 16), (16, 3, 2, 2, 0), (4, 7, 1, 5, 24),
         (2, 8, 7, 2, 16)]
CANDIDATE_K = (2, 8)  # the candidates against vLLM's LogitsProcessor, and lilicorr_walk on them
# Exports of drafters for the embedded target, read back by vLLM: (id, DFlash2's convolutions, slots drafted)
EXPORTS = [("dflash", {}, 4), ("dflash2-convolutions", dict(conv_kernel_size=2, conv_group_size=16), 2)]


def our_head(k, block_size, width, seed):
    """Our head with random weights far from its init, and its config."""
    cfg = small_config(block_size=block_size, lilicorr_candidate_topk=k, lilicorr_hidden_size=width,
                       lilicorr_num_heads=2, lilicorr_num_layers=2, lilicorr_mlp_ratio=1.5, lilicorr_factor_dim=8,
                       lilicorr_logit_scale=7.0)
    torch.manual_seed(seed)
    head = LiLiCorrHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    return head.eval(), cfg


def vllm_case(head, cfg, inputs, **extra):
    return dict(config={key: getattr(cfg, key) for key in VLLM_KEYS}, model_hidden_size=cfg.hidden_size,
                block_size=cfg.block_size, rms_norm_eps=cfg.rms_norm_eps, state=head.state_dict(), inputs=inputs,
                **extra)


def lattice_inputs(cfg, slots, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    k, h = cfg.lilicorr_candidate_topk, cfg.hidden_size
    return (torch.randn(rows, slots, k, h, generator=gen),
            torch.randn(rows, slots, 40, generator=gen).log_softmax(-1).topk(k, -1).values,
            torch.randn(rows, slots, h, generator=gen), torch.randn(rows, h, generator=gen),
            torch.rand(rows, generator=gen) > 0.3)


def exported_drafter(tmp, name, conv, seed):
    """A LiLiCorr drafter for the embedded target, its weights far from their init, exported (zlab, fp32, gated)."""
    from transformers import AutoConfig

    from dflash_fast.drafter.config import DrafterConfig
    from dflash_fast.drafter.model import DFlashDrafter
    from dflash_fast.evaluate.quickstart import TARGET
    from dflash_fast.serve.export import export_drafter

    target = AutoConfig.from_pretrained(TARGET)
    cfg = DrafterConfig.from_target(target, [0, 3], target.vocab_size - 1, num_layers=1, block_size=5,
                                    lilicorr_candidate_topk=4, lilicorr_hidden_size=32, lilicorr_num_heads=2,
                                    lilicorr_factor_dim=8, lilicorr_mlp_ratio=1.5, lilicorr_logit_scale=7.0, **conv)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    return drafter, export_drafter(drafter, str(tmp / name), TARGET, torch.float32, fmt="zlab"), TARGET


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Our heads (or exported drafters) and inputs, and vLLM's outputs on them (one process for every case)."""
    tmp = tmp_path_factory.mktemp("lilicorr")
    ours, cases = [], []
    for i, (k, block_size, slots, rows, width) in enumerate(CASES):
        head, cfg = our_head(k, block_size, width, seed=i)
        inputs = lattice_inputs(cfg, slots, rows, seed=100 + i)
        ours.append((head, inputs))
        cases.append(vllm_case(head, cfg, inputs))
    for i, k in enumerate(CANDIDATE_K):
        head, cfg = our_head(k, 5, 16, seed=50 + i)
        gen = torch.Generator().manual_seed(200 + i)
        v, h, s = cfg.vocab_size, cfg.hidden_size, cfg.block_size - 1
        extra = dict(lm_head=torch.randn(v, h, generator=gen), embed=torch.randn(v, h, generator=gen),
                     hidden=torch.randn(s, h, generator=gen), anchor=torch.randn(h, generator=gen))
        ours.append((head, extra))
        cases.append(vllm_case(head, cfg, lattice_inputs(cfg, s, 1, seed=300 + i), **extra))
    for i, (name, conv, slots) in enumerate(EXPORTS):
        drafter, export, target = exported_drafter(tmp, name, conv, seed=400 + i)
        inputs = lattice_inputs(drafter.config, slots, 3, seed=500 + i)
        ours.append((drafter, export, inputs))
        cases.append(dict(export=export, target=target, drafted=drafter.config.block_size - 1, inputs=inputs))
    torch.save(cases, tmp / "cases.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_lilicorr_on_cpu.py"), str(tmp / "cases.pt"),
                           str(tmp / "out.pt")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return ours, torch.load(tmp / "out.pt")


def assert_scores_and_walk_as_vllms(head, inputs, want):
    """`head`'s start and pair scores, walk table and greedy walk on `inputs` equal vLLM's (`want`)."""
    with torch.no_grad():
        start, pair = head.scores(*inputs)
        table = head.walk_scores(*inputs)
    torch.testing.assert_close(start, want["start"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pair, want["pair"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table, want["table"], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.stack([walk(t) for t in table]), want["walk"])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"K{c[0]}-B{c[1]}-S{c[2]}-R{c[3]}-W{c[4]}" for c in CASES])
def test_our_head_scores_and_walks_as_vllms(served, case):
    (head, inputs), want = served[0][case], served[1][case]
    assert_scores_and_walk_as_vllms(head, inputs, want)


@pytest.mark.parametrize("i", range(len(CANDIDATE_K)), ids=[f"K{k}" for k in CANDIDATE_K])
def test_our_candidates_and_drafts_are_vllms(served, i):
    """The candidates and their log-probabilities: the raw log-softmax top-K of the lm_head (vLLM's
    `get_top_k_tokens(..., return_log_probs=True)`), and what `lilicorr_walk` drafts from them, vLLM's walk's."""
    (head, extra), want = served[0][len(CASES) + i], served[1][len(CASES) + i]
    k = head.top_k
    logits = extra["hidden"] @ extra["lm_head"].T
    mine = torch.log_softmax(logits, -1).topk(k, -1)
    assert torch.equal(mine.indices, want["ids"])
    torch.testing.assert_close(mine.values, want["log_probs"], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        drafted = lilicorr_walk(head, extra["anchor"], extra["hidden"], logits, extra["embed"])
    assert torch.equal(drafted, want["drafted"])


@pytest.mark.parametrize("i", range(len(EXPORTS)), ids=[e[0] for e in EXPORTS])
def test_vllm_builds_and_loads_our_lilicorr_export_and_scores_and_walks_as_the_trained_drafter(served, i):
    """vLLM reads our export as LiLiCorrDraftModel (its registry's LiLiCorrForCausalLM, every lattice tensor through
    its loader and coverage check, the fields of dflash_config as written), and the head it loaded scores and walks
    identical lattices as the trained drafter's head, and as the drafter our loader reads back from the export."""
    from dflash_fast.serve.export import load_exported

    (drafter, export, inputs), want = served[0][len(CASES) + len(CANDIDATE_K) + i], served[1][len(CASES) +
                                                                                           len(CANDIDATE_K) + i]
    cfg = drafter.config
    assert want["architectures"] == ["LiLiCorrDraftModel"] and want["model_class"] == "LiLiCorrForCausalLM"
    assert {key: want["dflash_config"][key] for key in VLLM_KEYS} == {key: getattr(cfg, key) for key in VLLM_KEYS}
    for head in (drafter.lilicorr, load_exported(export).lilicorr):
        assert_scores_and_walk_as_vllms(head, inputs, want)
