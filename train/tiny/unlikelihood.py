"""Sequence-level unlikelihood fine-tuning: the last phase of a tiny-target build.

A few-million-parameter LM trained for minutes predicts code well on average (held-out
cross-entropy under 0.6x a unigram model's) yet its *greedy* continuations fall into loops
(``self._loop, self._loop, self._loop, ...``): where it is unsure, copying recent context is its
most likely guess, and each copy makes the next one likelier. Real deployed targets rarely do
that, and a looping target flatters n-gram and suffix drafting, which copy context too.

The fix is the one of Welleck et al. (2019, "Neural text generation with unlikelihood
training", see docs/reference.md §9): the model generates greedy continuations of short
prefixes, every token that belongs to a repeated 4-gram of its own continuation becomes a
negative candidate, and the loss adds ``-log(1 - p(token))`` for those tokens to the ordinary
next-token loss on real rows (which keeps the model honest). Measured on the 8-layer target
(``docs/benchmarks-history.md``): 150 such steps (timings below) cut the repetition of greedy
continuations from 0.54 to 0.22 and the looping ones from 6 of 16 to 1, while held-out
cross-entropy moved from 0.589 to 0.596 of the unigram model's.

Generating a step's four continuations token by token was two thirds of the phase: 64
forwards of four rows each, every one paying a whole forward's fixed cost. With
``generate_every`` = G the continuations of G steps are generated in one batch by the model as
it is at the first of them; at a learning rate of 3e-4 the model barely moves within 25 steps.
On the 8-layer target's next-token phase, G = 25 took 48 s against 112 s for G = 1, with the
same effect (repetition 0.56 -> 0.18 against 0.21, 3 of 32 continuations looping either way;
cross-entropy 0.590 -> 0.596 against 0.595 of the unigram model's; docs/benchmarks-history.md, ninth
session).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from train.tiny.quality import REPETITION_N, greedy_tokens


@dataclass(frozen=True)
class UnlikelihoodSpec:
    """The fine-tuning phase (``steps = 0``: none)."""

    steps: int = 0
    lr: float = 3e-4  # constant; about the main phase's final rate
    weight: float = 1.0  # of the unlikelihood term next to the next-token loss
    batch_size: int = 4  # real rows for the next-token loss, and prefixes to continue
    prefix_tokens: int = 32
    new_tokens: int = 64
    #: steps whose greedy continuations are generated together, by the model as it is at the
    #: first of them: one batched ``generate`` instead of one per step (module doc)
    generate_every: int = 1

    def __post_init__(self):
        every = self.generate_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"invalid value for 'generate_every': {every!r}; "
                             "expected an integer >= 1 (steps per batched generate)")


def repeated_ngram_mask(tokens: torch.Tensor, n: int = REPETITION_N) -> torch.Tensor:
    """True on every token of an n-gram that already occurred earlier in its row.

    tokens: [B, L] -> bool [B, L]
    """
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for b, row in enumerate(tokens.tolist()):
        seen: set[tuple[int, ...]] = set()
        for i in range(n, len(row) + 1):
            gram = tuple(row[i - n:i])
            if gram in seen:
                mask[b, i - n:i] = True
            seen.add(gram)
    return mask


def unlikelihood_loss(logits: torch.Tensor, tokens: torch.Tensor,
                      negatives: torch.Tensor) -> torch.Tensor:
    """Mean over all positions of ``-log(1 - p(token))`` where ``negatives`` is set.

    logits: [B, L, V] predicting tokens [B, L]; negatives: bool [B, L]
    """
    p = logits.float().softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, L]
    penalty = -torch.log1p(-p.clamp(max=1.0 - 1e-5))
    return (penalty * negatives).sum() / negatives.numel()


def _step_loss(model: LlamaForCausalLM, batch: torch.Tensor, full: torch.Tensor,
               spec: UnlikelihoodSpec) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(next-token loss on ``batch``, unlikelihood loss on the greedy continuations ``full``
    [B, P + N] (prefix and continuation), share of negatives)."""
    mle = model(input_ids=batch, labels=batch).loss
    prefix = full.shape[1] - spec.new_tokens  # P (rows shorter than prefix_tokens give less)
    cont = full[:, prefix:]  # [B, N]
    negatives = repeated_ngram_mask(cont)
    logits = model(input_ids=full).logits[:, prefix - 1:-1]  # [B, N, V]
    return mle, unlikelihood_loss(logits, cont, negatives), float(negatives.float().mean())


def _continuations(model: LlamaForCausalLM, rows: torch.Tensor, spec: UnlikelihoodSpec,
                   steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Greedy continuations of random row prefixes for the next ``steps`` steps, generated in
    one batch: ``steps`` tensors [B, P + N]."""
    picks = torch.randint(0, len(rows), (steps * spec.batch_size,), generator=gen)
    full = greedy_tokens(model, rows[picks, :spec.prefix_tokens], spec.new_tokens)
    return list(full.split(spec.batch_size))


def finetune(model: LlamaForCausalLM, rows: torch.Tensor, spec: UnlikelihoodSpec, seed: int, *,
             progress: bool = True, desc: str = "unlikelihood") -> dict:
    """``spec.steps`` steps of next-token + unlikelihood loss; returns stats for the meta.

    rows: [n, seq_len] packed training rows (the real text, and the source of the prefixes).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    start, curve = time.monotonic(), []
    model.train()
    queued: list[torch.Tensor] = []
    for step in tqdm(range(spec.steps), desc=desc, disable=not progress, mininterval=2.0,
                     dynamic_ncols=True):
        if not queued:  # the next generate_every steps' continuations, in one batch
            n = min(spec.generate_every, spec.steps - step)
            queued = _continuations(model, rows, spec, n, gen)
        batch = rows[torch.randint(0, len(rows), (spec.batch_size,), generator=gen)]  # [B, T]
        mle, ul, share = _step_loss(model, batch, queued.pop(0), spec)
        (mle + spec.weight * ul).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append([step + 1, round(mle.item(), 4), round(ul.item(), 4), round(share, 4)])
    model.eval()
    every = max(1, len(curve) // 20)
    return {"steps": spec.steps, "lr": spec.lr, "weight": spec.weight,
            "seconds": round(time.monotonic() - start, 2),
            "curve_step_mle_ul_negatives": curve[every - 1::every]}
