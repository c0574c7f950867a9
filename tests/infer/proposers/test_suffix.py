"""Suffix decoding proposer: hand-checked drafts, the global cache and its eviction, and the
trie's counts against brute force on random sequences."""

import random
from collections import Counter

import pytest
import torch

from infer.models.output import ModelOutput
from infer.proposers.base import PROPOSERS, DraftBatch, ProposerContext, VerifiedStep
from infer.proposers.suffix import SuffixProposer, SuffixTrie
from infer.spec_config import SpeculativeConfig

NO_OUTPUT = ModelOutput(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))  # suffix reads no states


def make_proposer(k=3, **suffix):
    keys = {f"suffix_decoding_{key}": value for key, value in suffix.items()}
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=k, **keys)
    ctx = ProposerContext(None, None, torch.device("cpu"), torch.float32, 4, 1024, 100)
    return PROPOSERS.get("suffix")(spec, ctx)


def draft(prop, slot, history, k):
    return [t for t in prop.propose(DraftBatch([slot], [history], k)).draft_ids[0].tolist()
            if t >= 0]


def local_draft(history, k, **suffix):
    prop = make_proposer(k=k, **suffix)
    prop.start(0, history)
    return draft(prop, 0, history, k)


def serve(prop, slot, prompt, output, k=3):
    """The engine's call order: start, propose (after the prefill token), observe, finish."""
    prop.start(slot, prompt)
    draft(prop, slot, prompt + output[:1], k)
    prop.observe(VerifiedStep([slot], [0], [output[1:]], NO_OUTPUT))
    prop.finish(slot)


def test_registry():
    assert PROPOSERS.get("suffix") is SuffixProposer
    assert SuffixProposer.provides_draft_probs is False


def test_repeated_pattern_predicted():
    assert local_draft([1, 2, 3, 4, 5, 6, 1, 2, 3], 3) == [4, 5, 6]
    assert local_draft([1, 2, 3, 4, 5, 6, 7, 8], 3) == []  # nothing repeats


def test_min_token_prob_cuts_branches():
    # "1 2" -> 3 in all 3 earlier occurrences: p = 1; "1 2 3" -> 4 in 2 of 3: p = 2/3
    history = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    assert local_draft(history, 3, max_spec_factor=4.0, min_token_prob=0.8) == [3]
    assert local_draft(history, 3, max_spec_factor=4.0, min_token_prob=0.5) == [3, 4, 1]
    # "1 2" -> 3, 4, 5 once each: p = 1/3 for whichever is drafted
    history = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 5, 9, 1, 2]
    assert local_draft(history, 3, max_spec_factor=4.0, min_token_prob=0.5) == []
    assert local_draft(history, 3, max_spec_factor=4.0, min_token_prob=0.3) == [3, 7, 1]


def test_own_occurrence_not_counted_against_the_pattern():
    # "1 2 3" has been followed by 4 once and its current occurrence has no next token yet
    trie = SuffixTrie(24)
    trie.extend(0, [1, 2, 3, 4, 5, 1, 2, 3])
    cursors = trie.open_cursors(0)
    own = frozenset(id(node) for node, _, _ in cursors)
    assert trie.best_draft(cursors, 3, 1.0, 0.1, own) == ([4, 5, 1], pytest.approx(3.0))
    assert trie.best_draft(cursors, 3, 1.0, 0.1) == ([4, 5, 1], pytest.approx(1.5))


def test_spec_factor_bounds_draft_by_match_length():
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # match length 2
    assert local_draft(history, 10, max_spec_factor=1.0) == [3, 4]
    assert local_draft(history, 10, max_spec_factor=2.0) == [3, 4, 5, 6]
    assert local_draft(history, 10, max_spec_factor=0.5) == [3]
    assert local_draft(history, 3, max_spec_factor=4.0) == [3, 4, 5]  # and by k


