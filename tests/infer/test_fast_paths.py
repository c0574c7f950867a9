"""The engine's fast paths equal the general ones: fused projections, greedy verification."""

import torch

from infer.models.llama import Llama, ModelConfig
from infer.rejection import greedy_verify, rejection_sample


def test_fused_projections_match_separate_and_keep_names():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, qkv_bias=True)
    model = Llama(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        ref = model.forward_train(ids).logits
        names = set(model.state_dict())
        model.fuse_projections()
        assert set(model.state_dict()) == names
        torch.testing.assert_close(model.forward_train(ids).logits, ref, rtol=1e-5, atol=1e-6)
        model.layers[0].self_attn.k_proj.weight.add_(1.0)  # in-place edits reach the fused weight
        fused = model.forward_train(ids).logits
        model.load_state_dict(model.state_dict())  # copies into the same storage: still fused
        for layer in model.layers:  # unfused reference
            layer.self_attn._qkv = layer.mlp._gate_up = None
        torch.testing.assert_close(model.forward_train(ids).logits, fused, rtol=1e-5, atol=1e-6)


def test_greedy_verify_equals_rejection_sample_at_temperature_zero():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        b, k, vocab = 5, 4, 7
        logits = torch.randn(b, k + 1, vocab, generator=g)
        logits[0, :, 3] = logits[0, :, 2]  # ties resolve to the first index in both
        best = logits.argmax(-1)
        drafts = torch.randint(0, vocab, (b, k), generator=g)
        drafts = torch.where(torch.rand(b, k, generator=g) < 0.6, best[:, :k], drafts)
        n = torch.randint(0, k + 1, (b,), generator=g)
        drafts = torch.where(torch.arange(k) < n[:, None], drafts, -1)
        for method in ("strict", "probabilistic"):
            q = torch.rand(b, k, vocab, generator=g).softmax(-1) if method != "strict" else None
            out = rejection_sample(logits, drafts, q, temperature=0.0, method=method, generator=g)
            assert torch.equal(out, greedy_verify(logits, drafts))
    empty = torch.empty(3, 0, dtype=torch.long)
    logits = torch.randn(3, 1, 9)
    assert torch.equal(greedy_verify(logits, empty), logits.argmax(-1))
