"""The vocabulary intersection of a draft with another tokenizer (infer/vocab_bridge.py)."""

import torch

from infer.vocab_bridge import VocabBridge, normalise


class _Tok:
    """What the bridge reads of a tokenizer: its vocabulary and unknown token."""

    def __init__(self, vocab: dict[str, int], unk: int | None = None) -> None:
        self.vocab, self.unk_token_id = vocab, unk

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_word_start_markers_are_one_spelling():
    assert normalise("▁the") == normalise("Ġthe") == "Ġthe"
    assert normalise("the") == "the" and normalise("▁▁") == "ĠĠ"


def test_the_intersection_maps_both_ways_and_masks_the_rest():
    draft = _Tok({"a": 0, "▁cat": 1, "zz": 2, "<unk>": 3, "Ġcat": 4}, unk=3)  # 1, 4 collide
    target = _Tok({"Ġcat": 5, "a": 2, "b": 0, "q": 1, "r": 3, "s": 4})
    bridge = VocabBridge.build(draft, target, draft_vocab=5, target_vocab=6,
                               device=torch.device("cpu"))
    assert bridge.size == 2
    assert bridge.to_target.tolist() == [2, 5, -1, -1, -1]  # "▁cat" (id 1) wins over id 4
    assert bridge.draft_ids([5, 2, 0, 4]) == [1, 0, 3, 3]  # outside: the draft's <unk>
    masked = bridge.mask(torch.zeros(2, 5))
    assert torch.isinf(masked[:, 2:]).all() and not torch.isinf(masked[:, :2]).any()


def test_ids_past_the_embedding_are_left_out_and_the_fallback_is_zero_without_unk():
    draft = _Tok({"a": 0, "b": 1, "extra": 7})  # an added token beyond the draft's embedding
    target = _Tok({"extra": 0, "a": 1})
    bridge = VocabBridge.build(draft, target, draft_vocab=2, target_vocab=2,
                               device=torch.device("cpu"))
    assert bridge.to_target.tolist() == [1, -1] and bridge.draft_ids([0, 1]) == [0, 0]
