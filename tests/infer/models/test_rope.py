"""Rotary embeddings (infer/models/rope.py); the rope types' frequencies are checked against
transformers through whole-model logits in test_llama.py."""

import torch

from infer.models.rope import apply_rope, rope_cos_sin


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
