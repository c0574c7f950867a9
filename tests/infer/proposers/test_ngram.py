"""N-gram (prompt lookup) proposer: hand-checked cases, the wrapper, and a brute-force check."""

import random

import numpy as np
import pytest
import torch

from infer.proposers.base import PROPOSERS, DraftBatch, ProposerContext
from infer.proposers.ngram import NgramProposer, ngram_propose
from infer.spec_config import SpeculativeConfig


def propose(tokens, n_min, n_max, k):
    return ngram_propose(np.array(tokens, dtype=np.int64), n_min, n_max, k)


def make_proposer(n_min=2, n_max=3, k=3, method="ngram"):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=n_min,
                             prompt_lookup_max=n_max)
    ctx = ProposerContext(None, None, torch.device("cpu"), torch.float32, 4, 1024, 100)
    return PROPOSERS.get(method)(spec, ctx)


def test_match_found():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 3, 2) == [4, 5]


def test_no_match():
    assert propose([1, 2, 3, 4], 1, 3, 3) == []
    assert propose([7], 1, 1, 3) == []
    assert propose([1, 2, 1], 1, 1, 0) == []


def test_longest_n_preferred():
    history = [1, 2, 10, 3, 2, 11, 1, 2]  # "1 2" -> 10, but the latest "2" -> 11
    assert propose(history, 1, 2, 1) == [10]
    assert propose(history, 1, 1, 1) == [11]


def test_min_bound():
    history = [5, 1, 2, 7, 8, 6, 1, 2]  # only a 2-gram repeats
    assert propose(history, 3, 4, 2) == []
    assert propose(history, 2, 4, 2) == [7, 8]


def test_k_truncation_and_overlap():
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(history, 2, 2, 2) == [3, 4]
    # the continuation runs into the suffix itself and stops at the end of the history
    assert propose([1, 2, 3, 1, 2], 2, 2, 5) == [3, 1, 2]


def test_most_recent_occurrence_with_full_continuation():
    assert propose([1, 2, 7, 7, 7, 1, 2, 8, 8, 8, 1, 2], 2, 2, 3) == [8, 8, 8]
    history = [1, 2, 7, 1, 2, 8, 1, 2]
    assert propose(history, 2, 2, 3) == [8, 1, 2]  # latest with 3 tokens after it
    assert propose(history, 2, 2, 4) == [7, 1, 2, 8]  # none has 4: earliest, longest copy
    assert propose([0] * 10, 5, 5, 3) == [0, 0, 0]  # tight repeat still drafts k


def test_registry():
    assert PROPOSERS.get("ngram") is NgramProposer
    assert NgramProposer.provides_draft_probs is False


def test_ngram_gpu_drafts_what_ngram_drafts():
    """``ngram_gpu`` has ngram's semantics (vLLM computes it on the device): same drafts."""
    rng = random.Random(0)
    histories = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    drafts = {}
    for method in ("ngram", "ngram_gpu"):
        prop = make_proposer(method=method)
        for slot, toks in enumerate(histories):
            prop.start(slot, toks)
        drafts[method] = prop.propose(DraftBatch([0, 1, 2, 3], histories, 3)).draft_ids
    assert (drafts["ngram"] >= 0).any()
    assert torch.equal(drafts["ngram"], drafts["ngram_gpu"])


def test_proposer_batch_padding_and_incremental_history():
    prop = make_proposer(n_min=2, n_max=3, k=3)
    prop.start(0, [1, 2, 3, 4])
    prop.start(2, [9, 9])
    h0, h2 = [1, 2, 3, 4, 1], [9, 9, 8]
    out = prop.propose(DraftBatch([0, 2], [h0, h2], 3))
    assert out.draft_probs is None
    assert out.draft_ids.shape == (2, 0)  # no row drafted: nothing to verify but one token
    h0 += [2]  # the history grows: only the tail is copied into the slot's buffer
    out = prop.propose(DraftBatch([0, 2], [h0, h2], 3))
    assert out.draft_ids.tolist() == [[3, 4, 1], [-1, -1, -1]]
    prop.finish(0)
    prop.start(0, [5, 6, 7, 5, 6])  # a new request in the same slot sees only its own tokens
    out = prop.propose(DraftBatch([0], [[5, 6, 7, 5, 6]], 3))
    assert out.draft_ids.tolist() == [[7, 5, 6]]


def test_history_rebuilt_when_slot_reused_without_start():
    prop = make_proposer(n_min=1, n_max=1, k=2)
    prop.propose(DraftBatch([1], [[1, 2, 3, 1]], 2))
    assert prop.propose(DraftBatch([1], [[4, 5, 4]], 2)).draft_ids.tolist() == [[5, 4]]


def test_long_history_grows_buffer():
    prop = make_proposer(n_min=3, n_max=3, k=2)
    history = list(range(500)) + [10, 11, 12]
    assert prop.propose(DraftBatch([0], [history], 2)).draft_ids.tolist() == [[13, 14]]


def reference(tokens, n_min, n_max, k):
    """The documented rule, by brute force: longest n; latest occurrence with k tokens after
    it, else the earliest."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        starts = [p for p in range(length - n) if tokens[p : p + n] == tokens[length - n :]]
        if starts:
            full = [p for p in starts if p + n + k <= length]
            p = full[-1] if full else starts[0]
            return n, starts, tokens[p + n : p + n + k]
    return 0, [], []


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_match_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(300):
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randrange(1, 50))]
        n_min = rng.randint(1, 4)
        n_max, k = rng.randint(n_min, 5), rng.randint(1, 6)
        n, starts, expected = reference(tokens, n_min, n_max, k)
        draft = propose(tokens, n_min, n_max, k)
        assert draft == expected, (tokens, n_min, n_max, k)
        if draft:  # an actual continuation of an earlier occurrence of the matched n-gram
            assert any(tokens[p + n : p + n + len(draft)] == draft for p in starts)
            assert 1 <= len(draft) <= k
