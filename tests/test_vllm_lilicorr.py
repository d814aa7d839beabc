"""LiLiCorr's head against vLLM 0.32's own (`vllm/model_executor/models/lilicorr.py` LiLiCorrHead, the candidates of
`LiLiCorrForCausalLM.compute_candidates`, the walk of `spec_decode/dflash2` CandidateSampler) on identical weights,
fp32, on the CPU: start and pair scores, the walk table, the candidates and their log-probabilities, the greedy walk,
for several K, slot counts (B - 1 and the shorter drafts vLLM serves) and batch rows.

Runs where vLLM is installed (.ci/run's second venv, docs/vllm.md); DFLASH_REQUIRE_VLLM=1 turns the skip into a
failure there."""
import os

import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from test_drafter import small_config  # noqa: E402

from dflash_fast.drafter.lilicorr import LiLiCorrHead, lilicorr_walk, walk  # noqa: E402

VLLM_KEYS = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_heads", "lilicorr_num_layers",
             "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")


@pytest.fixture(scope="module")
def vllm_context(tmp_path_factory):
    """vLLM's config context and a one-rank model-parallel group (its parallel linears read the TP size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    init_file = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(VllmConfig()):
        started = not torch.distributed.is_initialized()
        if started:
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                        distributed_init_method=f"file://{init_file}",
                                                        backend="gloo")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        yield
        if started:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def heads(k, block_size, hidden_size, seed):
    """Ours (random weights, far from init) and vLLM's with our state dict loaded as its loader maps it."""
    from vllm.model_executor.models.lilicorr import LiLiCorrHead as VllmHead

    cfg = small_config(block_size=block_size, lilicorr_candidate_topk=k, lilicorr_hidden_size=hidden_size,
                       lilicorr_num_heads=2, lilicorr_num_layers=2, lilicorr_mlp_ratio=1.5, lilicorr_factor_dim=8,
                       lilicorr_logit_scale=7.0)
    torch.manual_seed(seed)
    ours = LiLiCorrHead(cfg)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    config = {key: getattr(cfg, key) for key in VLLM_KEYS}
    theirs = VllmHead(model_hidden_size=cfg.hidden_size, block_size=block_size, rms_norm_eps=cfg.rms_norm_eps,
                      config=config)
    state = ours.state_dict()
    missing = {n for n, _ in theirs.named_parameters()} - set(state)
    assert missing == set(), f"vLLM's head has parameters ours lacks: {sorted(missing)}"
    theirs.load_state_dict(state, strict=True)
    theirs.materialize_inference_buffers(torch.device("cpu"), torch.float32)
    return ours.eval(), theirs.eval(), cfg


@pytest.mark.parametrize("k, block_size, slots, rows, width", [
    (4, 5, 4, 3, 16), (2, 6, 3, 1, 0), (8, 4, 3, 2, 16), (1, 5, 2, 4, 16), (16, 3, 2, 2, 0), (4, 7, 1, 5, 24),
])
@pytest.mark.usefixtures("vllm_context")
def test_our_head_scores_and_walks_as_vllms(k, block_size, slots, rows, width):
    ours, theirs, cfg = heads(k, block_size, width, seed=k * 10 + block_size)
    gen = torch.Generator().manual_seed(1)
    h = cfg.hidden_size
    emb = torch.randn(rows, slots, k, h, generator=gen)
    log_probs = torch.randn(rows, slots, 40, generator=gen).log_softmax(-1).topk(k, -1).values
    pass_hidden, anchor = torch.randn(rows, slots, h, generator=gen), torch.randn(rows, h, generator=gen)
    valid = torch.rand(rows, generator=gen) > 0.3
    with torch.no_grad():
        start, pair = ours.scores(emb, log_probs, pass_hidden, anchor, valid)
        want_start, want_pair = theirs.score(token_embeddings=emb, candidate_log_probs=log_probs,
                                             pass_hidden=pass_hidden, anchor_hidden=anchor, anchor_valid=valid)
        table = ours.walk_scores(emb, log_probs, pass_hidden, anchor, valid)
        want_table = theirs(emb, log_probs, pass_hidden, anchor, valid)
    torch.testing.assert_close(start, want_start, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pair, want_pair, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table, want_table, rtol=1e-5, atol=1e-5)
    for r in range(rows):
        assert torch.equal(walk(table[r]), vllm_walk(want_table[r]))


def vllm_walk(table):
    """vLLM's greedy walk (`_selector_walk_kernel` at temperature 0: `previous = 0`, then the row out of the index
    chosen before, its first maximum), run by its own Triton kernel (the interpreter on the CPU) where it imports."""
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    s, k, _ = table.shape
    sampler = CandidateSampler(1, s, k, torch.device("cpu"))
    ids = torch.arange(s * k).view(1, s, k)
    tokens = torch.zeros(1, s, dtype=torch.int64)
    sampler.sample(ids, table[None].contiguous(), 1, torch.arange(1, s + 1, dtype=torch.int64).view(1, s),
                   torch.zeros(1, s, dtype=torch.int32), torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                   tokens, None, False)
    return (tokens[0] % k).long()


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.usefixtures("vllm_context")
def test_our_candidates_are_vllms(k):
    """The candidates and their log-probabilities: the raw log-softmax top-K of the lm_head (vLLM's
    `LogitsProcessor.get_top_k_tokens(..., return_log_probs=True)`), and the walk of `lilicorr_walk` on them."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    ours, theirs, cfg = heads(k, 5, 16, seed=3)
    v, h, s = cfg.vocab_size, cfg.hidden_size, cfg.block_size - 1
    gen = torch.Generator().manual_seed(4)
    lm_head, embed = torch.randn(v, h, generator=gen), torch.randn(v, h, generator=gen)
    hidden, anchor = torch.randn(s, h, generator=gen), torch.randn(h, generator=gen)
    head = ParallelLMHead(v, h)
    head.weight.data[:v].copy_(lm_head)
    ids, log_probs = LogitsProcessor(v).get_top_k_tokens(head, hidden, k, return_log_probs=True)
    mine = torch.log_softmax(hidden @ lm_head.T, -1).topk(k, -1)
    assert torch.equal(mine.indices, ids)
    torch.testing.assert_close(mine.values, log_probs, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        drafted = lilicorr_walk(ours, anchor, hidden, hidden @ lm_head.T, embed)
        table = theirs(embed[ids][None], log_probs[None], hidden[None], anchor[None], torch.ones(1, dtype=torch.bool))
    assert torch.equal(drafted, ids.gather(1, vllm_walk(table[0])[:, None])[:, 0])