def test_max_tree_depth_bounds_match_plus_draft():
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    # depth 4: match "3" + 3 drafts, not match "1 2 3" + 5 drafts
    assert local_draft(history, 10, max_spec_factor=10.0, max_tree_depth=4) == [4, 5, 6]
    long = local_draft(history, 10, max_spec_factor=10.0, max_tree_depth=24)
    assert long == [4, 5, 6, 7, 8, 1, 2, 3]  # runs on into the repeat itself
    assert local_draft(history, 10, max_spec_factor=1.0, max_tree_depth=4) == [4, 5]
    assert local_draft(history, 10, max_tree_depth=1) == []


def test_global_cache_helps_next_request():
    prop = make_proposer(k=4, max_spec_factor=2.0)
    serve(prop, 0, [50, 51], [1, 2, 3, 4, 5, 6])  # tokens 2.. arrive through observe only
    prop.start(1, [60, 1, 2])
    assert draft(prop, 1, [60, 1, 2], 4) == [3, 4, 5, 6]
    alone = make_proposer(k=4, max_spec_factor=2.0)
    alone.start(1, [60, 1, 2])
    assert draft(alone, 1, [60, 1, 2], 4) == []


def test_global_cursors_follow_the_growing_history():
    prop = make_proposer(k=2)
    serve(prop, 0, [50], [1, 2, 3, 4, 5, 6, 7])
    prop.start(1, [60])
    history = [60, 1, 2]
    assert draft(prop, 1, history, 2) == [3, 4]
    prop.observe(VerifiedStep([1], [2], [[3, 4, 5]], NO_OUTPUT))
    assert draft(prop, 1, history + [3, 4, 5], 2) == [6, 7]


def test_own_tree_beats_global_when_it_scores_higher():
    prop = make_proposer(k=2, min_token_prob=0.1)
    serve(prop, 0, [50], [1, 2, 9, 9])
    history = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # own: "1 2" -> 3, 4 at p = 3/4
    prop.start(1, history)
    assert draft(prop, 1, history, 2) == [3, 4]


def test_eviction_really_forgets():
    prop = make_proposer(k=4, max_spec_factor=2.0, max_cached_requests=1)
    serve(prop, 0, [50], [1, 2, 3, 4, 5, 6])
    serve(prop, 0, [50], [7, 8, 9, 10])  # evicts the first output
    assert list(prop.global_trie.seqs.values()) == [[7, 8, 9, 10]]
    assert 1 not in prop.global_trie.root.children and 7 in prop.global_trie.root.children
    prop.start(1, [60, 1, 2])
    assert draft(prop, 1, [60, 1, 2], 4) == []
    prop.start(2, [60, 7, 8])
    assert draft(prop, 2, [60, 7, 8], 4) == [9, 10]


def test_reset_forgets_past_outputs_but_not_running_requests():
    prop = make_proposer(k=4, max_spec_factor=2.0)
    serve(prop, 0, [50], [1, 2, 3, 4, 5, 6])
    running = [7, 8, 9, 7, 8]
    prop.start(1, [60, 1, 2])
    prop.start(2, running)
    assert draft(prop, 1, [60, 1, 2], 4) == [3, 4, 5, 6]
    prop.reset()
    assert not prop.global_trie.seqs
    assert draft(prop, 1, [60, 1, 2], 4) == []  # its cursors into the old trie are dropped
    assert draft(prop, 2, running, 4) == [9, 7, 8]  # its own trie stays
    serve(prop, 0, [50], [1, 2, 3, 4])  # and the global trie fills again
    prop.start(3, [60, 1, 2])
    assert draft(prop, 3, [60, 1, 2], 4) == [3, 4]


def test_zero_cached_requests_disables_global_cache():
    prop = make_proposer(k=4, max_cached_requests=0)
    assert prop.global_trie is None
    serve(prop, 0, [50], [1, 2, 3, 4])
    prop.start(1, [60, 1, 2])
    assert draft(prop, 1, [60, 1, 2], 4) == []


