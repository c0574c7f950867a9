"""Rejection sampler: verifies a drafter's tokens against the target model (vLLM-style).

Terms, per request (row) with ``n`` drafted tokens ``x_0 .. x_{n-1}`` (``n <= k``):

- *accepted* tokens: the drafts kept left to right until the first rejection.
- *recovered* token: sampled at the first rejected position ``j`` from the method's residual
  distribution; it replaces ``x_j`` and ends the row.
- *bonus* token: if all ``n`` drafts are accepted, one more token is sampled from the target's
  distribution at position ``n`` (the target verified ``k + 1`` positions in one forward).

Output: ``[batch, k + 1]`` long = accepted drafts, then the recovered or bonus token, then -1.
So every row emits at least one token, and ``num_accepted = (out >= 0).sum(1) - 1``.

Methods (``p`` = target distribution after temperature / top-k / top-p, ``q`` = draft's):

- ``strict``: sample the target's token at each position; accept while it equals the draft; the
  first mismatching sample is the recovered token. Lossless and needs no ``q``. It is implemented
  in the equivalent form "accept ``x`` with probability ``p(x)``; recover from ``p`` with ``x``
  removed", which is exactly ``probabilistic`` with ``q`` one-hot at the draft: the same output
  law, but one noise vector per row instead of ``k + 1``.
- ``probabilistic`` (Leviathan et al. 2022, Chen et al. 2023): accept ``x`` with probability
  ``min(1, p(x) / q(x))``; recover from ``normalize(max(p - q, 0))`` (``p`` if that is all zero).
  Lossless. ``draft_probs=None`` means ``q`` one-hot at the draft (n-gram style proposers).
- ``block`` (block verification, Sun et al. 2024): the drafts are judged as a block, not one by
  one. With ``p_0 = 1`` and ``p_i = min(1, p_{i-1} p(x_i) / q(x_i))``, position ``i < n`` may
  end the block with probability ``h_i = Z_{i+1} / (Z_{i+1} + 1 - p_i)``, where ``Z_{i+1} =
  sum_v max(p_i p_i(v) - q_{i+1}(v), 0)`` (``p_i(v)``: the target's distribution after ``i``
  drafts), and ``h_n = p_n``; one uniform per position, and the block keeps the drafts up to the
  last position ``tau`` whose uniform is ``<= h_tau`` (0 if none). Then ``tau < n``: the next
  token from ``normalize(max(p_tau p_tau(.) - q_{tau+1}(.), 0))``; ``tau = n``: the bonus token
  from ``p_n``. Lossless (the paper's Theorem 1) and accepts at least as much as the token-by-
  token test in expectation (Theorem 2). ``draft_probs=None``: ``q`` one-hot at the draft.
- ``synthetic``: accept each position with a fixed conditional probability ``a_n`` chosen so that
  the expected ``accepted / drafted`` equals ``synthetic_acceptance_rate`` for a row with ``n``
  drafts; recovered / bonus tokens come from ``p``. For benchmarking; not lossless.

Greedy rows (temperature 0) get a one-hot ``p`` at the argmax, so ``strict`` and
``probabilistic`` reduce exactly to "accept while draft == argmax; recovered/bonus = argmax".

Randomness is drawn here, in torch, before dispatch: uniforms ``[batch, k]`` for the acceptance
tests and Exp(1) noise ``[batch, vocab]`` for the one recovered/bonus token per row (the
exponential race: ``argmax(r / noise)`` samples from ``normalize(r)``). The PyTorch reference and
the Triton kernel (``infer/rejection_triton.py``) consume the same tensors and only do the
deterministic part, so their outputs are identical for the same generator state. Nothing in the
hot path synchronises with the host.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from infer.sampling import Generator, fill_random_, logits_to_probs
from infer.spec_config import REJECTION_SAMPLE_METHODS
from infer.foundation.validation import config_error

IMPLS = ("auto", "torch", "triton")
_WHERE = "rejection_sample"

Number = float | int
Core = Callable[..., torch.Tensor]


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: Optional[torch.Tensor] = None, *,
                     temperature: Number | torch.Tensor, method: str = "strict",
                     top_k: int | torch.Tensor | None = None,
                     top_p: float | torch.Tensor | None = None,
                     generator: Generator = None,
                     synthetic_acceptance_rate: Optional[float] = None,
                     impl: str = "auto", draw_k: int = 0) -> torch.Tensor:
    """Verify drafts against the target; returns ``[batch, k + 1]`` long (see module docstring).

    target_logits ``[batch, k + 1, vocab]``; draft_token_ids ``[batch, k]`` with a -1 suffix
    where a row drafted fewer than k tokens; draft_probs ``[batch, k, vocab]`` (probabilistic
    only; ignored otherwise). temperature / top_k / top_p: scalars or ``[batch]`` tensors.
    impl: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton".
    draw_k: draw uniforms as for ``max(k, draw_k)`` drafts and use the first k: the engine
    passes its k, so a seeded request's random stream does not depend on how many tokens the
    other requests of its batch drafted (lookup proposers trim the batch to its longest draft).
    """
    _validate(target_logits, draft_token_ids, draft_probs, temperature, method, top_k, top_p,
              synthetic_acceptance_rate, impl)
    k = draft_token_ids.shape[1]
    probs = logits_to_probs(target_logits, temperature, top_k, top_p)
    probs = probs.contiguous()  # [batch, k + 1, vocab] fp32
    uniforms, noise = draw_randomness(probs.shape[0], max(k, draw_k), probs.shape[2],
                                      probs.device, generator)
    if k == 0:  # no drafts (plain decoding): the core's bonus token is a plain sample from p,
        return (probs[:, 0] / noise).argmax(dim=-1, keepdim=True)  # and its ~30 ops cost ~0.1 ms
    draft_ids = draft_token_ids.long().contiguous()  # [batch, k]
    # drafted tokens are the non-negative prefix (robust even if a -1 were not a suffix)
    num_drafts = (draft_ids >= 0).long().cumprod(dim=1).sum(dim=1)  # [batch]
    q = None
    if method in ("probabilistic", "block") and draft_probs is not None:
        q = draft_probs.float().contiguous()  # [batch, k, vocab]
    accept_prob = None
    if method == "synthetic":
        accept_prob = synthetic_accept_probs(num_drafts, synthetic_acceptance_rate, k)  # [batch]
    uniforms = uniforms[:, :k].contiguous()  # [batch, k]
    core = _pick_core(impl, probs, block=method == "block")
    return core(probs, draft_ids, num_drafts, uniforms, noise, q, accept_prob)


def argmax_verify(temperature: Number | torch.Tensor | None, method: str) -> bool:
    """Whether the target's argmax decides a step (:func:`greedy_verify`, or a draft tree's
    walk): every row greedy (a scalar temperature <= 0; the engine passes a scalar when all rows
    share one) and no synthetic acceptance. One rule for the engine and the proposers that
    prepare a tree."""
    return (method != "synthetic" and not isinstance(temperature, torch.Tensor)
            and temperature is not None and temperature <= 0)


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor) -> torch.Tensor:
    """What :func:`rejection_sample` returns when every row is greedy (temperature 0) and the
    method is ``strict`` or ``probabilistic``: accept drafts while they equal the target's argmax;
    the recovered / bonus token is the argmax at the first mismatch / after the last draft.

    ``[batch, k + 1, vocab]``, ``[batch, k]`` (-1 padded) -> ``[batch, k + 1]``. No softmax, no
    random numbers (so, unlike ``rejection_sample``, it leaves any generator untouched).
    """
    k = draft_token_ids.shape[1]
    best = target_logits.argmax(dim=-1)  # [batch, k + 1]; ties -> first index, as one-hot p
    draft_ids = draft_token_ids.long()
    if k == 0:
        return best
    drafted = (draft_ids >= 0).long().cumprod(dim=1).bool()  # [batch, k]
    accept = (draft_ids == best[:, :k]) & drafted
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [batch]
    final = best.gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
    return _assemble(draft_ids, num_accepted, final)


def draw_randomness(batch: int, k: int, vocab: int, device: torch.device,
                    generator: Generator = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms ``[batch, k]`` in [0, 1) and Exp(1) noise ``[batch, vocab]``, in that order.

    Both implementations read these, which is what makes them bit-identical. The noise is
    clamped away from 0 so ``r / noise`` never divides by zero (as in ``sample_from_probs``).
    A :class:`~infer.sampling.BatchGenerator` gives seeded requests rows of their own.
    """
    uniforms = torch.empty(batch, k, dtype=torch.float32, device=device)  # [batch, k]
    noise = torch.empty(batch, vocab, dtype=torch.float32, device=device)  # [batch, vocab]
    fill_random_(uniforms, "uniform", generator)
    fill_random_(noise, "exponential", generator)
    return uniforms, noise.clamp_min_(1e-20)


