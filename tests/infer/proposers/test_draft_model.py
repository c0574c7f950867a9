"""The draft-model proposer: its catch-up (a new prompt is fed as a group of its own, not padding
the batch), and a draft with another tokenizer (use_heterogeneous_vocab)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from infer.engine import LLM
from infer.foundation.errors import ConfigError, FileFormatError
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig
from train.tiny.corpus import train_tokenizer

from ..conftest import save_tiny_llama


def test_a_prompt_backlog_is_fed_as_its_own_group_not_padding_the_batch(tiny_target,
                                                                          twin_draft):
    """Three requests on two slots: the third (a long prompt) is admitted while the first still
    decodes. Its prompt goes through the draft model as a group of its own row, unpadded, in the
    catch-up's forward (``forward_groups``), so no group of several rows is wider than the k + 1
    tokens a verify step leaves; greedy output is the target's."""
    k = 3
    prompts = [[5, 6, 7], [8, 9], list(range(10, 50))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (16, 4, 8)]
    spec = {"method": "draft_model", "model": twin_draft, "num_speculative_tokens": k}
    llm = LLM(tiny_target, speculative_config=spec, max_num_seqs=2)
    shapes, grouped, model = [], [], llm.proposer.model
    forward, forward_groups = model.forward, model.forward_groups

    def record(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    def record_groups(groups, *args, **kwargs):
        if len(groups) > 1:  # one group is the plain forward (recorded there)
            grouped.append([tuple(g.input_ids.shape) for g in groups])
        return forward_groups(groups, *args, **kwargs)
    model.forward, model.forward_groups = record, record_groups
    got = llm.generate(prompts, params)
    want = LLM(tiny_target, max_num_seqs=2).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # the long prompt (all its tokens but the newest) before the batch's catch-up rows
    assert len(grouped) == 1 and grouped[0][0] == (1, 40) and grouped[0][1][1] <= k + 1
    assert all(t <= k + 1 for b, t in shapes if b > 1), shapes


# ---- a draft with another tokenizer (use_heterogeneous_vocab) -----------------------------------

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 8


def _permuted_pair(tmp_path):
    """A target with a byte-level BPE, and a draft that is the same model under a tokenizer
    whose ids are a permutation of the target's (same strings): the draft computes the
    target's logits in its own ids, so over the intersection (everything) every draft matches."""
    tok = train_tokenizer(TEXTS, vocab_size=120)
    n = len(tok)
    target = save_tiny_llama(tmp_path / "target", vocab=n, seed=3, std=0.1)
    tok.save_pretrained(target)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))  # target id -> draft id
    state = json.loads(tok.backend_tokenizer.to_str())
    state["model"]["vocab"] = {t: int(perm[i]) for t, i in state["model"]["vocab"].items()}
    for added in state["added_tokens"]:
        added["id"] = int(perm[added["id"]])
    draft_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)))
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    draft_tok.save_pretrained(draft)
    weights = load_file(str(draft / "model.safetensors"))
    inverse = torch.argsort(perm)  # draft id -> target id
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][inverse].contiguous()
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return target, str(draft), tok


def test_a_draft_with_another_tokenizer_is_lossless_and_maps_ids(tmp_path):
    target, draft, tok = _permuted_pair(tmp_path)
    prompts = [tok.encode(t) for t in ("def add(", "for i in", "class Po")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "use_heterogeneous_vocab": True}
    llm = LLM(target, speculative_config=spec, max_num_seqs=2)
    got = llm.generate(prompts, params)
    want = LLM(target, max_num_seqs=2).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.proposer.bridge.size == len(tok)
    metrics = llm.get_metrics()  # the permuted twin drafts what the target emits
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] > 0


def test_sampled_requests_with_greedy_cross_vocab_drafts_keep_their_seeded_outputs(tmp_path):
    """Greedy drafts are point masses for the acceptance test; a seeded sampled request gives
    what it gives alone, beside another request, with the same drafter."""
    target, draft, tok = _permuted_pair(tmp_path)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "use_heterogeneous_vocab": True}
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    llm = LLM(target, speculative_config=spec, max_num_seqs=2)
    alone = llm.generate([tok.encode("def add(")], params)[0].token_ids
    both = llm.generate([tok.encode("def add("), tok.encode("for i")], params)
    assert both[0].token_ids == alone and all(0 <= t < len(tok) for t in alone)


def test_a_draft_with_another_vocabulary_is_refused_without_the_flag_or_with_sampled_drafts(
        tmp_path, tiny_target):
    target, draft, _ = _permuted_pair(tmp_path)
    small = save_small(tmp_path)
    with pytest.raises(FileFormatError, match="use_heterogeneous_vocab: true"):
        LLM(target, speculative_config={"method": "draft_model", "model": small,
                                        "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="'draft_sample_method'.*greedy only"):
        SpeculativeConfig.parse({"method": "draft_model", "model": draft,
                                 "num_speculative_tokens": 2, "use_heterogeneous_vocab": True,
                                 "rejection_sample_method": "probabilistic"})
    with pytest.raises(ConfigError, match="'use_heterogeneous_vocab'.*draft_model"):
        SpeculativeConfig.parse({"method": "draft_model", "model": draft,
                                 "num_speculative_tokens": 2, "use_heterogeneous_vocab": True,
                                 "parallel_drafting": True})
    with pytest.raises(ConfigError, match="needs the target's tokenizer"):
        LLM(tiny_target, speculative_config={"method": "draft_model", "model": draft,
                                             "num_speculative_tokens": 2,
                                             "use_heterogeneous_vocab": True})


def save_small(tmp_path) -> str:
    """A draft of another vocabulary size."""
    return save_tiny_llama(tmp_path / "small", vocab=64, seed=1)
