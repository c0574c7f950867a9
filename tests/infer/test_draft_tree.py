"""infer/draft_tree.py: the sibling tree's layout, mask and greedy walk."""

import pytest
import torch

from infer.draft_tree import SiblingTree


def reference_walk(tree: SiblingTree, tokens, best, n):
    """One row, written out: follow the chain while it matches, then try the rejected depth's
    siblings; returns (emitted, path)."""
    s = tree.siblings
    node, depth, path = 0, 0, [0]
    while depth < n:
        chain = 1 + depth * (1 + s)
        want = best[node]
        if tokens[chain] == want:
            node, depth = chain, depth + 1
            path.append(node)
            continue
        sibs = [chain + 1 + j for j in range(s) if tokens[chain + 1 + j] == want]
        if sibs:
            path.append(sibs[0])
        break
    return [best[p] for p in path], path


def test_layout_depths_and_ancestors():
    tree = SiblingTree(k=2, siblings=1)
    assert tree.size == 5
    assert tree.depths().tolist() == [0, 1, 1, 2, 2]
    tokens = tree.layout(torch.tensor([7]), torch.tensor([[10, 20]]), torch.tensor([[[11], [21]]]))
    assert tokens.tolist() == [[7, 10, 11, 20, 21]]
    expected = [[1, 0, 0, 0, 0],   # pending
                [1, 1, 0, 0, 0],   # chain depth 1
                [1, 0, 1, 0, 0],   # sibling depth 1: not the chain draft beside it
                [1, 1, 0, 1, 0],   # chain depth 2
                [1, 1, 0, 0, 1]]   # sibling depth 2
    assert tree.ancestors().long().tolist() == expected


@pytest.mark.parametrize("k,s", [(1, 0), (3, 1), (4, 2), (5, 3)])
def test_walk_matches_the_written_out_walk(k, s):
    tree = SiblingTree(k=k, siblings=s)
    gen = torch.Generator().manual_seed(k * 10 + s)
    b, vocab = 64, 4  # a small vocabulary: matches, misses and sibling hits all happen
    tokens = torch.randint(0, vocab, (b, tree.size), generator=gen)
    best = torch.randint(0, vocab, (b, tree.size), generator=gen)
    # make long chains likely: copy the target's argmax into the chain for half the rows
    for row in range(0, b, 2):
        for depth in range(1, k + 1):
            if torch.rand((), generator=gen) < 0.8:
                tokens[row, 1 + (depth - 1) * (1 + s)] = best[row, 0 if depth == 1 else
                                                              1 + (depth - 2) * (1 + s)]
    num = torch.randint(0, k + 1, (b,), generator=gen)
    emitted, path, accepted = tree.walk(tokens, best, num)
    hits = 0
    for row in range(b):
        want_emit, want_path = reference_walk(tree, tokens[row].tolist(), best[row].tolist(),
                                               int(num[row]))
        got = int(accepted[row])
        assert got == len(want_path) - 1
        assert emitted[row, : got + 1].tolist() == want_emit
        assert path[row, : got + 1].tolist() == want_path
        assert (emitted[row, got + 1:] == -1).all() and (path[row, got + 1:] == -1).all()
        hits += any(p != 1 + (i - 1) * (1 + s) for i, p in enumerate(want_path) if i)
    if s:
        assert hits > 0  # the test exercised sibling acceptance


def test_without_siblings_the_walk_is_greedy_verify():
    from infer.rejection import greedy_verify
    tree = SiblingTree(k=3, siblings=0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 4, 5, generator=gen)
    drafts = torch.randint(0, 5, (16, 3), generator=gen)
    drafts[::2, 0] = logits[::2, 0].argmax(-1)
    tokens = torch.cat([torch.zeros(16, 1, dtype=torch.long), drafts], dim=1)
    emitted, _, _ = tree.walk(tokens, logits.argmax(-1), torch.full((16,), 3))
    assert torch.equal(emitted, greedy_verify(logits, drafts))


def test_bad_shape_is_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        SiblingTree(k=0, siblings=1)
