"""Rotary embeddings (infer/models/rope.py); the rope types' frequencies are checked against
transformers through whole-model logits in test_llama.py."""

from types import SimpleNamespace

import pytest
import torch

from infer.kv_cache import KVCache
from infer.models.rope import (RopeConfig, RopeTable, apply_rope, rope_cos_sin, rope_frequencies,
                               step_rope)


def test_rope_rotation_is_hugging_faces_bit_for_bit():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    positions = torch.arange(40).view(2, 20)
    x = torch.randn(2, 3, 20, 16)
    cos, sin = rope_cos_sin(inv_freq, positions, 1.0, torch.float32)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    want = x * emb.cos() + torch.cat((-x2, x1), -1) * emb.sin()
    assert torch.equal(apply_rope(x, cos, sin), want)


class _Owner(torch.nn.Module):
    """A module with RoPE buffers, as the target and the heads have them."""

    def __init__(self, rope: RopeConfig, head_dim: int = 16):
        super().__init__()
        shape = SimpleNamespace(rope=rope, head_dim=head_dim, max_position_embeddings=64)
        inv_freq, self.rope_scale = rope_frequencies(shape)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


@pytest.mark.parametrize("rope", [RopeConfig(), RopeConfig(type="llama3", factor=8.0,
                                                           original_max_position_embeddings=32),
                                  RopeConfig(type="yarn", factor=4.0,
                                             original_max_position_embeddings=32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_table_is_the_computed_rope_bit_for_bit(rope, dtype):
    owner = _Owner(rope)
    positions = torch.tensor([[0, 5, 6, 7], [40, 41, 63, 2]])  # [B, T], within the table
    table = RopeTable(owner.inv_freq, owner.rope_scale, 64, dtype)
    for got, want in zip(table(positions), rope_cos_sin(owner.inv_freq, positions,
                                                        owner.rope_scale, dtype)):
        assert got.shape == want.shape == (2, 1, 4, 16) and got.dtype == dtype
        assert torch.equal(got, want)


def test_step_rope_looks_up_a_table_per_cache_and_computes_without_one():
    owner = _Owner(RopeConfig())
    cache = KVCache(1, 2, 1, 30, 16)
    step = cache.plan(2, 3)
    positions = torch.tensor([[0, 1, 2], [29, 30, 31]])  # the last two: padding past the cache
    cos, sin = step_rope(owner, positions, torch.float32, step)
    table = owner._rope_table
    assert table.cos.shape == (cache.capacity, 16)
    want_cos, _ = rope_cos_sin(owner.inv_freq, positions.clamp_max(cache.capacity - 1), 1.0,
                               torch.float32)
    assert torch.equal(cos, want_cos)  # padding is clamped to the last row, never out of range
    step_rope(owner, positions, torch.float32, step)
    step_rope(owner, positions, torch.float32, KVCache(1, 1, 1, 10, 16).plan(1, 1))
    assert owner._rope_table is table  # built once; a smaller cache reuses it
    step_rope(owner, positions, torch.float32, KVCache(1, 1, 1, 50, 16).plan(1, 1))
    assert owner._rope_table.size == 51  # a larger cache grows it
    table = owner._rope_table
    owner.inv_freq = owner.inv_freq * 2  # new frequencies (init_buffers, a move): a new table
    cos2, _ = step_rope(owner, positions[:1], torch.float32, step)
    assert owner._rope_table is not table
    assert torch.equal(cos2, rope_cos_sin(owner.inv_freq, positions[:1], 1.0, torch.float32)[0])
    train_cos, _ = step_rope(owner, torch.tensor([[100]]), torch.float32, None)  # no cache
    assert torch.equal(train_cos, rope_cos_sin(owner.inv_freq, torch.tensor([[100]]), 1.0,
                                               torch.float32)[0])


def test_a_rows_slice_of_the_table_is_its_lookup():
    """A one-row step with a host-known start reads its cos / sin as a slice of the table: the
    same values and shape as the gather by positions."""
    inv_freq, _ = rope_frequencies(SimpleNamespace(rope=RopeConfig(), head_dim=16,
                                                   max_position_embeddings=64))
    table = RopeTable(inv_freq, 1.0, 40, torch.float32)
    for start, seq in ((0, 1), (17, 1), (30, 6)):
        positions = torch.arange(start, start + seq)[None]
        for got, want in zip(table.rows(start, seq), table(positions)):
            assert got.shape == want.shape == (1, 1, seq, 16) and torch.equal(got, want)
