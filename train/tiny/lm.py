"""The tiny LMs themselves: a seeded Llama with draftsmith's special tokens, its training loop
and the held-out measures recorded in a build's meta (``train/tiny/build.py`` caches the result).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from infer.foundation.threads import GOVERNOR
from train.tiny.corpus import DOC_TOKEN, EOS_TOKEN
from train.tiny.unlikelihood import UnlikelihoodSpec

log = logging.getLogger(__name__)
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class TinyLMSpec:
    """Dimensions and training budget of one tiny Llama LM (RoPE, RMSNorm, SwiGLU, GQA)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # fewer than num_heads: grouped-query attention
    intermediate_size: int  # SwiGLU width
    steps: int  # the budget that makes a build deterministic
    batch_size: int = 4  # rows of seq_len tokens; smaller batches learn more per token here
    lr: float = 3e-3
    warmup_steps: int = 50
    max_seconds: float = 600.0  # safety cap for a machine far slower than planned
    unlikelihood: UnlikelihoodSpec = UnlikelihoodSpec()  # a last phase against greedy loops


def make_model(spec: TinyLMSpec, tokenizer: PreTrainedTokenizerBase,
               seed: int) -> LlamaForCausalLM:
    """A freshly initialised (seeded) tiny Llama with draftsmith's special-token ids."""
    end_id, doc_id = tokenizer.convert_tokens_to_ids([EOS_TOKEN, DOC_TOKEN])
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads, hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=end_id, pad_token_id=doc_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Unit-scale input embeddings (the first RMSNorm rescales them anyway). With the default 0.02,
    # the first attention layer's output, an average over earlier tokens, swamps the current
    # token's identity and training sits on a plateau: measured on the default target, 200 steps
    # of 8 rows reach a held-out loss of 4.61 with this init and 5.58-5.62 without it (lr 2e-3 to
    # 5e-3); scaling the residual output projections by 1/sqrt(2 * layers) did not help.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.generation_config = GenerationConfig(
        eos_token_id=[end_id, doc_id], pad_token_id=doc_id, bos_token_id=None)
    return model


def _schedule(spec: TinyLMSpec):
    def factor(step: int) -> float:  # linear warmup, cosine down to 10% of the peak
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        t = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, t)))
    return factor


def train_lm(model: LlamaForCausalLM, rows: torch.Tensor, spec: TinyLMSpec, seed: int, *,
             progress: bool = True, desc: str = "train") -> dict:
    """Next-token training on packed ``rows`` [n, seq_len] for ``spec.steps`` steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(spec))
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    losses: list[float] = []
    tokens, ema, stopped_early = 0, None, False
    model.train()
    start = time.monotonic()
    bar = tqdm(total=spec.steps, desc=desc, disable=not progress, mininterval=2.0,
               dynamic_ncols=True)
    for step in range(spec.steps):
        GOVERNOR.tick()  # one torch thread per free core (infer/foundation/threads.py)
        if time.monotonic() - start > spec.max_seconds:
            stopped_early = True
            break
        while len(order) < spec.batch_size:  # epochs of seeded permutations
            order = torch.cat([order, torch.randperm(len(rows), generator=gen)])
        batch, order = rows[order[:spec.batch_size]], order[spec.batch_size:]  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += batch.numel()
        ema = losses[-1] if ema is None else 0.95 * ema + 0.05 * losses[-1]
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}",
                        tok_s=f"{tokens / max(1e-9, time.monotonic() - start):.0f}",
                        refresh=False)
    bar.close()
    if stopped_early:
        log.warning("%s: time cap of %.0f s reached after %d of %d steps; this build is not "
                    "the deterministic one", desc, spec.max_seconds, len(losses), spec.steps)
    model.eval()
    every = max(1, len(losses) // 50)
    curve = [[i + every, round(sum(losses[i:i + every]) / len(losses[i:i + every]), 4)]
             for i in range(0, len(losses), every)]
    return {"steps": len(losses), "planned_steps": spec.steps, "batch_size": spec.batch_size,
            "seq_len": rows.shape[1], "lr": spec.lr, "warmup_steps": spec.warmup_steps,
            "tokens_seen": tokens, "seconds": round(time.monotonic() - start, 2),
            "num_threads": torch.get_num_threads(),
            "stopped_early": stopped_early, "loss_curve": curve}


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, rows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over ``rows`` [n, seq_len]."""
    model.eval()
    total, count = 0.0, 0
    for batch in rows.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1]  # [b, T-1, vocab]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                 batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


def utf8_bytes(tokenizer: PreTrainedTokenizerBase, rows: torch.Tensor) -> int:
    return sum(len(tokenizer.decode(row).encode("utf-8")) for row in rows.tolist())


@torch.no_grad()
def greedy_continuation(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase,
                        prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


