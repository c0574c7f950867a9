"""The draft LM derived from a target (train/real/draft.py): its first layers, loadable as is."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.engine import LLM
from infer.models import gguf as conv
from infer.sampling import SamplingParams
from train.real.draft import derive_draft


@pytest.fixture(scope="module")
def target(tiny_gguf, tmp_path_factory):
    return conv.convert_gguf(tiny_gguf[0], tmp_path_factory.mktemp("conv") / "model")


def test_the_draft_is_the_targets_first_layers(target, tmp_path):
    """transformers loads the draft as it is, and it computes what the target's model cut after
    its first layer computes (same embedding, layer 0, final norm and tied head)."""
    draft = derive_draft(target, tmp_path / "model-draft", 1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert AutoTokenizer.from_pretrained(draft).get_vocab() == \
        AutoTokenizer.from_pretrained(target).get_vocab()
    cut = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cut.model.layers = cut.model.layers[:1]
    cut.config.num_hidden_layers = 1
    small = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(small(ids).logits, cut(ids).logits)


def test_the_engine_drafts_with_it_losslessly(target, tmp_path):
    draft = derive_draft(target, tmp_path / "model-draft", 1)
    prompts = [[1, 5, 9, 13], [1, 22, 7]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target), device="cpu").generate(prompts, params)]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("layers", [0, 2, True])
def test_a_layer_count_outside_the_target_is_refused(target, tmp_path, layers):
    with pytest.raises(ValueError, match=r"draft layers.*expected an integer in \[1, 1\]"):
        derive_draft(target, tmp_path / "d", layers)
    assert not (tmp_path / "d").exists()
