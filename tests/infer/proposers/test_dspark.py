"""DSpark served through the engine: the Markov bias and the confidence head against a plain
torch chain, greedy output equal to plain decoding, the sampled output law equal to the
target's, and the checkpoint's round trip in the speculators layout."""

import json

import numpy as np
import pytest
import torch

from infer.drafters.dspark import DSparkConfig, DSparkDrafter
from infer.engine import LLM
from infer.proposers.base import DraftBatch
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig

from ..test_engine_sampling import K, chi2_pvalue, exact_laws, sample
from .test_dflash import PROMPTS, check_greedy, target4  # noqa: F401 (a fixture)
from .test_dflash import save_head as save_dflash_head

pytestmark = pytest.mark.usefixtures("single_thread")


def save_head(target_dir, path, **kwargs) -> str:
    """A random DSpark drafter (rank 8) whose Markov bias is large enough to change drafts."""
    def strong_bias(drafter):
        drafter.markov_head.markov_w2.weight.mul_(10)
    return save_dflash_head(target_dir, path, kind=DSparkDrafter, edit=strong_bias,
                            markov_rank=8, **kwargs)


@pytest.fixture(scope="module")
def heads(target4, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    return {"full": save_head(target4, root / "full"),
            "reduced": save_head(target4, root / "reduced", vocab_ids=list(range(0, 96, 2))),
            "plain_confidence": save_head(target4, root / "plain",
                                          confidence_head_with_markov=False)}


@pytest.mark.parametrize("head", ["full", "reduced", "plain_confidence"])
def test_drafts_and_confidences_equal_a_plain_torch_chain(target4, heads, head):
    """From the block's hidden states: slot i's logits = lm_head(h_i) + W2 W1[prev_i] with
    prev_1 the pending token and prev_i the draft before; conf_i = sigmoid(w . [h_i; e_i] + b)."""
    llm = LLM(target4, max_num_seqs=1, speculative_config={
        "model": heads[head], "num_speculative_tokens": 4, "enable_adaptive_verification": True})
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1))  # prefill
    prop, tokens = llm.proposer, PROMPTS[0] + [1]
    prop.prefilled([0], [len(PROMPTS[0])], llm.target.model(
        torch.tensor([PROMPTS[0]]), _fresh(llm), aux_layer_ids=prop.feature_spec().aux_layer_ids))
    batch = DraftBatch([0], [tokens], 4)
    got = prop.propose(batch)
    d = prop.drafter
    h = prop.block_hidden(batch)[0]  # [K, H]
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight  # [V, r], [Vd, r]
    proj = d.confidence_head.proj
    prev, drafts, conf = tokens[-1], [], []
    for i in range(4):
        logits = d.logits(h[i]) + w2 @ w1[prev]  # [Vd]
        x = torch.cat([h[i], w1[prev]]) if d.config.confidence_head_with_markov else h[i]
        conf.append(torch.sigmoid(proj.weight[0].float() @ x.float() + proj.bias.float()[0]))
        prev = int(d.to_target_ids(logits.argmax()))
        drafts.append(prev)
    assert got.draft_ids[0].tolist() == drafts
    torch.testing.assert_close(got.confidence[0], torch.stack(conf), atol=1e-5, rtol=1e-4)
    unbiased = d.to_target_ids(d.logits(h).argmax(-1)).tolist()
    if head == "full":
        assert drafts != unbiased  # the Markov head changed what is drafted


@pytest.mark.parametrize("head", ["full", "reduced"])
@pytest.mark.parametrize("k,max_num_seqs,adaptive", [(1, 4, False), (3, 2, False),
                                                     (4, 4, True)])
def test_greedy_equals_autoregressive(target4, heads, head, k, max_num_seqs, adaptive,
                                      monkeypatch):
    check_greedy(target4, heads[head], k, max_num_seqs, adaptive, monkeypatch, "dspark")


def test_checkpoint_round_trip_in_the_speculators_layout(heads):
    path = heads["reduced"]
    raw = json.loads(open(f"{path}/config.json").read())
    assert raw["speculators_model_type"] == "dspark"
    assert raw["architectures"] == ["Qwen3DSparkModel"]
    assert raw["speculators_config"]["algorithm"] == "dspark"
    assert (raw["markov_rank"], raw["markov_head_type"], raw["enable_confidence_head"]) == (
        8, "vanilla", True)
    loaded = DSparkDrafter.from_pretrained(path)
    written = {k: v for k, v in raw.items() if k != "torch_dtype"}  # write_checkpoint's
    assert DSparkConfig.from_dict(raw).to_dict() == written == loaded.config.to_dict()
    names = set(loaded.state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias", "d2t"} <= names
    assert loaded.markov_head.markov_w2.weight.shape == (48, 8)  # [draft vocab, r]
    assert loaded.markov_head.markov_w1.weight.shape == (96, 8)  # [target vocab, r]
    spec = SpeculativeConfig.parse({"model": path})
    assert (spec.method, spec.num_speculative_tokens, spec.parallel_drafting) == ("dspark", 4,
                                                                                   False)


@pytest.fixture(scope="module")
def sampling_models(make_tiny_llama, tmp_path_factory):
    target = make_tiny_llama("dspark_sampling_target", vocab=8, layers=2, seed=3, std=0.15)
    head = save_head(target, tmp_path_factory.mktemp("dspark_sampling") / "h", block=3,
                     std=0.15)
    return target, head


@pytest.mark.parametrize("method", ["probabilistic", "block"])
def test_output_distribution_matches_target(sampling_models, method):
    """The engine's chi-square test (tests/infer/test_engine_sampling.py) with DSpark's sampled
    drafts: each slot drawn from its Markov-corrected law, which the sampler is handed."""
    target, head = sampling_models
    spec = {"model": head, "num_speculative_tokens": K, "rejection_sample_method": method,
            "draft_sample_method": "probabilistic"}
    joint, third, metrics = sample(target, spec)
    p_joint, p_third = exact_laws(target, 1.0, None, None)
    assert chi2_pvalue(joint, p_joint) > 1e-3 and chi2_pvalue(third, p_third) > 1e-3
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics
    assert np.asarray(joint).sum() > 0


def _fresh(llm):
    from infer.kv_cache import KVCache
    return KVCache.for_model(llm.target.model.config, 1, 64)
