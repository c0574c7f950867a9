"""EAGLE / EAGLE-3 chain proposers with fake target outputs: shapes, vocab mapping, draft
probabilities, determinism, and catch-up + rollback equal to drafting from scratch."""

import pytest
import torch

from infer.drafters.eagle import EagleConfig, EagleDrafter
from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from infer.kv_cache import KVCache
from infer.models.llama import Llama, ModelConfig, ModelOutput
from infer.proposers.base import PROPOSERS, DraftBatch, ProposerContext, VerifiedStep
from infer.proposers.eagle import EagleProposer
from infer.proposers.eagle3 import Eagle3Proposer
from infer.spec_config import SpeculativeConfig

V, H, K = 64, 32, 3
TARGET = ModelConfig(vocab_size=V, hidden_size=H, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=8, intermediate_size=48)


def randomize(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
            if p.ndim == 1:
                p.add_(1.0)
    return module


@pytest.fixture(scope="module")
def target():
    return randomize(Llama(TARGET), 0).eval()


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("heads")
    e3 = randomize(Eagle3Drafter(Eagle3Config.for_target(TARGET, draft_vocab_size=20,
                                                         speculative_tokens=K)), 1)
    e3.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:20].sort().values)
    e3.save_pretrained(root / "eagle3-head")
    e1 = randomize(EagleDrafter(EagleConfig.for_target(TARGET)), 3)
    e1.save_pretrained(root / "eagle-head")
    return {"eagle3": str(root / "eagle3-head"), "eagle": str(root / "eagle-head")}


def make(method, heads, target, rejection="strict", **extra):
    spec = SpeculativeConfig(method=method, model=heads[method], num_speculative_tokens=K,
                             rejection_sample_method=rejection, **extra)
    ctx = ProposerContext(target, TARGET, torch.device("cpu"), torch.float32, 4, 64, V)
    return PROPOSERS.get(method)(spec, ctx)


def fake_output(b, t, seed):
    """A target ModelOutput with random states: hidden + the aux streams EAGLE-3 asks for."""
    g = torch.Generator().manual_seed(seed)
    return ModelOutput(torch.zeros(b, t, V), torch.randn(b, t, H, generator=g),
                       tuple(torch.randn(b, t, H, generator=g) for _ in range(3)))


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def run_two_steps(proposer, temperature=None, generator=None):
    """prefill -> propose -> verify (row 0 accepts 1 draft, row 1 none) -> propose."""
    slots = [0, 2]
    proposer.prefilled(slots, [5, 3], fake_output(2, 5, seed=10))
    tokens = [p + [first] for p, first in zip(PROMPTS, [13, 14])]
    batch = DraftBatch(slots, tokens, K, temperature=temperature, generator=generator)
    p1 = proposer.propose(batch)
    d = p1.draft_ids.tolist()
    new = [[d[0][0], 40], [41]]
    proposer.observe(VerifiedStep(slots, [1, 0], new, fake_output(2, K + 1, 11)))
    tokens = [t + n for t, n in zip(tokens, new)]
    p2 = proposer.propose(DraftBatch(slots, tokens, K, temperature=temperature,
                                     generator=generator))
    return p1, p2, tokens