@functools.lru_cache(maxsize=1024)
def synthetic_accept_prob(n: int, rate: float) -> float:
    """Conditional acceptance ``a`` with ``(a + a^2 + ... + a^n) / n == rate``, by bisection.

    A row stops at its first rejection, so accepting each position with probability ``a``
    accepts ``a + ... + a^n`` tokens on average; the left side rises from 0 to 1 on [0, 1].
    """
    if n <= 0 or rate <= 0.0:
        return 0.0
    if rate >= 1.0:  # exact ends: u < 1 always accepts, u < 0 never does
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, n + 1)) / n < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def synthetic_accept_probs(num_drafts: torch.Tensor, rate: float, k: int) -> torch.Tensor:
    """Per-row ``a_n`` ``[batch]`` fp32, gathered from a cached device table over n = 0..k."""
    return _synthetic_table(float(rate), k, num_drafts.device)[num_drafts]  # [batch]


@functools.lru_cache(maxsize=64)
def _synthetic_table(rate: float, k: int, device: torch.device) -> torch.Tensor:
    """Built once per (rate, k, device), so steady-state steps do no host-to-device copy
    (and stay CUDA-graph capturable after a warm-up call)."""
    table = [synthetic_accept_prob(n, rate) for n in range(k + 1)]
    return torch.tensor(table, dtype=torch.float32, device=device)  # [k + 1]


