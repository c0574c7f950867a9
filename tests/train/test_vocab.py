"""Draft vocabulary: top-N loss-masked tokens, d2t / t2d encoding, ties, fill, save / load."""

import datasets
import pytest
import torch
from safetensors.torch import load_file

from train import data as D
from train.tiny.corpus import train_tokenizer
from train.vocab import (VOCAB_FILE, DraftVocab, build_draft_vocab, count_loss_tokens,
                         load_draft_vocab, save_draft_vocab)

V = 20
ROWS = [  # loss-masked counts: 7 -> 3, 3 -> 2, 12 -> 2, 5 -> 1, 9 -> 1; token 1 is never masked
    {"input_ids": [1, 7, 7, 3, 1, 1], "loss_mask": [0, 1, 1, 1, 0, 0]},
    {"input_ids": [1, 12, 7, 12, 3, 1], "loss_mask": [0, 1, 1, 1, 1, 0]},
    {"input_ids": [1, 5, 9], "loss_mask": [0, 1, 1]},
]


def test_counts_only_loss_masked_tokens():
    counts = count_loss_tokens(ROWS, V)
    assert counts.dtype == torch.int64 and counts.shape == (V,)
    assert {i: c for i, c in enumerate(counts.tolist()) if c} == {7: 3, 3: 2, 12: 2, 5: 1, 9: 1}
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_loss_tokens([{"input_ids": [25], "loss_mask": [1]}], V)


def test_top_n_ties_by_smaller_id_and_encoding():
    vocab = build_draft_vocab(ROWS, V, 4)
    # 7 (3), then 3 and 12 (2 each), then 5 beats 9 on the tie (smaller id); sorted ascending
    assert vocab.target_ids().tolist() == [3, 5, 7, 12]
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [3, 4, 5, 9]
    assert (vocab.d2t[1:] >= vocab.d2t[:-1]).all()  # non-decreasing offsets
    ids = torch.arange(4) + vocab.d2t  # target_id = i + d2t[i]
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.shape == (V,)
    assert vocab.t2d[ids].all() and int(vocab.t2d.sum()) == 4
    # mapping helpers
    assert vocab.draft_to_target(torch.tensor([[0, 3], [2, 1]])).tolist() == [[3, 12], [7, 5]]
    assert vocab.target_to_draft(torch.tensor([3, 5, 7, 12, 1, 9])).tolist() == [0, 1, 2, 3, -1, -1]
    t = torch.arange(V)
    back = vocab.target_to_draft(t)
    assert torch.equal(vocab.draft_to_target(back[back >= 0]), t[vocab.t2d])


def test_unseen_fill_full_vocab_and_errors():
    vocab = build_draft_vocab(ROWS, V, 8)  # only 5 distinct tokens seen
    assert vocab.target_ids().tolist() == [0, 1, 2, 3, 5, 7, 9, 12]  # lowest unseen ids fill
    full = build_draft_vocab(ROWS, V, V)
    assert full.d2t.tolist() == [0] * V and bool(full.t2d.all())
    with pytest.raises(ValueError, match="draft_vocab_size.*20"):
        build_draft_vocab(ROWS, V, V + 1)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(ROWS, V, 0)


def test_save_load_round_trip(tmp_path):
    vocab = build_draft_vocab(ROWS, V, 4)
    file = save_draft_vocab(vocab, tmp_path / "processed")
    assert file == tmp_path / "processed" / VOCAB_FILE
    assert set(load_file(str(file))) == {"d2t", "t2d", "counts"}
    back = load_draft_vocab(tmp_path / "processed")
    for name in ("d2t", "t2d", "counts"):
        assert torch.equal(getattr(back, name), getattr(vocab, name))
        assert getattr(back, name).dtype == getattr(vocab, name).dtype
    assert DraftVocab.load(file).target_ids().tolist() == [3, 5, 7, 12]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_draft_vocab(tmp_path / "nowhere")
    broken = DraftVocab(d2t=vocab.d2t, t2d=torch.zeros(V, dtype=torch.bool), counts=vocab.counts)
    broken.save(tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match="t2d"):
        DraftVocab.load(tmp_path / "broken.safetensors")


def test_from_prepared_dataset_and_tensor_batches():
    tok = train_tokenizer(["What is 1?", "Four.", "hello world"] * 3, 300)
    rows = [{"messages": [{"role": "user", "content": f"What is {i}?"},
                          {"role": "assistant", "content": "Four." if i % 2 else "hello world"}]}
            for i in range(10)]
    for pack in (True, False):
        ds = D.prepare_dataset(datasets.Dataset.from_list(rows), tok, max_length=64, pack=pack,
                               verbose=False)
        vocab = build_draft_vocab(ds, len(tok), 8)
        manual = torch.zeros(len(tok), dtype=torch.long)
        for r in ds:
            for i, m in zip(r["input_ids"], r["loss_mask"]):
                manual[i] += m
        assert torch.equal(vocab.counts, manual)
        assert int(vocab.counts[tok.convert_tokens_to_ids("<|end|>")]) == 10  # terminators
        assert int(vocab.counts[tok.convert_tokens_to_ids("<|user|>")]) == 0  # headers
        assert int(vocab.counts.sum()) == sum(map(sum, ds["loss_mask"]))
    batches = [{"input_ids": torch.tensor([[1, 7, 7], [3, 3, 1]]),
                "loss_mask": torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.bool)}]
    assert build_draft_vocab(batches, V, 2).target_ids().tolist() == [3, 7]
