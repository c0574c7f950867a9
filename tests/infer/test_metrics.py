"""SpecMetrics: record / merge against hand-computed values (docs/reference.md §3)."""

import pytest

from infer.metrics import SpecMetrics


def recorded(*steps):
    m = SpecMetrics()
    for drafted, accepted in steps:
        m.record(drafted, accepted)
    return m


def test_empty():
    assert SpecMetrics().as_dict() == {
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
        "num_accepted_tokens_per_pos": [], "acceptance_rate": 0.0,
        "mean_acceptance_length": 1.0, "per_position_rates": []}


def test_record_hand_computed():
    # steps (drafted, accepted): (3, 2) (3, 0) (0, 0) (2, 2) (3, 3)
    m = recorded((3, 2), (3, 0), (0, 0), (2, 2), (3, 3))
    assert m.num_drafts == 4  # the step that drafted nothing is not a draft
    assert m.num_draft_tokens == 11
    assert m.num_accepted_tokens == 7
    # position 0 reached by steps 1, 4, 5; position 1 by 1, 4, 5; position 2 by 5 only
    assert m.num_accepted_tokens_per_pos == [3, 3, 1]
    assert m.acceptance_rate == pytest.approx(7 / 11)
    assert m.mean_acceptance_length == pytest.approx(1 + 7 / 4)
    assert m.per_position_rates == pytest.approx([3 / 4, 3 / 4, 1 / 4])
    d = m.as_dict()
    assert d["num_accepted_tokens_per_pos"] == [3, 3, 1]
    assert d["mean_acceptance_length"] == pytest.approx(2.75)
    d["num_accepted_tokens_per_pos"].append(9)  # as_dict hands out a copy
    assert m.num_accepted_tokens_per_pos == [3, 3, 1]


def test_per_position_grows_with_the_longest_draft():
    m = recorded((1, 1), (2, 0))
    assert m.num_accepted_tokens_per_pos == [1, 0]
    m.record(4, 4)
    assert m.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert sum(m.num_accepted_tokens_per_pos) == m.num_accepted_tokens


@pytest.mark.parametrize("drafted,accepted", [(2, 3), (2, -1)])
def test_record_rejects_impossible_counts(drafted, accepted):
    with pytest.raises(ValueError, match="num_accepted"):
        SpecMetrics().record(drafted, accepted)


def test_merge_hand_computed():
    a = recorded((3, 2), (3, 3))  # drafts 2, tokens 6, accepted 5, per pos [2, 2, 1]
    b = recorded((5, 5), (1, 0), (2, 1))  # drafts 3, tokens 8, accepted 6, per pos [2,1,1,1,1]
    out = a.merge(b)
    assert out is a
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (5, 14, 11)
    assert a.num_accepted_tokens_per_pos == [4, 3, 2, 1, 1]
    assert a.acceptance_rate == pytest.approx(11 / 14)
    assert a.mean_acceptance_length == pytest.approx(1 + 11 / 5)
    assert b.num_accepted_tokens_per_pos == [2, 1, 1, 1, 1]  # the merged-in one is untouched


def test_merge_equals_recording_everything_in_one():
    steps_a, steps_b = [(3, 1), (2, 2)], [(4, 4), (0, 0), (1, 0)]
    merged = recorded(*steps_a).merge(recorded(*steps_b))
    assert merged.as_dict() == recorded(*steps_a, *steps_b).as_dict()
    shorter_into_longer = recorded(*steps_b).merge(recorded(*steps_a))
    assert shorter_into_longer.as_dict() == merged.as_dict()
    assert SpecMetrics().merge(merged).as_dict() == merged.as_dict()
