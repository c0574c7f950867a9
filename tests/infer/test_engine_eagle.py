"""EAGLE / EAGLE-3 heads served through the engine: greedy speculative output equals plain greedy
output; a head that copies the target's own predictions gets its drafts accepted."""

import pytest
import torch

from infer.drafters.eagle import EagleConfig, EagleDrafter
from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from infer.engine import LLM
from infer.models.loader import load_config
from infer.sampling import SamplingParams

from .conftest import save_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[3, 5, 7, 9, 11, 13], [20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    """4 layers, so EAGLE-3's default aux layers [1, 2, 3] exist."""
    return save_tiny_llama(tmp_path_factory.mktemp("t4"), layers=4, seed=5)


def _randomize(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    return module


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target4):
    cfg = load_config(target4)
    root = tmp_path_factory.mktemp("heads")
    e3 = _randomize(Eagle3Drafter(Eagle3Config.for_target(cfg, draft_vocab_size=48)), 1)
    e3.set_vocab(torch.arange(0, 96, 2))  # every other target id
    e3.save_pretrained(root / "eagle3")
    e1 = _randomize(EagleDrafter(EagleConfig.for_target(cfg)), 2)
    e1.save_pretrained(root / "eagle")
    return {"eagle3": str(root / "eagle3"), "eagle": str(root / "eagle")}


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
@pytest.mark.parametrize("k,max_num_seqs", [(1, 4), (3, 2), (5, 4)])
def test_greedy_equals_autoregressive(target4, heads, method, k, max_num_seqs):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = {"method": method, "model": heads[method], "num_speculative_tokens": k}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=max_num_seqs)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] > 0


def test_eagle3_sampling_probabilistic_runs(target4, heads):
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3,
            "rejection_sample_method": "probabilistic"}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10))
    assert all(len(o.token_ids) == 10 for o in outs)
    assert llm.get_metrics()["num_draft_tokens"] > 0
