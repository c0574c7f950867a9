"""``method: mtp`` through the engine (MiMo targets, ``infer/proposers/mtp.py``): greedy output
equals plain decoding, every draft equals the MTP chain recomputed from scratch, a target whose
MTP layer predicts well gets drafts accepted (and partly rejected: rollback), sampled output is
distributed as the target's, and vLLM's rules for k, aliases and targets without MTP layers."""

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.drafters.mtp import MTPDrafter
from infer.engine import LLM
from infer.foundation.errors import ConfigError
from infer.proposers.mtp import MTPProposer
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig

from ..conftest import ENGINE_PROMPTS, save_tiny_mimo
from ..drafters.test_mtp import hf_qwen2
from ..test_engine_sampling import P_MIN, K, chi2_pvalue, exact_laws, sample

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def save_predictive_mimo(path, *, noise=0.004, seed=0):
    """A MiMo target whose MTP layer predicts it well. The body's attention and MLP outputs are
    scaled down to ``noise`` (o_proj / down_proj), so the target is almost a bigram model:
    next = f(current token) = argmax lm_head(norm(embed(token))). The MTP layer computes exactly
    that f of its input token: input_proj = [0 | I] (the hidden half ignored), o_proj and
    down_proj zero (the decoder layer is the identity), token_layernorm 1 and final_layernorm =
    the body's final norm weight, so lm_head(o) = lm_head(norm(embed(x_{t+1}))) predicts x_{t+2}.
    ``noise`` 0: every draft is accepted except after position 0 (vLLM zeroes the embedding
    there); 0.004: roughly half are (partial acceptance, so rollback runs)."""
    path = save_tiny_mimo(path, seed=seed, std=0.5)
    file = Path(path) / "model.safetensors"
    w = load_file(str(file))
    g = torch.Generator().manual_seed(seed + 100)
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = (torch.zeros(w[name].shape) if name.startswith("model.mtp_layers.")
                       else torch.randn(w[name].shape, generator=g) * noise)
    p, h = "model.mtp_layers.0.", w["model.embed_tokens.weight"].shape[1]
    w[p + "input_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    w[p + "token_layernorm.weight"] = torch.ones(h)
    w[p + "final_layernorm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def predictive(tmp_path_factory):
    return save_predictive_mimo(tmp_path_factory.mktemp("mimo_pred"))


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    return save_predictive_mimo(tmp_path_factory.mktemp("mimo_bigram"), noise=0.0)


@pytest.fixture(scope="module")
def mimo2(tmp_path_factory):
    """Two MTP layers (num_nextn_predict_layers 2)."""
    return save_tiny_mimo(tmp_path_factory.mktemp("mimo2"), seed=4, std=0.3, mtp_layers=2)


@pytest.fixture(scope="module")
def targets(mimo_target, predictive):
    return {"random": mimo_target, "predictive": predictive}


def _base(path, max_num_seqs):
    return [o.token_ids for o in LLM(path, max_num_seqs=max_num_seqs).generate(ENGINE_PROMPTS,
                                                                                GREEDY)]


@pytest.mark.parametrize("which", ["random", "predictive"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_autoregressive(targets, which, k, max_num_seqs):
    path = targets[which]
    llm = LLM(path, {"method": "mtp", "num_speculative_tokens": k}, max_num_seqs=max_num_seqs)
    assert isinstance(llm.proposer, MTPProposer) and llm.spec.model == path
    outs = llm.generate(ENGINE_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == _base(path, max_num_seqs)
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] > 0
    if which == "predictive":
        assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], m


def test_model_given_explicitly(mimo_target):
    spec = {"method": "mtp", "model": mimo_target, "num_speculative_tokens": 2}
    llm = LLM(mimo_target, spec, max_num_seqs=4)
    assert llm.spec.model == mimo_target and llm.proposer.k == 2
    assert [o.token_ids for o in llm.generate(ENGINE_PROMPTS, GREEDY)] == \
        _base(mimo_target, 4)


def test_predictive_target_accepts_and_rolls_back(predictive, bigram):
    """Drafts are accepted (the MTP layer is really fed the target's stream and tokens), and
    with k = 3 some steps accept a strict prefix: the draft cache is rolled back mid-chain."""
    llm = LLM(predictive, {"method": "mtp", "num_speculative_tokens": 3}, max_num_seqs=4)
    llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    m = llm.get_metrics()
    per_pos = m["num_accepted_tokens_per_pos"]
    assert m["acceptance_rate"] > 0.25, m
    assert per_pos[0] > per_pos[2] > 0, m  # some steps stop after 1 or 2 accepted drafts
    # a bigram target: every draft right except the first step of the one-token prompt, whose
    # only pair sits at position 0 (embedding zeroed, as vLLM does): k drafts lost there
    llm = LLM(bigram, {"method": "mtp", "num_speculative_tokens": 3}, max_num_seqs=4)
    llm.generate(ENGINE_PROMPTS, GREEDY)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] - m["num_accepted_tokens"] == 3, m


def _reference_drafts(llm, tokens, k):
    """Greedy MTP chain from scratch for the sequence ``tokens`` (the last one pending): the
    target's pre-norm stream over ``tokens[:-1]``, pairs ``(h_t, x_{t+1})`` at positions ``t``,
    then ``k - 1`` steps feeding ``o`` back one position further (full causal recomputation,
    no cache)."""
    target, drafter = llm.target.model, llm.proposer.drafter
    n = len(tokens)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        feats = target.forward_train(ids[:, : n - 1], aux_layer_ids=(target.config.num_layers,)
                                     ).aux[0]  # [1, n - 1, H]
        pair_ids, hidden, drafts = ids[:, 1:], feats, []
        for _ in range(k):
            logits, o = drafter.forward_train(pair_ids, hidden)
            tok = logits[:, -1].argmax(-1)  # [1]
            drafts.append(int(tok))
            pair_ids = torch.cat([pair_ids, tok[:, None]], dim=1)
            hidden = torch.cat([hidden, o[:, -1:]], dim=1)
    return drafts


@pytest.mark.parametrize("which", ["random", "predictive"])
def test_every_draft_equals_the_chain_from_scratch(targets, which):
    """The catch-up over verified pairs and the rollback of drafted pairs keep the MTP layer's
    KV cache exactly what a from-scratch pass over the sequence would hold."""
    llm = LLM(targets[which], {"method": "mtp", "num_speculative_tokens": 3}, max_num_seqs=3)
    seen = []
    propose = llm.proposer.propose

    def recording(batch):
        proposal = propose(batch)
        seen.extend((list(t), d.tolist()) for t, d in zip(batch.token_ids, proposal.draft_ids))
        return proposal

    llm.proposer.propose = recording
    llm.generate(ENGINE_PROMPTS, GREEDY)
    assert len(seen) > 10
    for tokens, drafts in seen:
        assert drafts == _reference_drafts(llm, tokens, 3), tokens
    if which == "predictive":
        assert llm.get_metrics()["num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def sampling_mimo(tmp_path_factory):
    """test_engine_sampling's vocabulary of 8, flat-ish distributions (init scale 0.15)."""
    return save_tiny_mimo(tmp_path_factory.mktemp("mimo_sampling"), vocab=8, seed=3, std=0.15)


@pytest.mark.parametrize("spec", [{"rejection_sample_method": "probabilistic"},
                                  {"rejection_sample_method": "standard",
                                   "draft_sample_method": "probabilistic"},
                                  {"rejection_sample_method": "strict"}])
def test_output_distribution_matches_target(sampling_mimo, spec):
    """test_engine_sampling's chi-square test (seeded, so deterministic): the exact law of the
    first tokens comes from transformers' Qwen2 on the MiMo body's weights."""
    spec = {"method": "mtp", "num_speculative_tokens": K, **spec}
    joint, third, metrics = sample(sampling_mimo, spec)
    p_joint, p_third = exact_laws(hf_qwen2(sampling_mimo), 1.0, None, None)
    assert chi2_pvalue(joint, p_joint) > P_MIN
    assert chi2_pvalue(third, p_third) > P_MIN
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics


# ---- vLLM's rules: k, aliases, targets without MTP layers ------------------------------------

def test_k_defaults_to_the_number_of_mtp_layers(mimo_target, mimo2):
    assert LLM(mimo_target, {"method": "mtp"}).proposer.k == 1
    llm = LLM(mimo2, {"method": "mtp"}, max_num_seqs=4)
    assert llm.spec.num_speculative_tokens == 2 and llm.proposer.k == 2
    assert len(llm.proposer.drafter.mtp_layers) == 2
    assert [o.token_ids for o in llm.generate(ENGINE_PROMPTS, GREEDY)] == _base(mimo2, 4)


def test_k_above_n_must_be_a_multiple(mimo2):
    with pytest.raises(ConfigError, match=r"num_speculative_tokens.*3.*multiple of 2"):
        LLM(mimo2, {"method": "mtp", "num_speculative_tokens": 3})
    llm = LLM(mimo2, {"method": "mtp", "num_speculative_tokens": 4}, max_num_seqs=2)
    assert llm.proposer.k == 4
    assert [o.token_ids for o in llm.generate(ENGINE_PROMPTS, GREEDY)] == _base(mimo2, 2)
    assert LLM(mimo2, {"method": "mtp", "num_speculative_tokens": 1}).proposer.k == 1


@pytest.mark.parametrize("alias", ["mimo_mtp", "deepseek_mtp"])
def test_aliases_map_to_mtp(mimo_target, alias, caplog):
    with caplog.at_level(logging.WARNING, logger="infer.spec_config"):
        llm = LLM(mimo_target, {"method": alias, "num_speculative_tokens": 1})
    assert llm.spec.method == "mtp" and isinstance(llm.proposer, MTPProposer)
    assert f"method `{alias}` is deprecated and replaced with mtp" in caplog.text
    assert SpeculativeConfig.parse(llm.spec.to_dict()) == llm.spec


def test_target_without_mtp_layers_is_refused_at_construction(tiny_target, monkeypatch):
    """A Llama target has no MTP layers: refused when the engine is built (no request runs),
    naming the key, whether ``model`` is left to the engine or given."""
    def never(*args, **kwargs):
        raise AssertionError("MTP layers were loaded for a target without any")

    monkeypatch.setattr(MTPDrafter, "from_target", never)
    for spec in ({"method": "mtp"}, {"method": "mtp", "model": tiny_target},
                 {"method": "deepseek_mtp", "num_speculative_tokens": 2}):
        with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
            LLM(tiny_target, spec)


def test_hub_id_target_from_the_local_cache(mimo_target, tmp_path, monkeypatch):
    """A MiMo target given as a hub id already in the Hugging Face cache: its config.json is
    read from the cache (k, the MTP layer check), with ``model`` left to the engine or given; an
    id that is not cached is refused naming it, not as a target "without MTP layers"."""
    import shutil

    from huggingface_hub import constants

    snap = tmp_path / "models--xiaomi--tiny-mimo" / "snapshots" / "abc123"
    shutil.copytree(mimo_target, snap)
    (tmp_path / "models--xiaomi--tiny-mimo" / "refs").mkdir()
    (tmp_path / "models--xiaomi--tiny-mimo" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    base = _base(mimo_target, 4)
    for spec in ({"method": "mtp"}, {"method": "mtp", "model": "xiaomi/tiny-mimo"}):
        llm = LLM("xiaomi/tiny-mimo", spec, max_num_seqs=4)
        assert llm.spec.model == "xiaomi/tiny-mimo" and llm.proposer.k == 1
        assert [o.token_ids for o in llm.generate(ENGINE_PROMPTS, GREEDY)] == base
    with pytest.raises(ConfigError, match=r"'xiaomi/absent'.*local Hugging Face cache"):
        SpeculativeConfig.parse({"method": "mtp", "model": "xiaomi/absent"})


def test_static_steps_equal_plain_steps(predictive, monkeypatch):
    """The fixed-shape path CUDA graphs record (run eagerly here): the same drafts, outputs and
    metrics as the plain forwards (the position-0 mask and the fed-back ``o`` included)."""
    import infer.graphs

    spec = {"method": "mtp", "num_speculative_tokens": 3}
    plain = LLM(predictive, spec, max_num_seqs=2)
    want = plain.generate(ENGINE_PROMPTS, GREEDY)
    monkeypatch.setattr(LLM, "_static_steps", property(lambda self: True))
    monkeypatch.setattr(infer.graphs, "MIN_KV_BUCKET", 1)  # key buckets below the cache size
    static = LLM(predictive, spec, max_num_seqs=2)
    got = static.generate(ENGINE_PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert static.get_metrics() == plain.get_metrics()
    assert static.get_metrics()["num_accepted_tokens"] > 0
    assert static.runner.static_forward.graphs and static.proposer.static.graphs


def test_parallel_drafting_is_refused_clearly(mimo_target):
    with pytest.raises(ValueError, match="parallel_drafting"):
        LLM(mimo_target, {"method": "mtp", "parallel_drafting": True})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_steps_equal_eager_steps(predictive):
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    runs = [LLM(predictive, spec, max_num_seqs=2, device="cuda", dtype="float32",
                enforce_eager=eager) for eager in (True, False)]
    outs = [[o.token_ids for o in llm.generate(ENGINE_PROMPTS, GREEDY)] for llm in runs]
    assert outs[0] == outs[1] and runs[0].get_metrics() == runs[1].get_metrics()
    assert outs[0] == _base(predictive, 2)
    graphs = runs[1].proposer.static.graphs
    assert graphs and all(g.graph is not None for g in graphs.values())
