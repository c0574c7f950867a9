"""DFlash served through the engine: greedy output equals plain decoding (batch sizes, k,
reduced vocabulary), the sampled output law equals the target's, K beyond the trained block is a
config error, and the block's keys never stay in the draft cache."""

import numpy as np
import pytest
import torch

from infer.drafters.dflash import DFlashDrafter
from infer.engine import LLM
from infer.foundation.errors import ConfigError
from infer.models.loader import load_config
from infer.sampling import SamplingParams

from ..conftest import price_verification, save_tiny_llama
from .conftest import check_cuda_graph_drafts, check_static_drafts
from ..test_engine_sampling import K, N, PROMPT, chi2_pvalue, exact_laws, sample

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[3, 5, 7, 9, 11, 13], [20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]


def save_head(target_dir, path, *, vocab_ids=None, block=5, seed=1, std=0.3,
              kind=DFlashDrafter, edit=None, **settings) -> str:
    """A random ``kind`` drafter (DFlash, or DSpark with its ``settings``) for ``target_dir``;
    ``edit(drafter)`` changes its weights before it is saved."""
    cfg = load_config(target_dir)
    config = kind.CONFIG.for_target(cfg, num_layers=2, mask_token_id=cfg.vocab_size - 1,
                                    block_size=block, aux_layer_ids=[1, cfg.num_layers],
                                    draft_vocab_size=None if vocab_ids is None
                                    else len(vocab_ids), **settings)
    drafter = kind(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, std if p.ndim > 1 else 0.1)
        if edit is not None:
            edit(drafter)
    if vocab_ids is not None:
        drafter.set_vocab(torch.tensor(vocab_ids))
    drafter.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("t4"), layers=4, seed=5)


@pytest.fixture(scope="module")
def heads(target4, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    return {"full": save_head(target4, root / "full"),
            "reduced": save_head(target4, root / "reduced", vocab_ids=list(range(0, 96, 2)))}


@pytest.mark.parametrize("head", ["full", "reduced"])
@pytest.mark.parametrize("k,max_num_seqs,adaptive", [(1, 4, False), (3, 2, False),
                                                     (4, 4, False), (4, 4, True)])
def test_greedy_equals_autoregressive(target4, heads, head, k, max_num_seqs, adaptive,
                                      monkeypatch):
    check_greedy(target4, heads[head], k, max_num_seqs, adaptive, monkeypatch, "dflash")


def check_greedy(target, head, k, max_num_seqs, adaptive, monkeypatch, method) -> None:
    """``head`` served with k drafts (the method inferred from its checkpoint, ``method``)
    outputs what plain greedy decoding does, and drafted."""
    if adaptive:
        price_verification(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = {"model": head, "num_speculative_tokens": k,
            "enable_adaptive_verification": adaptive}
    llm = LLM(target, speculative_config=spec, max_num_seqs=max_num_seqs)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.spec.method == method and llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("head, k, synthetic", [("full", 2, None), ("reduced", 4, None),
                                                ("full", 3, 0.6)])
def test_static_path_drafts_what_the_plain_forward_drafts(target4, heads, head, k, synthetic,
                                                          monkeypatch):
    """The block forward in fixed shapes (CUDA graphs on CUDA) drafts what the plain one does."""
    check_static_drafts(target4, {"model": heads[head], "num_speculative_tokens": k}, PROMPTS,
                        monkeypatch, synthetic)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_drafts_equal_eager_drafts(target4, heads):
    check_cuda_graph_drafts(target4, {"model": heads["reduced"], "num_speculative_tokens": 3},
                            PROMPTS)


def test_k_defaults_to_block_minus_one_and_more_is_refused(target4, heads):
    llm = LLM(target4, speculative_config={"model": heads["full"]})
    assert llm.k == 4  # block_size 5
    with pytest.raises(ConfigError, match="num_speculative_tokens.*at most 4"):
        LLM(target4, speculative_config={"model": heads["full"], "num_speculative_tokens": 5})
    llm = LLM(target4, speculative_config={"model": heads["full"], "method": "dflash",
                                           "parallel_drafting": True})
    assert llm.proposer.parallel_drafting


def test_block_keys_do_not_stay(target4, heads):
    """Drafting twice from the same state gives the same drafts and leaves the cache length
    at the verified context (the block is written past it, never counted)."""
    llm = LLM(target4, speculative_config={"model": heads["full"], "num_speculative_tokens": 4},
              max_num_seqs=1)
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=5))
    prop = llm.proposer
    from infer.proposers.base import DraftBatch
    prop.prefilled([0], [6], llm.target.model(torch.tensor([PROMPTS[0]]), _fresh(llm),
                                              aux_layer_ids=prop.feature_spec().aux_layer_ids))
    batch = DraftBatch([0], [PROMPTS[0] + [1]], 4)
    first = prop.propose(batch).draft_ids
    assert int(prop.cache.lens[0]) == 6
    assert torch.equal(prop.propose(batch).draft_ids, first)


def _fresh(llm):
    from infer.kv_cache import KVCache
    return KVCache.for_model(llm.target.model.config, 1, 64)


@pytest.fixture(scope="module")
def sampling_models(make_tiny_llama, tmp_path_factory):
    target = make_tiny_llama("dflash_sampling_target", vocab=8, layers=2, seed=3, std=0.15)
    head = save_head(target, tmp_path_factory.mktemp("dflash_sampling") / "h", block=3,
                     std=0.15)
    return target, head


@pytest.mark.parametrize("method", ["probabilistic", "strict"])
def test_output_distribution_matches_target(sampling_models, method):
    """The engine's chi-square test (tests/infer/test_engine_sampling.py) with DFlash drafts."""
    target, head = sampling_models
    spec = {"model": head, "num_speculative_tokens": K, "rejection_sample_method": method}
    joint, third, metrics = sample(target, spec)
    p_joint, p_third = exact_laws(target, 1.0, None, None)
    assert chi2_pvalue(joint, p_joint) > 1e-3 and chi2_pvalue(third, p_third) > 1e-3
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics
    assert np.asarray(joint).sum() == N and len(PROMPT) == 5


def test_k_by_batch_size_drafts_a_shorter_block(target4, heads):
    """The block drafts this step's k (k by batch size), not the configured most: 4 alone, 1
    beside another request, none at 3-4; greedy output stays the plain one."""
    spec = {"model": heads["full"], "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 2, 1], [3, 4, 0]]}
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (5, 9, 13, 20)]
    llm = LLM(target4, speculative_config=spec, max_num_seqs=4)
    widths, propose = [], llm.proposer.propose

    def spy(batch):
        proposal = propose(batch)
        widths.append((len(batch.slots), proposal.draft_ids.shape[1]))
        return proposal

    llm.proposer.propose = spy
    base = LLM(target4, max_num_seqs=4).generate(PROMPTS, params)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [b.token_ids for b in base]
    assert set(widths) == {(1, 4), (2, 1)}
