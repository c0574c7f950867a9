"""The shared drafter pieces of infer/drafters/common.py: the training-time-test keys."""

import pytest
import torch

from infer.drafters.common import StepKV, TTTKeys, read_token_map
from infer.foundation.errors import FileFormatError, MissingFileError
from infer.models.attention import attend
from train.data import document_attention_mask
from train.objectives.ttt import ttt_attention_mask


@pytest.mark.parametrize("chunks", [1, 5, 8, 64])
def test_ttt_keys_attend_as_the_dense_mask_does(monkeypatch, chunks):
    """Three TTT steps of grouped-query attention: outputs and the gradients of every step's
    queries, keys and values (step-0 keys are read by all three steps) equal those of one
    attention over the concatenated keys with ``ttt_attention_mask``, whatever the chunking (one
    chunk, chunks that split the documents and do not divide T, one query per chunk)."""
    monkeypatch.setattr(TTTKeys, "chunks", chunks)
    torch.manual_seed(0)
    b, heads, kv_heads, t, hd = 2, 4, 2, 37, 8
    docs = torch.tensor([[0] * 20 + [1] * 17, [0] * 5 + [1] * 30 + [2] * 2])  # [B, T]
    qs = [torch.randn(b, heads, t, hd, requires_grad=True) for _ in range(3)]
    ks = [torch.randn(b, kv_heads, t, hd, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(b, kv_heads, t, hd, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(b, heads, t, hd) for _ in range(3)]
    ttt, dense = TTTKeys(document_attention_mask(docs)), StepKV()
    got, want = 0.0, 0.0
    for s in range(3):
        out = ttt.attend(0, qs[s], ks[s], vs[s])  # [B, heads, T, hd]
        keys, values = dense.update(0, ks[s], vs[s])  # [B, kv_heads, (s + 1) * T, hd]
        ref = attend(qs[s], keys, values, ttt_attention_mask(docs, s)[:, None])
        assert out.shape == ref.shape == (b, heads, t, hd)
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
        got, want = got + (out * grads[s]).sum(), want + (ref * grads[s]).sum()
    leaves = qs + ks + vs
    for g, w in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)


def test_ttt_keys_query_sees_only_its_own_later_keys():
    """A value written at one index of step 1 reaches only that query at step 1 (the
    identity block), and a value of a later document never reaches an earlier one."""
    t, hd = 6, 4
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    kv = TTTKeys(document_attention_mask(docs))
    zeros = torch.zeros(1, 1, t, hd)
    kv.attend(0, zeros, zeros, zeros)  # step 0: all values 0
    v = torch.zeros(1, 1, t, hd)
    v[0, 0, 4] = 1.0  # step 1 writes a marker at index 4 only
    out = kv.attend(0, zeros, zeros, v)[0, 0, :, 0]  # [T]: uniform weights over visible keys
    # query 4 sees step-0 keys 3, 4 and its own step-1 key: the marker with weight 1/3
    assert out.tolist() == pytest.approx([0, 0, 0, 0, 1 / 3, 0])


def test_read_token_map_gives_sorted_distinct_ids_and_names_the_file_on_bad_input(tmp_path):
    good = tmp_path / "map.json"
    good.write_text('{"token_ids": [9, 2, 5, 2]}')
    assert read_token_map(good, 10).tolist() == [2, 5, 9]
    for text, match in [('[1, 2]', "JSON object"), ('{"ids": [1]}', "token_ids"),
                        ('{"token_ids": []}', "non-empty list"),
                        ('{"token_ids": [1, true]}', "non-empty list"),
                        ('{"token_ids": [1, 10]}', r"\[0, 10\)")]:
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(FileFormatError, match=match) as err:
            read_token_map(bad, 10)
        assert "bad.json" in str(err.value)
    with pytest.raises(MissingFileError, match="nowhere.json"):
        read_token_map(tmp_path / "nowhere.json", 10)