def test_registered():
    assert PROPOSERS.get("eagle3") is Eagle3Proposer
    assert PROPOSERS.get("eagle") is EagleProposer


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_greedy_drafts_are_valid_and_deterministic(method, heads, target):
    proposer = make(method, heads, target)
    p1, p2, _ = run_two_steps(proposer)
    again = run_two_steps(make(method, heads, target))
    for prop, other in zip((p1, p2), again[:2]):
        assert prop.draft_ids.shape == (2, K) and prop.draft_ids.dtype == torch.long
        assert (prop.draft_ids >= 0).all() and (prop.draft_ids < V).all()  # never -1 padding
        assert prop.draft_probs is None  # strict rejection needs no draft distribution
        assert torch.equal(prop.draft_ids, other.draft_ids)
    if method == "eagle3":  # valid target ids of the draft vocabulary
        t2d = proposer.drafter.t2d
        assert t2d[p1.draft_ids].all() and t2d[p2.draft_ids].all()


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_probabilistic_draft_probs_cover_the_target_vocab(method, heads, target):
    temperature = torch.tensor([1.0, 0.0])  # row 1 greedy: its q is one-hot at the draft
    proposers = [make(method, heads, target, "probabilistic") for _ in range(2)]
    runs = [run_two_steps(p, temperature, torch.Generator().manual_seed(7)) for p in proposers]
    for prop in runs[0][:2]:
        q = prop.draft_probs
        assert q.shape == (2, K, V)
        assert torch.allclose(q.sum(-1), torch.ones(2, K), atol=1e-5)
        assert (q.gather(-1, prop.draft_ids[..., None]) > 0).all()  # drafts come from q
        assert torch.equal(q[1].argmax(-1), prop.draft_ids[1]) and (q[1].max(-1).values == 1).all()
        if method == "eagle3":
            t2d = proposers[0].drafter.t2d
            assert not q[..., ~t2d].any() and t2d[prop.draft_ids].all()
    for a, b in zip(runs[0][:2], runs[1][:2]):  # same generator seed -> same samples
        assert torch.equal(a.draft_ids, b.draft_ids) and torch.equal(a.draft_probs, b.draft_probs)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_catch_up_and_rollback_equal_drafting_from_scratch(method, heads, target):
    """After observe, drafts equal a fresh head fed every verified pair at once: the drafting
    entries of the previous step were rolled back and the target features were paired right."""
    proposer = make(method, heads, target)
    _, p2, tokens = run_two_steps(proposer)
    head = proposer.drafter
    prefill, verify = fake_output(2, 5, 10), fake_output(2, K + 1, 11)
    feats = proposer.target_features
    with torch.no_grad():
        for row, (n_prompt, n_new) in enumerate([(5, 2), (3, 1)]):
            f = torch.cat([head.prepare(feats(prefill))[row, :n_prompt],
                           head.prepare(feats(verify))[row, :n_new]])  # [pairs, H]
            ids = torch.tensor(tokens[row][1:])[None]  # the token after each feature's position
            assert ids.shape[1] == f.shape[0]
            cache = KVCache.for_model(head.layer_config, 1, 32)
            logits, hidden = head(ids, f[None], cache, logits_at=torch.tensor([[f.shape[0] - 1]]))
            want = []
            for _ in range(K):
                tok = head.to_target_ids(logits.argmax(-1))
                want.append(tok.item())
                logits, hidden = head(tok, hidden, cache)
            assert p2.draft_ids[row].tolist() == want


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_a_prompt_backlog_is_fed_as_its_own_group_not_padding_the_batch(method, heads, target):
    """A new request's first catch-up covers its prompt: all but its last pair go in a group of
    their own inside the catch-up's forward (unpadded, planned first), so the batch's catch-up
    rows stay within k + 1 columns; the drafts equal those of one padded forward over
    everything, and of the backlog fed in a forward of its own (``apart``)."""
    proposer = make(method, heads, target)
    shapes, forward, grouped = [], proposer.drafter.forward, proposer.drafter.forward_groups

    def record(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    def record_groups(groups, cache):
        shapes.append([tuple(g.input_ids.shape) for g in groups])
        return grouped(groups, cache)
    proposer.drafter.forward, proposer.drafter.forward_groups = record, record_groups
    prompts, slots = [list(range(3, 23)), [5, 6, 7]], [1, 3]
    proposer.prefilled(slots, [20, 3], fake_output(2, 20, seed=5))
    tokens = [p + [first] for p, first in zip(prompts, [30, 31])]
    got = proposer.propose(DraftBatch(slots, tokens, K)).draft_ids
    assert shapes == [[(1, 19), (2, 3)]] + [(2, 1)] * (K - 1)  # backlog + catch-up, chain
    plain = make(method, heads, target)
    plain._backlog_groups = lambda batch: []  # everything in the batch's one catch-up
    plain.prefilled(slots, [20, 3], fake_output(2, 20, seed=5))
    assert torch.equal(plain.propose(DraftBatch(slots, tokens, K)).draft_ids, got)
    apart = make(method, heads, target)
    apart.prefilled(slots, [20, 3], fake_output(2, 20, seed=5))
    step = apart.begin_step(DraftBatch(slots, tokens, K))  # the backlog's forward ran already
    assert step.backlogs == [] and step.counts == [1, 3] and step.ids.shape == (2, 3)
    assert apart.fed[1] == 20 and apart.fed[3] == 3


def test_eagle3_aux_layer_ids_and_real_target_output(heads, target):
    proposer = make("eagle3", heads, target)
    aux_ids = proposer.feature_spec().aux_layer_ids
    assert aux_ids == (1, 2, 3)  # default_aux_layer_ids(4), sorted
    prompts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    cache = KVCache.for_model(TARGET, 4, 64)
    with torch.no_grad():
        out = target(prompts, cache, torch.tensor([1, 3]), num_tokens=torch.tensor([4, 3]),
                     aux_layer_ids=aux_ids)
    proposer.prefilled([1, 3], [4, 3], out)
    drafts = proposer.propose(DraftBatch([1, 3], [[1, 2, 3, 4, 9], [5, 6, 7, 9]], K)).draft_ids
    assert drafts.shape == (2, K) and (drafts >= 0).all()


def test_wiring_errors_are_explicit(heads, target):
    proposer = make("eagle3", heads, target)
    with pytest.raises(RuntimeError, match="prefilled"):
        proposer.propose(DraftBatch([0], [[1, 2, 3]], K))
    no_aux = ModelOutput(torch.zeros(1, 3, V), torch.randn(1, 3, H), ())
    with pytest.raises(RuntimeError, match="aux_layer_ids"):
        proposer.prefilled([0], [3], no_aux)
    proposer.prefilled([0], [2], fake_output(1, 2, 0))
    proposer.propose(DraftBatch([0], [[1, 2, 3]], K))
    with pytest.raises(TypeError, match="target_output"):  # the verify output is required
        VerifiedStep([0], [0], [[4]])
    proposer.finish(0)
    with pytest.raises(RuntimeError, match="prefilled"):
        proposer.propose(DraftBatch([0], [[1, 2, 3, 4]], K))


def test_eagle3_rejects_a_mismatched_target(heads, target):
    small = ModelConfig(**{**TARGET.__dict__, "num_layers": 2})
    spec = SpeculativeConfig(method="eagle3", model=heads["eagle3"], num_speculative_tokens=K)
    ctx = ProposerContext(target, small, torch.device("cpu"), torch.float32, 4, 64, V)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        PROPOSERS.get("eagle3")(spec, ctx)
    ctx = ProposerContext(target, TARGET, torch.device("cpu"), torch.float32, 4, 64, V + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        PROPOSERS.get("eagle3")(spec, ctx)
