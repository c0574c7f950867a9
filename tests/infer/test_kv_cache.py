"""Static KV cache bookkeeping: positions, padding writes, slot gathers, advance and rollback."""

import pytest
import torch

from infer.kv_cache import KVCache


def make(max_batch=4, max_len=8):
    return KVCache(num_layers=2, max_batch=max_batch, num_kv_heads=2, max_len=max_len, head_dim=3)


def test_shapes_and_for_model():
    cache = make()
    assert cache.k.shape == (2, 4, 2, 9, 3) and cache.lens.dtype == torch.long
    assert cache.capacity == 9 and cache.max_batch == 4

    class Cfg:
        num_layers, num_kv_heads, head_dim = 3, 1, 5

    assert KVCache.for_model(Cfg, 2, 6, dtype=torch.bfloat16).v.shape == (3, 2, 1, 7, 5)
    with pytest.raises(ValueError, match="max_len=0"):
        KVCache(1, 1, 1, 0, 1)


def test_plan_positions_and_padding_go_to_scratch():
    cache = make()
    cache.lens[:] = torch.tensor([0, 5, 2, 7])
    step = cache.plan(2, 3, slots=torch.tensor([2, 1]), num_tokens=torch.tensor([3, 1]))
    assert step.positions.tolist() == [[2, 3, 4], [5, 6, 7]]
    assert step.write_pos.tolist() == [[2, 3, 4], [5, 8, 8]]  # padding -> column max_len
    assert step.kv_len == 6  # max(lens[slot] + num_tokens), read on the host
    assert cache.plan(2, 3, kv_len=cache.capacity).kv_len == 9  # fixed: no host read


def test_overflow_is_an_error():
    cache = make(max_len=4)
    cache.lens[0] = 3
    with pytest.raises(ValueError, match="overflow"):
        cache.plan(1, 2)


def test_positions_past_the_cache_with_a_fixed_kv_len_never_reach_other_rows():
    """A fixed kv_len skips the host overflow check; a row that overruns still only writes to
    its scratch column, not into the next head's or row's keys."""
    cache = make(max_len=4)
    cache.lens[:] = 4  # every row full
    step = cache.plan(1, 2, kv_len=cache.capacity)
    assert step.write_pos.tolist() == [[4, 4]]
    before = cache.k.clone()
    step.update(0, torch.ones(1, cache.k.shape[2], 2, cache.k.shape[-1]),
                torch.ones(1, cache.k.shape[2], 2, cache.k.shape[-1]))
    changed = (cache.k != before).any(dim=-1)  # [L, rows, kv_heads, S + 1]
    assert changed[:, :, :, :4].sum() == 0 and changed[0, 0, :, 4].all()


def test_write_read_with_slots_and_contiguous_rows():
    cache = make()
    cache.lens[:] = torch.tensor([1, 0, 3, 0])
    slots = torch.tensor([2, 0])
    step = cache.plan(2, 2, slots)
    k = torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).view(2, 2, 2, 3)  # [B, kv_heads, T, hd]
    k_all, v_all = step.update(1, k, -k)
    assert k_all.shape == (2, 2, 5, 3)
    torch.testing.assert_close(cache.k[1, 2, :, 3:5], k[0])
    torch.testing.assert_close(cache.k[1, 0, :, 1:3], k[1])
    torch.testing.assert_close(k_all[0, :, 3:5], k[0])
    torch.testing.assert_close(v_all[1, :, 1:3], -k[1])
    assert cache.k[0].abs().sum() == 0  # other layers untouched
    # slots=None reads rows 0..B-1 as a view of the cache
    k_view, _ = cache.read(1, None, 5, 2)
    assert k_view.data_ptr() == cache.k[1].data_ptr()


def test_advance_truncate_reset():
    cache = make()
    step = cache.plan(3, 4, torch.tensor([3, 0, 1]), num_tokens=torch.tensor([4, 2, 1]))
    cache.advance(step)
    assert cache.lens.tolist() == [2, 1, 0, 4]
    cache.advance(cache.plan(2, 1))  # slots None: rows 0 and 1
    assert cache.lens.tolist() == [3, 2, 0, 4]
    before = cache.k.clone()
    cache.truncate(torch.tensor([3, 0]), torch.tensor([1, 2]))  # rollback: lengths only
    assert cache.lens.tolist() == [2, 2, 0, 1] and torch.equal(cache.k, before)
    cache.reset(torch.tensor([1]))
    assert cache.lens.tolist() == [2, 0, 0, 1]
    cache.reset()
    assert cache.lens.tolist() == [0, 0, 0, 0]


def test_a_plan_without_padding_is_the_padded_plan_with_every_token_real():
    """The no-padding fast path (no masked_fill) must plan exactly what the general path plans
    for the same rows when every token is real, in order or through slots, and still refuse an
    overflow."""
    cache = KVCache(2, 4, 2, 16, 8)
    cache.lens[:] = torch.tensor([3, 0, 7, 12])
    for slots in (None, torch.tensor([2, 0])):
        batch = 4 if slots is None else 2
        fast = cache.plan(batch, 4, slots)
        full = cache.plan(batch, 4, slots, num_tokens=torch.full((batch,), 4))
        for name in ("positions", "write_pos", "num_tokens", "flat_index"):
            assert torch.equal(getattr(fast, name), getattr(full, name)), name
        assert (fast.kv_len, fast.exact) == (full.kv_len, full.exact) == (
            int(cache.lens[:batch].max() if slots is None else cache.lens[slots].max()) + 4, True)
    with pytest.raises(ValueError, match="overflow"):
        cache.plan(4, 5)  # row 3: 12 + 5 > 16


def test_a_one_row_plan_from_its_host_known_start_is_the_general_plan():
    """Row 0 alone, exact and unpadded (a batch-1 decode or draft step) is planned from the
    row's start read on the host: the same positions, write indices and lengths as the general
    path (here reached through explicit slots), the start recorded, and overflow refused."""
    cache = KVCache(2, 3, 2, 16, 8)
    cache.lens[:] = torch.tensor([5, 9, 2])
    for seq in (1, 4):
        fast = cache.plan(1, seq)
        general = cache.plan(1, seq, torch.tensor([0]))
        for name in ("positions", "write_pos", "num_tokens", "flat_index"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert (fast.kv_len, fast.exact, fast.slots) == (5 + seq, True, None)
        assert fast.start == 5 and general.start is None
    cache.advance(cache.plan(1, 3))
    assert cache.lens.tolist() == [8, 9, 2]
    with pytest.raises(ValueError, match="overflow"):
        cache.plan(1, 9)  # 8 + 9 > 16
