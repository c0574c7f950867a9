"""EAGLE / EAGLE-3 heads served through the engine: greedy speculative output equals plain greedy
output; a head that copies the target's own predictions gets its drafts accepted."""

import json

import pytest
import torch

import infer.graphs
from infer.drafters.eagle import EagleConfig, EagleDrafter
from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from infer.engine import LLM
from infer.foundation.errors import FileFormatError
from infer.models.loader import load_config
from infer.sampling import SamplingParams

from .conftest import price_verification, save_tiny_llama

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
    two = _randomize(Eagle3Drafter(Eagle3Config.for_target(cfg, draft_vocab_size=48,
                                                           num_layers=2)), 3)
    two.set_vocab(torch.arange(1, 96, 2))
    two.save_pretrained(root / "eagle3_2layers")
    e1 = _randomize(EagleDrafter(EagleConfig.for_target(cfg)), 2)
    e1.save_pretrained(root / "eagle")
    return {"eagle3": str(root / "eagle3"), "eagle": str(root / "eagle"),
            "eagle3_2layers": str(root / "eagle3_2layers")}


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
@pytest.mark.parametrize("k,max_num_seqs,adaptive", [(1, 4, False), (3, 2, False),
                                                     (5, 4, False), (5, 4, True)])
def test_greedy_equals_autoregressive(target4, heads, method, k, max_num_seqs, adaptive,
                                      monkeypatch):
    if adaptive:
        price_verification(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = {"method": method, "model": heads[method], "num_speculative_tokens": k,
            "enable_adaptive_verification": adaptive}
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


@pytest.mark.parametrize("k,max_num_seqs", [(3, 1), (4, 3)])
def test_a_token_map_keeps_greedy_drafting_lossless_over_fewer_tokens(target4, heads, tmp_path,
                                                                       k, max_num_seqs):
    """``speculative_token_map``: greedy drafts come from the map's tokens only (half of the
    head's 48, plus ids outside its vocabulary, which are ignored); the output is still plain
    greedy decoding's. Sampled drafts keep the head's whole vocabulary."""
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps({"token_ids": list(range(0, 96, 4)) + [1, 3]}))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": k,
            "speculative_token_map": str(token_map)}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=max_num_seqs)
    drafter = llm.proposer.drafter
    assert drafter.lm_head.weight.shape[0] == 24
    assert torch.equal(drafter.to_target_ids(torch.arange(24)), torch.arange(0, 96, 4))
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [b.token_ids for b in base]
    assert llm.get_metrics()["num_draft_tokens"] > 0
    sampled = LLM(target4, speculative_config={**spec, "draft_sample_method": "probabilistic"},
                  max_num_seqs=max_num_seqs)
    assert sampled.proposer.drafter.lm_head.weight.shape[0] == 48
    token_map.write_text(json.dumps({"token_ids": [1, 3]}))  # odd ids: none in the head's
    with pytest.raises(FileFormatError, match="none of its tokens.*map.json"):
        LLM(target4, speculative_config=spec, max_num_seqs=max_num_seqs)


@pytest.mark.parametrize("method,head", [("eagle3", "eagle3"), ("eagle", "eagle"),
                                         ("eagle3", "eagle3_2layers")])
def test_static_steps_equal_plain_steps(target4, heads, method, head, monkeypatch):
    """The fixed-shape path CUDA graphs record (run eagerly here) drafts and verifies exactly as
    the plain forwards: the head's one-pair steps get the fed-back hidden state through a static
    buffer."""
    spec = {"method": method, "model": heads[head], "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = LLM(target4, speculative_config=spec, max_num_seqs=2)
    want = plain.generate(PROMPTS, params)
    monkeypatch.setattr(LLM, "_static_steps", property(lambda self: True))
    monkeypatch.setattr(infer.graphs, "MIN_KV_BUCKET", 1)  # key buckets below the cache size
    static = LLM(target4, speculative_config=spec, max_num_seqs=2)
    got = static.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert static.get_metrics() == plain.get_metrics()
    assert static.runner.static_forward.graphs and static.proposer.static.graphs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method,head", [("eagle3", "eagle3"), ("eagle", "eagle"),
                                         ("eagle3", "eagle3_2layers")])
