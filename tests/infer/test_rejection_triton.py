"""Triton rejection kernel == PyTorch reference, token for token, given the same generator seed.

On machines without CUDA these run under TRITON_INTERPRET=1 (set by tests/conftest.py), so the
shapes stay small: the interpreter executes one program per row in Python.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import infer.rejection_triton as rejection_triton  # noqa: E402
from infer.rejection import rejection_sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(batch: int = 8, k: int = 3, vocab: int = 37, seed: int = 0, ragged: bool = True):
    """Logits, drafts (a mix of likely and random tokens, ragged -1 suffixes) and draft probs."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=g)
    drafts = logits[:, :k].argmax(-1)  # [batch, k]; likely tokens so some get accepted
    noise_rows = torch.rand(batch, k, generator=g) < 0.3
    drafts[noise_rows] = torch.randint(0, vocab, (int(noise_rows.sum()),), generator=g)
    if ragged and k > 0:
        lengths = torch.arange(batch) % (k + 1)  # 0, 1, .., k drafts
        drafts[torch.arange(k) >= lengths[:, None]] = -1
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    return logits.to(DEVICE), drafts.to(DEVICE), q.to(DEVICE)


def _both(logits, drafts, q=None, seed=0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for impl in ("torch", "triton"):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        outs.append(rejection_sample(logits, drafts, q, generator=g, impl=impl, **kwargs))
    return outs[0], outs[1]


@pytest.mark.parametrize("method,with_q,rate", [
    ("strict", False, None),
    ("probabilistic", True, None),
    ("probabilistic", False, None),
    ("synthetic", False, 0.5),
    ("synthetic", False, 1.0),
    ("block", True, None),
    ("block", False, None),
])
def test_kernel_matches_reference(method, with_q, rate):
    logits, drafts, q = _case()
    for seed in range(3):
        ref, tri = _both(logits, drafts, q if with_q else None, seed=seed, temperature=1.0,
                         method=method, synthetic_acceptance_rate=rate)
        assert torch.equal(ref, tri), (seed, ref, tri)


@pytest.mark.parametrize("method", ["strict", "probabilistic", "block"])
def test_kernel_matches_reference_greedy_and_mixed_rows(method):
    logits, drafts, q = _case(seed=1)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 2.0, 0.0, 1.0], device=DEVICE)
    for temp in (0.0, temperature):
        ref, tri = _both(logits, drafts, q if method != "strict" else None,
                         temperature=temp, method=method)
        assert torch.equal(ref, tri)


def test_kernel_matches_reference_with_top_k_top_p():
    logits, drafts, q = _case(seed=2)
    top_k = torch.tensor([0, 1, 3, 5, 0, 2, 10, 4], device=DEVICE)
    ref, tri = _both(logits, drafts, q, temperature=0.8, method="probabilistic", top_k=top_k,
                     top_p=0.7)
    assert torch.equal(ref, tri)


def test_kernel_matches_reference_across_vocab_chunks(monkeypatch):
    """Several BLOCK_V chunks: the running argmax must keep the reference's choice."""
    monkeypatch.setattr(rejection_triton, "MAX_BLOCK_V", 16)
    logits, drafts, q = _case(batch=6, k=2, vocab=53, seed=3)
    for method, dq in [("strict", None), ("probabilistic", q), ("block", q), ("block", None)]:
        ref, tri = _both(logits, drafts, dq, temperature=1.0, method=method)
        assert torch.equal(ref, tri), method


def test_kernel_matches_reference_on_residual_fallback():
    """q = 2p: rejected rows have an all-zero residual and fall back to p."""
    logits, drafts, _ = _case(seed=7, ragged=False)
    probs = torch.softmax(logits[:, :-1], -1)
    ref, tri = _both(logits, drafts, 2 * probs, temperature=1.0, method="probabilistic")
    assert torch.equal(ref, tri)
    assert (ref[:, 0] != drafts[:, 0]).any()  # some rows really took the fallback path


def test_kernel_handles_k_zero_and_full_rows():
    logits, drafts, q = _case(batch=4, k=0, vocab=11, seed=5)
    ref, tri = _both(logits, drafts, temperature=1.0)
    assert torch.equal(ref, tri) and ref.shape == (4, 1)
    logits, drafts, q = _case(batch=4, k=4, vocab=11, seed=6, ragged=False)
    ref, tri = _both(logits, drafts, q, temperature=1.0, method="probabilistic")
    assert torch.equal(ref, tri)
