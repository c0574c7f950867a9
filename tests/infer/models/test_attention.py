"""Grouped-query attention paths (infer/models/attention.py): which one a step takes, and that
they compute the same thing."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from infer.models import attention
from infer.models.attention import (CPU_GROUPED_MAX_ROWS, attend, group_mask, grouped_pays,
                                    position_mask)
from infer.models.llama import Llama


def test_grouped_pays_on_cuda_always_and_on_the_cpu_for_a_few_queries():
    assert not grouped_pays(4, 1, on_cuda=True) and not grouped_pays(4, 1, on_cuda=False)
    assert all(grouped_pays(t, 2, on_cuda=True) for t in (1, 4, 512))
    rep = 2
    cpu = [t for t in range(1, 40) if grouped_pays(t, rep, on_cuda=False)]
    assert cpu == list(range(2, CPU_GROUPED_MAX_ROWS // rep + 1))  # not a decode, not a prefill


@pytest.mark.parametrize("t", [1, 2, 4, 8, 9, 20])
def test_attend_equals_repeated_keys_on_the_path_the_rule_picks(t, monkeypatch):
    """Both CPU paths (SDPA's own GQA, query heads folded into rows) give what repeating every
    kv head does, with a ragged causal mask, from a plain or an already grouped mask."""
    calls = []

    def spy(*args):
        calls.append(args[0].shape[2])
        return grouped(*args)

    grouped = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", spy)
    gen = torch.Generator().manual_seed(t)
    b, heads, kv_heads, s, hd = 3, 4, 2, 40, 8
    q = torch.randn(b, heads, t, hd, generator=gen)
    k, v = torch.randn(2, b, kv_heads, s, hd, generator=gen)
    starts = torch.tensor([0, 7, s - t])  # [B]
    mask = position_mask(starts[:, None] + torch.arange(t), torch.arange(s))  # [B, 1, T, S]
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                          v.repeat_interleave(rep, 1), attn_mask=mask)
    torch.testing.assert_close(attend(q, k, v, mask), want)
    takes = grouped_pays(t, rep, on_cuda=False)
    assert calls == ([t] if takes else [])
    if takes:  # Llama._run hands the mask over grouped once per forward
        torch.testing.assert_close(attend(q, k, v, group_mask(mask, rep)), want)


def test_a_forward_groups_its_masks_once_where_the_rule_says():
    """``Llama._group_masks`` on the CPU: a verify step's masks in the grouped layout (each
    distinct mask once), a decode step's and a prefill's left alone."""
    model = SimpleNamespace(config=SimpleNamespace(num_heads=4, num_kv_heads=2))
    cpu = torch.device("cpu")
    verify = position_mask(torch.tensor([[5, 6, 7, 8]]), torch.arange(9))  # [1, 1, 4, 9]
    grouped = Llama._group_masks(model, [verify, verify, None], cpu)
    assert grouped[0].shape == (1, 1, 8, 9) and grouped[0] is grouped[1] and grouped[2] is None
    torch.testing.assert_close(grouped[0], group_mask(verify, 2))
    decode = position_mask(torch.tensor([[8]]), torch.arange(9))  # [1, 1, 1, 9]
    prefill = position_mask(torch.arange(20)[None], torch.arange(20))  # [1, 1, 20, 20]
    assert Llama._group_masks(model, [decode, prefill], cpu) == [decode, prefill]