def test_cuda_graph_steps_equal_eager_steps(target4, heads, method, head):
    spec = {"method": method, "model": heads[head], "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=12)
    runs = [LLM(target4, speculative_config=spec, max_num_seqs=2, device="cuda",
                dtype="float32", enforce_eager=eager) for eager in (True, False)]
    outs = [[o.token_ids for o in llm.generate(PROMPTS, params)] for llm in runs]
    assert outs[0] == outs[1] and runs[0].get_metrics() == runs[1].get_metrics()
    graphs = runs[1].proposer.static.graphs
    assert graphs and all(g.graph is not None for g in graphs.values())


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_seeded_request_ignores_its_batch(target4, heads, method):
    """Sampled drafts over the head's vocabulary ([B, 1, V'] per step) come from a seeded
    request's own stream too."""
    spec = {"method": method, "model": heads[method], "num_speculative_tokens": 3,
            "rejection_sample_method": "probabilistic"}

    def params(seed=None):
        return SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=seed)

    alone = LLM(target4, speculative_config=spec, seed=0).generate([PROMPTS[2]], params(42))
    crowd = LLM(target4, speculative_config=spec, seed=9, max_num_seqs=2).generate(
        PROMPTS, [params(), params(), params(42), params()])
    assert crowd[2].token_ids == alone[0].token_ids
    assert crowd[2].metrics["num_drafts"] > 0


@pytest.mark.parametrize("k,max_num_seqs", [(1, 4), (3, 2)])
def test_two_layer_eagle3_greedy_equals_autoregressive(target4, heads, k, max_num_seqs):
    """vLLM's num_hidden_layers = 2 EAGLE-3 head: each draft runs both layers, with a KV cache
    per layer, and greedy output is still the target's."""
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = {"method": "eagle3", "model": heads["eagle3_2layers"], "num_speculative_tokens": k}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=max_num_seqs)
    assert len(llm.proposer.drafter.layers) == 2
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.get_metrics()["num_drafts"] > 0


def _tree_and_chain(target, head, method, k, siblings, max_num_seqs, params):
    spec = {"method": method, "model": head, "num_speculative_tokens": k}
    chain = LLM(target, speculative_config=spec, max_num_seqs=max_num_seqs)
    tree = LLM(target, speculative_config={**spec, "draft_tree_siblings": siblings,
                                           "draft_tree_max_batch": max_num_seqs},
               max_num_seqs=max_num_seqs)  # a tree at every batch size
    return tree, tree.generate(PROMPTS, params), chain, chain.generate(PROMPTS, params)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
