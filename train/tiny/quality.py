"""How much the embedded target is like a real one: two numbers a build records in its meta.

- ``heldout_loss_vs_unigram``: the LM's cross-entropy on held-out rows over a unigram model's
  (token frequencies of the training rows, add-one smoothed), same tokens: how much context the
  model uses. A real code LM is far below 0.6; a model barely past counting tokens is near 1.
- ``greedy_repetition``: ``repetition(tokens, 4)`` of greedy continuations of held-out prefixes:
  the share of the continuation's 4-grams that already occurred in it. Tiny LMs fall into loops
  (the same line over and over), which flatters n-gram and suffix drafting: a good stand-in
  for a real target keeps this low.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaForCausalLM

REPETITION_N = 4


def repetition(tokens: list[int], n: int = REPETITION_N) -> float:
    """Share of the n-grams of ``tokens`` that repeat an earlier one (0: none repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def unigram_loss(train_rows: torch.Tensor, eval_rows: torch.Tensor, vocab_size: int) -> float:
    """Mean cross-entropy (nats) of ``eval_rows[:, 1:]`` under the add-one smoothed token
    frequencies of ``train_rows`` (the tokens a next-token loss scores)."""
    counts = torch.bincount(train_rows.flatten(), minlength=vocab_size).double() + 1.0
    logp = counts.log() - math.log(float(counts.sum()))  # [V]
    return float(-logp[eval_rows[:, 1:].flatten()].mean())


@torch.no_grad()
def greedy_tokens(model: LlamaForCausalLM, prefixes: torch.Tensor,
                  new_tokens: int) -> torch.Tensor:
    """prefixes [B, P] -> prefixes and exactly ``new_tokens`` greedy tokens [B, P + new_tokens]
    (stop tokens do not end a row early). Leaves the model in the mode it found it in."""
    was_training = model.training
    model.eval()
    out = model.generate(prefixes, attention_mask=torch.ones_like(prefixes),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=model.generation_config.pad_token_id)
    model.train(was_training)
    return out


def greedy_repetition(model: LlamaForCausalLM, eval_rows: torch.Tensor, prompts: int = 8,
                      prefix: int = 64, new_tokens: int = 96) -> float:
    """Mean ``repetition`` of greedy continuations of the first ``prefix`` tokens of
    ``prompts`` held-out rows."""
    out = greedy_tokens(model, eval_rows[:prompts, :prefix], new_tokens)  # [P, prefix + new]
    return sum(repetition(row.tolist()) for row in out[:, prefix:]) / len(out)


def measure(model: LlamaForCausalLM, loss: float, train_rows: torch.Tensor,
            eval_rows: torch.Tensor) -> dict:
    """The meta fields (module doc); ``loss``: the model's held-out loss on ``eval_rows``."""
    uni = unigram_loss(train_rows, eval_rows, model.config.vocab_size)
    return {"heldout_unigram_loss": round(uni, 5),
            "heldout_loss_vs_unigram": round(loss / uni, 4),
            "greedy_repetition": round(greedy_repetition(model, eval_rows), 4)}
