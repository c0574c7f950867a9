"""MLP speculator served through the engine: greedy speculative output equals plain greedy
output; num_speculative_tokens defaults to the speculator's n_predict and may not exceed it."""

import pytest
import torch

from infer.drafters.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from infer.engine import LLM
from infer.models.loader import load_config
from infer.sampling import SamplingParams

from .conftest import price_verification, save_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[3, 5, 7, 9, 11, 13], [20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("t"), layers=2, seed=7)


@pytest.fixture(scope="module")
def base(target):
    return [o.token_ids for o in LLM(target, max_num_seqs=4).generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory, target):
    cfg = load_config(target)
    root = tmp_path_factory.mktemp("mlp")
    out = {}
    for name, kw in {"plain": {}, "tied": {"tie_weights": True, "scale_input": True}}.items():
        torch.manual_seed(3)
        m = MLPSpeculator(MLPSpeculatorConfig.for_target(cfg, n_predict=3, inner_dim=24, **kw))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.3)
        out[name] = str(m.save_pretrained(root / name))
    return out


@pytest.mark.parametrize("kind", ["plain", "tied"])
@pytest.mark.parametrize("k,max_num_seqs,adaptive", [(1, 4, False), (3, 2, False), (3, 4, True)])
def test_greedy_equals_autoregressive(target, base, spec_dirs, kind, k, max_num_seqs, adaptive,
                                      monkeypatch):
    if adaptive:
        price_verification(monkeypatch)
    spec = {"method": "mlp_speculator", "model": spec_dirs[kind], "num_speculative_tokens": k,
            "enable_adaptive_verification": adaptive}
    llm = LLM(target, speculative_config=spec, max_num_seqs=max_num_seqs)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == base
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] > 0


def test_k_defaults_to_n_predict(target, base, spec_dirs):
    llm = LLM(target, speculative_config={"model": spec_dirs["plain"]}, max_num_seqs=4)
    assert llm.spec.method == "mlp_speculator" and llm.spec.num_speculative_tokens == 3
    assert llm.proposer.k == 3
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == base


def test_k_above_n_predict_is_an_error(target, spec_dirs):
    spec = {"method": "mlp_speculator", "model": spec_dirs["plain"], "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="n_predict"):
        LLM(target, speculative_config=spec)


def test_probabilistic_sampling_runs(target, spec_dirs):
    spec = {"method": "mlp_speculator", "model": spec_dirs["plain"], "num_speculative_tokens": 3,
            "rejection_sample_method": "probabilistic"}
    llm = LLM(target, speculative_config=spec, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10))
    assert all(len(o.token_ids) == 10 for o in outs)
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_state_is_target_hidden_behind_pending_token(target, spec_dirs):
    """At every propose, s_0 of a request is the target's final hidden state at the position
    that predicted its pending (last) token, i.e. HF hidden_states[-1] over tokens[:-1]."""
    from transformers import LlamaForCausalLM

    spec = {"method": "mlp_speculator", "model": spec_dirs["plain"], "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=spec, max_num_seqs=2)
    seen, propose = [], llm.proposer.propose

    def spy(batch):
        for slot, toks in zip(batch.slots, batch.token_ids):
            seen.append((list(toks), llm.proposer.state[slot].clone()))
        return propose(batch)

    llm.proposer.propose = spy
    llm.generate(PROMPTS, PARAMS)
    hf = LlamaForCausalLM.from_pretrained(target).eval()
    assert len(seen) > 8
    with torch.no_grad():
        for toks, state in seen:
            ref = hf(torch.tensor([toks[:-1]]), output_hidden_states=True).hidden_states[-1]
            torch.testing.assert_close(state, ref[0, -1], rtol=1e-4, atol=1e-4)