def test_finish_frees_state_and_slot_reuse_starts_fresh():
    prop = make_proposer(k=3, max_cached_requests=0)
    prop.start(0, [1, 2, 3, 1, 2])
    assert draft(prop, 0, [1, 2, 3, 1, 2], 3) == [3, 1]
    prop.finish(0)
    assert prop._requests == {}
    prop.finish(0)  # finishing twice is harmless
    prop.start(0, [4, 5, 6, 4])
    assert draft(prop, 0, [4, 5, 6, 4], 3) == [5]


def test_unannounced_history_is_indexed_afresh():
    prop = make_proposer(k=3)
    assert draft(prop, 3, [1, 2, 3, 1, 2], 3) == [3, 1]  # no start(): indexed as a prompt
    assert draft(prop, 3, [7, 8, 7], 3) == [8]  # a different request in that slot


# ---- the trie against brute force ----------------------------------------------------------

def naive_counts(seqs, depth):
    counts = Counter()
    for text in seqs:
        for start in range(len(text)):
            for end in range(start + 1, min(start + depth, len(text)) + 1):
                counts[tuple(text[start:end])] += 1
    return counts


def materialised(trie):
    """(string, count) of every node stored in the trie (leaf chains not expanded)."""
    stack, out = [((), trie.root)], []
    while stack:
        prefix, node = stack.pop()
        for tok, child in (node.children or {}).items():
            out.append((prefix + (tok,), child.count))
            stack.append((prefix + (tok,), child))
    return out


def count_of(trie, string):
    """Occurrences of ``string`` by walking the trie, leaf chains included."""
    node, extra = trie.root, 0
    for tok in string:
        if node.children is not None:
            node = node.children.get(tok)
            if node is None:
                return 0
        else:
            text = trie.seqs[node.seq]
            if node.pos + extra >= len(text) or text[node.pos + extra] != tok:
                return 0
            extra += 1
    return node.count


@pytest.mark.parametrize("seed", range(3))
def test_trie_counts_match_brute_force_with_evictions(seed):
    rng = random.Random(seed)
    depth = rng.randint(2, 6)
    trie, live = SuffixTrie(depth), {}
    for step in range(40):
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            trie.remove(victim)
            del live[victim]
        else:
            seq = rng.choice([*live, step])  # grow an existing sequence or start one
            chunk = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
            trie.extend(seq, chunk)
            live.setdefault(seq, []).extend(chunk)
        expected = naive_counts(live.values(), depth)
        for string, count in materialised(trie):
            assert expected[string] == count, (string, live)
        for string, count in expected.items():
            assert count_of(trie, string) == count, (string, live)
        assert count_of(trie, (9,)) == 0


@pytest.mark.parametrize("seed", range(3))
def test_drafts_are_continuations_present_in_indexed_text(seed):
    rng = random.Random(seed)
    for _ in range(150):
        depth, k, factor = rng.randint(2, 8), rng.randint(1, 5), rng.choice([0.5, 1.0, 3.0])
        prop = make_proposer(k=k, max_tree_depth=depth, max_spec_factor=factor,
                             min_token_prob=rng.choice([0.0, 0.1, 0.5]))
        past = [[rng.randrange(3) for _ in range(rng.randint(1, 30))] for _ in range(2)]
        for output in past:
            serve(prop, 0, [99], output)
        history = [rng.randrange(3) for _ in range(rng.randint(1, 40))]
        prop.start(1, history)
        tokens = draft(prop, 1, history, k)
        if tokens:
            assert len(tokens) <= k
            texts = [history] + past
            assert any(occurs(history[-m:] + tokens, texts)
                       and len(tokens) <= int(m * factor + 1e-6) and m + len(tokens) <= depth
                       for m in range(1, min(depth, len(history) + 1)))


def occurs(string, texts):
    n = len(string)
    return any(text[i : i + n] == string for text in texts for i in range(len(text) - n + 1))