@pytest.mark.parametrize("k,siblings,max_num_seqs", [(1, 1, 1), (3, 2, 2), (4, 15, 4)])
def test_sibling_tree_greedy_equals_autoregressive(target4, heads, method, k, siblings,
                                                   max_num_seqs):
    """A chain with sibling leaves (draft_tree_siblings) is verified as a tree in one forward:
    depth positions, an ancestor mask, an accepted sibling's keys moved into place. Output equals
    plain greedy decoding, with more accepted per step than the same head's chain once the
    siblings are many enough to be hit (a random head: 15 of its 48 draft tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=16)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    tree, outs, chain, _ = _tree_and_chain(target4, heads[method], method, k, siblings,
                                           max_num_seqs, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    if siblings >= 15:
        tree_al = tree.get_metrics()["mean_acceptance_length"]
        assert tree_al > chain.get_metrics()["mean_acceptance_length"] + 0.1


@pytest.mark.parametrize("siblings,max_num_seqs", [(1, 1), (2, 3)])
def test_sibling_tree_moves_accepted_nodes_into_place(target4, heads, siblings, max_num_seqs):
    """Drafts from the reference continuation with one wrong chain token per step whose right
    token is among its siblings: every step accepts chain nodes past depth 1 and a sibling, all
    of which sit in the wrong cache columns until moved. Output still equals greedy decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = LLM(target4, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    full = [list(p) + list(b.token_ids) for p, b in zip(PROMPTS, base)]
    k = 4
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": k,
            "draft_tree_siblings": siblings, "draft_tree_max_batch": max_num_seqs}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=max_num_seqs)
    inner, gen = llm.proposer.propose, torch.Generator().manual_seed(0)

    def oracle(batch):
        proposal = inner(batch)  # the head's own bookkeeping runs as usual
        for row, toks in enumerate(batch.token_ids):
            ref = next(f for f in full if f[: len(toks)] == toks)
            truth = (ref[len(toks):] + [0] * k)[:k]
            wrong = int(torch.randint(1, k + 1, (), generator=gen))  # depth of the mistake
            chain = list(truth)
            chain[wrong - 1] = (truth[wrong - 1] + 1) % 64
            proposal.draft_ids[row] = torch.tensor(chain)
            proposal.sibling_ids[row] = (torch.tensor(chain)[:, None] + 2) % 64
            proposal.sibling_ids[row, wrong - 1, -1] = truth[wrong - 1]
        return proposal

    llm.proposer.propose = oracle
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.get_metrics()["mean_acceptance_length"] > 2.5  # deep paths were taken


def test_sibling_tree_only_up_to_its_batch_size(target4, heads):
    """draft_tree_max_batch: a step with more running requests proposes (and verifies) the
    plain chain, one with at most that many the tree; output equals greedy decoding either way."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (6, 10, 14, 30)]  # the batch shrinks from 4 rows to 1
    base = LLM(target4, max_num_seqs=4).generate(PROMPTS, params)
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3,
            "draft_tree_siblings": 2, "draft_tree_max_batch": 2}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=4)
    inner, seen = llm.proposer.propose, []

    def record(batch):
        proposal = inner(batch)
        seen.append((len(batch.slots), proposal.sibling_ids is not None))
        return proposal

    llm.proposer.propose = record
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert {rows: tree for rows, tree in seen} == {rows: rows <= 2 for rows, _ in seen}
    assert {rows for rows, _ in seen} >= {1, 4}


def test_sampled_batches_prepare_no_tree(target4, heads):
    """Greedy drafts at temperature 1 (strict rejection) are verified as a chain, so the proposer
    does not rank siblings for them (infer.rejection.argmax_verify, the engine's rule)."""
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3,
            "draft_tree_siblings": 2, "draft_sample_method": "greedy"}
    llm = LLM(target4, speculative_config=spec, max_num_seqs=1, seed=0)
    inner, seen = llm.proposer.propose, []
    llm.proposer.propose = lambda batch: seen.append(inner(batch)) or seen[-1]
    llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8))
    trees = [p.sibling_ids is not None for p in seen]
    assert True in trees and False in trees and trees.index(True) > 0  # sampled first, no tree


def test_sibling_tree_runs_to_max_model_len(target4, heads):
    """Siblings take verify columns past the accepted tokens': a request that fills the context
    still fits the cache, and its output equals plain greedy decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    base = LLM(target4, max_model_len=24).generate(PROMPTS, params)
    spec = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 4,
            "draft_tree_siblings": 15}
    outs = LLM(target4, speculative_config=spec, max_model_len=24).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert max(len(p) + len(o.token_ids) for p, o in zip(PROMPTS, outs)) == 24


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_k_by_batch_size_keeps_greedy_output(target4, heads, method):
    """Steps at 4-3 running requests draft nothing (k 0), at 2 one token, alone three: the head
    catches up on the verified tokens of its idle steps, and output stays the plain one."""
    spec = {"method": method, "model": heads[method], "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 1], [3, 4, 0]]}
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (5, 9, 13, 20)]
    llm = LLM(target4, speculative_config=spec, dtype="float32", max_num_seqs=4)
    plain = LLM(target4, dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == \
        [o.token_ids for o in plain]
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and len(m["num_accepted_tokens_per_pos"]) == 3
