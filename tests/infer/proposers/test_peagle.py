"""P-EAGLE through the engine: mask rows appended by hand-checked rule, greedy output identical to
plain decoding, sampled output distributed as the target's, K above the depths trained refused."""

from types import SimpleNamespace

import pytest
import torch

from infer.drafters.eagle3 import Eagle3Config
from infer.drafters.peagle import PEagleConfig, PEagleDrafter
from infer.engine import LLM
from infer.models.loader import load_config
from infer.proposers.peagle import PEagleProposer
from infer.sampling import SamplingParams

from ..conftest import save_tiny_llama
from .conftest import check_cuda_graph_drafts, check_static_drafts
from ..test_engine_sampling import K, chi2_pvalue, exact_laws, sample

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[3, 5, 7, 9, 11, 13], [20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]


def save_head(target, path, *, depths=4, aux=None, vocab_ids=None, seed=1, num_layers=1):
    """A random P-EAGLE head for ``target`` trained (nominally) for ``depths`` drafts."""
    cfg = load_config(target)
    base = Eagle3Config.for_target(cfg, draft_vocab_size=len(vocab_ids) if vocab_ids is not None
                                   else cfg.vocab_size, aux_layer_ids=aux,
                                   num_layers=num_layers)
    values = {k: getattr(base, k) for k in base.__dataclass_fields__}
    config = PEagleConfig(**{**values, "speculative_tokens": depths},
                          mask_token_id=cfg.vocab_size - 1)
    torch.manual_seed(seed)
    head = PEagleDrafter(config, with_embedding=True)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    if vocab_ids is not None:
        head.set_vocab(vocab_ids)
    return str(head.save_pretrained(path))


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("t4"), layers=4, seed=5)


@pytest.fixture(scope="module")
def head(target4, tmp_path_factory):
    return save_head(target4, tmp_path_factory.mktemp("peagle") / "h",
                     vocab_ids=torch.arange(0, 96, 2))


def test_mask_rows_by_hand():
    fake = SimpleNamespace(mask_id=9, mask_feature=torch.tensor([7.0, 7.0]))
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])  # row 1: one catch-up pair, right-padded
    feats = torch.arange(12.0).view(2, 3, 2)
    ids2, feats2, n, last = PEagleProposer.with_mask_rows(fake, ids, feats, [3, 1], 3)
    assert ids2.tolist() == [[1, 2, 3, 9, 9], [4, 9, 9, 0, 0]]
    assert feats2[0, 3:].tolist() == [[7, 7], [7, 7]] and feats2[1, 1:3].tolist() == [[7, 7]] * 2
    assert torch.equal(feats2[0, :3], feats[0]) and feats2[1, 3:].abs().sum() == 0
    assert n.tolist() == [5, 3]
    assert last.tolist() == [[2, 3, 4], [0, 1, 2]]  # the last real row + the mask rows


@pytest.mark.parametrize("k,max_num_seqs", [(1, 4), (3, 2), (4, 4)])
def test_greedy_equals_autoregressive(target4, head, k, max_num_seqs):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k,
            "parallel_drafting": True}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=max_num_seqs)
    assert isinstance(llm.proposer, PEagleProposer)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] > 0


def test_checkpoint_alone_selects_peagle_and_k(target4, head):
    llm = LLM(target4, speculative_config={"model": head})
    assert isinstance(llm.proposer, PEagleProposer) and llm.proposer.k == 4


def test_k_above_depths_trained_is_refused(target4, head):
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 5,
            "parallel_drafting": True}
    with pytest.raises(ValueError, match=r"num_speculative_tokens.*5.*at most 4"):
        LLM(target4, speculative_config=spec)


def test_probabilistic_drafts_run(target4, head):
    spec = {"model": head, "num_speculative_tokens": 3,
            "rejection_sample_method": "probabilistic"}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10))
    assert all(len(o.token_ids) == 10 for o in outs)
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("draft_sample", ["probabilistic", "greedy"])
def test_output_distribution_matches_target(make_tiny_llama, tmp_path, draft_sample):
    """test_engine_sampling's chi-square test with a P-EAGLE head (2-layer target: aux ids
    0, 1, 2): tokens 2 and 3 come from the first one-forward draft step."""
    target = make_tiny_llama("sampling_target", vocab=8, seed=3, std=0.15)
    path = save_head(target, tmp_path / "h", depths=K, aux=[0, 1, 2], seed=6)
    spec = {"method": "eagle3", "model": path, "num_speculative_tokens": K,
            "parallel_drafting": True, "rejection_sample_method": "standard",
            "draft_sample_method": draft_sample}
    joint, third, metrics = sample(target, spec)
    p_joint, p_third = exact_laws(target, 1.0, None, None)
    assert chi2_pvalue(joint, p_joint) > 1e-3 and chi2_pvalue(third, p_third) > 1e-3
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics


@pytest.mark.parametrize("k", [2, 4])
def test_two_layer_head_greedy_equals_autoregressive(target4, tmp_path, k):
    """A speculators-style multi-layer P-EAGLE head (EAGLE-3 layer + a Llama layer): the one
    forward over catch-up pairs and mask rows runs both layers; greedy output is the target's."""
    head2 = save_head(target4, tmp_path / "h2", vocab_ids=torch.arange(1, 96, 2), seed=4,
                      num_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target4, max_num_seqs=2).generate(PROMPTS, params)
    llm = LLM(target4, speculative_config={"model": head2, "num_speculative_tokens": k},
              max_num_seqs=2)
    assert isinstance(llm.proposer, PEagleProposer) and len(llm.proposer.drafter.layers) == 2
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [b.token_ids for b in base]
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("k, synthetic", [(2, None), (4, None), (3, 0.6)])
def test_static_path_drafts_what_the_plain_forward_drafts(target4, head, k, synthetic,
                                                          monkeypatch):
    """The one forward in fixed shapes (CUDA graphs on CUDA) drafts what the plain one does."""
    check_static_drafts(target4, {"model": head, "num_speculative_tokens": k}, PROMPTS,
                        monkeypatch, synthetic)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_drafts_equal_eager_drafts(target4, head):
    check_cuda_graph_drafts(target4, {"model": head, "num_speculative_tokens": 3}, PROMPTS)