def rejection_core_reference(probs: torch.Tensor, draft_ids: torch.Tensor,
                             num_drafts: torch.Tensor, uniforms: torch.Tensor,
                             noise: torch.Tensor, draft_probs: Optional[torch.Tensor] = None,
                             accept_prob: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference of the deterministic part; the Triton kernel must match it exactly.

    probs ``[batch, k + 1, vocab]`` fp32; draft_ids ``[batch, k]``; num_drafts ``[batch]``;
    uniforms ``[batch, k]``; noise ``[batch, vocab]``; draft_probs ``[batch, k, vocab]`` or None
    (one-hot q: strict); accept_prob ``[batch]`` for synthetic, else None.
    """
    accept = _accept_mask(probs, draft_ids, num_drafts, uniforms, draft_probs, accept_prob)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [batch]
    dist = _final_distribution(probs, draft_ids, num_drafts, num_accepted, draft_probs,
                               synthetic=accept_prob is not None)  # [batch, vocab]
    final = (dist / noise).argmax(dim=-1)  # [batch]
    return _assemble(draft_ids, num_accepted, final)


def block_core_reference(probs: torch.Tensor, draft_ids: torch.Tensor,
                         num_drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor,
                         draft_probs: Optional[torch.Tensor] = None,
                         accept_prob: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block verification (module doc), PyTorch reference of the Triton kernel: same tensors as
    :func:`rejection_core_reference` (``accept_prob`` unused)."""
    k = draft_ids.shape[1]
    ids = draft_ids.clamp_min(0)  # [batch, k]
    p_x = probs[:, :k].gather(-1, ids[..., None]).squeeze(-1)  # [batch, k]: p_{i-1}(x_i)
    q_x = (torch.ones_like(p_x) if draft_probs is None
           else draft_probs.gather(-1, ids[..., None]).squeeze(-1))  # [batch, k]
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.zeros_like(p_x))
    block = [torch.ones_like(p_x[:, 0])]  # p_0 = 1
    for i in range(k):  # p_i = min(1, p_{i-1} * p(x_i) / q(x_i)); k is small
        block.append(torch.minimum(block[-1] * ratio[:, i], torch.ones_like(block[-1])))
    p_blk = torch.stack(block, dim=1)  # [batch, k + 1]
    if draft_probs is None:  # sum_v max(p_i p_i(v) - onehot(x_{i+1})(v), 0)
        z = p_blk[:, :k] * (1 - p_x)  # [batch, k]: Z_{i+1}, i = 0..k-1
    else:
        z = (p_blk[:, :k, None] * probs[:, :k] - draft_probs).clamp_min(0).sum(-1)
    denom = z + 1 - p_blk[:, :k]
    h = torch.where(denom > 0, z / denom.clamp_min(1e-30), torch.zeros_like(z))  # [batch, k]
    i = torch.arange(1, k + 1, device=probs.device)  # block positions 1..k
    n = num_drafts[:, None]  # [batch, 1]
    h_at = torch.where(i < n, F.pad(h[:, 1:], (0, 1)), p_blk[:, 1:])  # h_i, h_n = p_n
    ends = (uniforms <= h_at) & (i <= n)  # [batch, k]
    tau = (ends * i).amax(dim=1)  # [batch]: the last position that may end the block, or 0
    final = (_block_residual(probs, draft_ids, draft_probs, p_blk, tau, num_drafts)
             / noise).argmax(dim=-1)  # [batch]
    return _assemble(draft_ids, tau, final)


def _block_residual(probs: torch.Tensor, draft_ids: torch.Tensor,
                    draft_probs: Optional[torch.Tensor], p_blk: torch.Tensor, tau: torch.Tensor,
                    num_drafts: torch.Tensor) -> torch.Tensor:
    """``[batch, vocab]``: where the block ends early, ``max(p_tau p_tau(.) - q_{tau+1}(.), 0)``
    (``p_tau(.)`` itself if that is all zero); after every draft, the target's ``p_n(.)``."""
    k = draft_ids.shape[1]
    p_fin = _take_position(probs, tau)  # [batch, vocab]
    pos = tau.clamp(max=k - 1)  # [batch]; rows that kept every draft are masked out below
    scale = p_blk.gather(1, tau[:, None])  # [batch, 1]: p_tau
    if draft_probs is None:
        x = draft_ids.gather(1, pos[:, None]).clamp_min(0)  # [batch, 1]
        residual = (scale * p_fin).scatter(-1, x, 0.0)  # max(p_tau p - onehot(x), 0)
    else:
        residual = (scale * p_fin - _take_position(draft_probs, pos)).clamp_min(0.0)
    early = (tau < num_drafts)[:, None]
    return torch.where(early & (residual.amax(dim=-1, keepdim=True) > 0), residual, p_fin)


def _accept_mask(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                 uniforms: torch.Tensor, draft_probs: Optional[torch.Tensor],
                 accept_prob: Optional[torch.Tensor]) -> torch.Tensor:
    """``[batch, k]`` bool: would position j accept its draft (ignoring earlier rejections)?

    ``u * q(x) < p(x)`` is ``u < min(1, p/q)`` without a division (and rejects p = q = 0).
    """
    k = draft_ids.shape[1]
    ids = draft_ids.clamp_min(0).unsqueeze(-1)  # [batch, k, 1]
    p_x = probs[:, :k].gather(-1, ids).squeeze(-1)  # [batch, k]
    if accept_prob is not None:
        ok = uniforms < accept_prob[:, None]
    elif draft_probs is None:
        ok = uniforms < p_x
    else:
        ok = uniforms * draft_probs.gather(-1, ids).squeeze(-1) < p_x
    drafted = torch.arange(k, device=probs.device) < num_drafts[:, None]  # [batch, k]
    return ok & drafted


def _final_distribution(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                        num_accepted: torch.Tensor, draft_probs: Optional[torch.Tensor],
                        synthetic: bool) -> torch.Tensor:
    """Unnormalised distribution ``[batch, vocab]`` of each row's recovered / bonus token.

    Only the row's final position is gathered, so no ``[batch, k, vocab]`` residual exists.
    """
    k = draft_ids.shape[1]
    p_fin = _take_position(probs, num_accepted)  # [batch, vocab]
    if synthetic or k == 0:
        return p_fin
    pos = num_accepted.clamp(max=k - 1)  # [batch]; bonus rows are masked out below
    if draft_probs is None:
        x = draft_ids.gather(1, pos[:, None]).clamp_min(0)  # [batch, 1]
        residual = p_fin.scatter(-1, x, 0.0)  # max(p - onehot(x), 0)
    else:
        residual = (p_fin - _take_position(draft_probs, pos)).clamp_min(0.0)
    rejected = (num_accepted < num_drafts)[:, None]  # [batch, 1]
    use_residual = rejected & (residual.amax(dim=-1, keepdim=True) > 0)
    return torch.where(use_residual, residual, p_fin)


def _take_position(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``t[b, pos[b], :]`` for ``t`` ``[batch, positions, vocab]`` -> ``[batch, vocab]``."""
    index = pos.view(-1, 1, 1).expand(-1, 1, t.shape[-1])
    return t.gather(1, index).squeeze(1)


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor,
              final: torch.Tensor) -> torch.Tensor:
    """Accepted drafts, the final token at slot ``num_accepted``, then -1: ``[batch, k + 1]``."""
    k = draft_ids.shape[1]
    slots = torch.arange(k + 1, device=draft_ids.device)  # [k + 1]
    padded = F.pad(draft_ids, (0, 1), value=-1)  # [batch, k + 1]
    n = num_accepted[:, None]  # [batch, 1]
    out = torch.where(slots < n, padded, torch.full_like(padded, -1))
    return torch.where(slots == n, final[:, None], out)


@functools.lru_cache(maxsize=2)
def _triton_core(block: bool = False) -> Optional[Core]:
    """The Triton implementation, or None where triton is absent (macOS, CPU-only installs)."""
    try:
        from infer.rejection_triton import block_core_triton, rejection_core_triton
    except ImportError:
        return None
    return block_core_triton if block else rejection_core_triton


def _pick_core(impl: str, probs: torch.Tensor, block: bool = False) -> Core:
    reference = block_core_reference if block else rejection_core_reference
    if impl == "torch":
        return reference
    core = _triton_core(block)
    if impl == "triton":
        if core is None:
            raise config_error("impl", impl, "'auto' or 'torch' (triton is not importable)", _WHERE)
        return core
    return core if core is not None and probs.is_cuda else reference


def _describe(t: object) -> object:
    """Short form of a tensor for error messages (never prints its values)."""
    if isinstance(t, torch.Tensor):
        return f"tensor(shape={list(t.shape)}, dtype={t.dtype}, device={t.device})"
    return t


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate(target_logits, draft_token_ids, draft_probs, temperature, method, top_k, top_p,
              rate, impl) -> None:
    """Shape / dtype / Python-value checks only: nothing here reads tensor data."""
    if method not in REJECTION_SAMPLE_METHODS:
        raise config_error("method", method, f"one of {', '.join(REJECTION_SAMPLE_METHODS)}",
                           _WHERE)
    if impl not in IMPLS:
        raise config_error("impl", impl, f"one of {', '.join(IMPLS)}", _WHERE)
    if not (isinstance(target_logits, torch.Tensor) and target_logits.ndim == 3
            and target_logits.is_floating_point() and target_logits.shape[2] > 0):
        raise config_error("target_logits", _describe(target_logits),
                           "a float tensor [batch, k + 1, vocab] with vocab >= 1", _WHERE)
    batch, k1, vocab = target_logits.shape
    if not (isinstance(draft_token_ids, torch.Tensor) and not draft_token_ids.is_floating_point()
            and draft_token_ids.dtype != torch.bool
            and tuple(draft_token_ids.shape) == (batch, k1 - 1)):
        raise config_error("draft_token_ids", _describe(draft_token_ids),
                           f"an integer tensor [batch, k] = [{batch}, {k1 - 1}] (target_logits "
                           f"has k + 1 = {k1} positions)", _WHERE)
    if draft_probs is not None and not (
            isinstance(draft_probs, torch.Tensor) and draft_probs.is_floating_point()
            and tuple(draft_probs.shape) == (batch, k1 - 1, vocab)):
        raise config_error("draft_probs", _describe(draft_probs),
                           f"None or a float tensor [batch, k, vocab] = [{batch}, {k1 - 1}, "
                           f"{vocab}]", _WHERE)
    _check_per_row("temperature", temperature, batch, "a finite number >= 0",
                   lambda v: _is_number(v) and math.isfinite(v) and v >= 0, optional=False)
    _check_per_row("top_k", top_k, batch, "an integer (<= 0 disables)",
                   lambda v: isinstance(v, int) and not isinstance(v, bool))
    _check_per_row("top_p", top_p, batch, "a number in (0, 1]",
                   lambda v: _is_number(v) and 0 < v <= 1)
    _check_rate(method, rate)
    _check_devices(target_logits, draft_token_ids=draft_token_ids, draft_probs=draft_probs,
                   temperature=temperature, top_k=top_k, top_p=top_p)


def _check_per_row(key: str, value: object, batch: int, scalar_rule: str,
                   scalar_ok: Callable[[object], bool], optional: bool = True) -> None:
    """A sampling knob is a Python scalar obeying ``scalar_ok`` or a ``[batch]`` tensor."""
    if value is None and optional:
        return
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != (batch,):
            raise config_error(key, _describe(value), f"{scalar_rule} or a [batch] = [{batch}] "
                               "tensor", _WHERE)
        return
    if not scalar_ok(value):
        allowed = f"{scalar_rule} or a [batch] tensor" + ("" if not optional else ", or None")
        raise config_error(key, value, allowed, _WHERE)


def _check_rate(method: str, rate: object) -> None:
    if method != "synthetic":
        if rate is not None:
            raise config_error("synthetic_acceptance_rate", rate,
                               f"None unless method='synthetic' (method={method!r})", _WHERE)
        return
    if not (_is_number(rate) and 0.0 <= rate <= 1.0):
        raise config_error("synthetic_acceptance_rate", rate,
                           "a number in [0, 1] (required with method='synthetic')", _WHERE)


def _check_devices(target_logits: torch.Tensor, **tensors: object) -> None:
    for key, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != target_logits.device:
            allowed = f"a tensor on target_logits' device ({target_logits.device})"
            raise config_error(key, _describe(t), allowed, _WHERE)
