"""Pieces shared by the learned drafters: checkpoint I/O, the training-time KV store, and the
Hugging Face config dict of a draft layer.

Checkpoints are a directory with ``config.json`` + ``model.safetensors`` (what vLLM and SGLang
load). Writes are atomic (``infer/foundation/atomic.py``), so a crash mid-save never leaves a
half-written
checkpoint that a later load would half-trust. Reads reuse the target loader's directory /
safetensors rules (local dir or cached hub id; pickled weights are refused).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from infer.foundation.atomic import atomic_dir, atomic_file, remove_leftovers
from infer.foundation.errors import FileFormatError, MissingFileError
from infer.foundation.files import read_json, read_safetensors
from infer.models.attention import attend, cache_mask
from infer.models.groups import (ForwardGroup, flat_logits_at, flat_tokens, plan_groups,
                                 split_picked)
from infer.models.llama import ModelConfig
from infer.models.loader import resolve_model_dir, weight_files
from infer.draft_config import checkpoint_method

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def write_checkpoint(path: str | Path, config: dict, tensors: dict[str, Tensor],
                     extra_files: Sequence[Path] = ()) -> Path:
    """Write ``config.json``, ``model.safetensors`` and copies of ``extra_files`` (tokenizer
    files ...) into ``path`` atomically.

    A new directory appears in one rename; into an existing one the weights and extra files are
    replaced first and ``config.json`` last, each file atomically (other files there are left
    alone). ``torch_dtype`` is recorded from the first floating-point tensor.
    """
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    if dtype is not None:
        config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    order = [WEIGHTS_NAME, *(Path(f).name for f in extra_files), CONFIG_NAME]
    remove_leftovers(path)  # of killed writes of this checkpoint (its only writer is here)
    with atomic_dir(path, merge=order) as tmp:
        flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(flat, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    return Path(path)


def read_checkpoint(path: str | Path, method: str) -> tuple[dict, dict[str, Tensor], Path]:
    """``(config dict, {name: tensor} on CPU, resolved directory)`` of a drafter checkpoint
    loaded as ``method``; a checkpoint whose config.json declares another method is refused."""
    model_dir = resolve_model_dir(path)
    cfg_path = model_dir / CONFIG_NAME
    if not cfg_path.is_file():
        raise MissingFileError(f"no {CONFIG_NAME} in drafter directory {model_dir}")
    config = read_json(cfg_path, what=f"a {method} drafter's config")
    declared = checkpoint_method(config)
    if declared is not None and declared != method:
        raise FileFormatError(f"{model_dir} is a {declared!r} drafter checkpoint, not "
                              f"{method!r}: serve it with method={declared!r}")
    state: dict[str, Tensor] = {}
    for file in weight_files(model_dir):
        state.update(read_safetensors(file))
    return config, state, model_dir


def share(owner: torch.nn.Module, name: str, module: torch.nn.Module | None) -> None:
    """Keep a reference to a module owned by someone else (the target's embedding / LM head)
    without registering it, so it is never saved, moved or trained as part of ``owner``."""
    object.__setattr__(owner, name, module)


def share_target_heads(owner: torch.nn.Module, target: torch.nn.Module, cfg: ModelConfig,
                       what: str) -> None:
    """``owner`` shares ``target``'s embedding and LM head (:func:`share`) after checking that
    ``target`` has the hidden size and vocabulary ``cfg`` was built for; ``what`` names the
    drafter in the error (a drafter made for another model fails here, not in a matmul)."""
    hidden, vocab = target.embed_tokens.weight.shape[1], target.lm_head.weight.shape[0]
    if (hidden, vocab) != (cfg.hidden_size, cfg.vocab_size):
        raise FileFormatError(f"{what} expects a target with hidden_size {cfg.hidden_size} and "
                              f"vocab_size {cfg.vocab_size}; the target has {hidden} and {vocab}: "
                              "it was made for another model")
    share(owner, "embed_tokens", target.embed_tokens)
    share(owner, "lm_head", target.lm_head)


class StepKV:
    """Append-only keys/values across training-time-test steps (duck-types ``CacheStep``).

    Step ``s`` of an EAGLE-3 TTT unroll attends to the keys of steps ``0 .. s``; pass the same
    ``StepKV`` to each step's ``forward_train`` together with a mask over ``[T, (s + 1) * T]``.
    """

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's ``[B, kv_heads, T, hd]``; return all keys/values so far."""
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    @property
    def length(self) -> int:
        """Keys held per layer (0 before the first step)."""
        return next(iter(self.k.values())).shape[2] if self.k else 0


class TTTKeys(StepKV):
    """:class:`StepKV` for the training-time-test unroll, which knows its key structure and so
    computes the attention itself (:meth:`attend`), without the dense mask over ``[T, (s + 1) *
    T]`` keys: exactly the same attention, in a fraction of the work.

    At step ``s`` query ``t`` sees the step-0 keys ``<= t`` of its document (``base``) and, of
    steps ``1 .. s``, only index ``t`` (train/objectives/ttt.py). The dense form spends a ``T x
    T`` block per extra step on one useful diagonal, and its causal block is half masked. Here the
    queries go in :attr:`chunks` chunks: chunk ``[a, b)`` attends the step-0 keys ``[0, b)`` and
    the later steps' keys ``[a, b)`` only, ``(n + 1) / 2n + s / n`` of the dense form's ``(s + 1)``
    blocks of scores (3.7x fewer at the third step with 8 chunks; attention was ~45 % of a CPU
    EAGLE-3 training step, docs/benchmarks-history.md). Each chunk's keys are a copy kept for the
    backward, ``(n + 1) / 2 + s`` times one step's keys in all (the dense form keeps ``s + 1``),
    which is why the count of chunks, not their size, is fixed: at long sequences a fixed size
    would copy the keys ``T / size`` times. Masked-out keys weigh exactly 0 in a softmax, so the
    outputs equal the dense form's up to the order of float sums.
    """

    #: query chunks per attention call: more skip more masked scores but copy the keys more often
    #: and make more calls; 8 (64 queries at T = 512) was the fastest on 2 CPU cores
    chunks = 8

    def __init__(self, base: Tensor) -> None:
        """``base`` bool ``[B, T, T]``: the step-0 mask (causal within each packed document)."""
        super().__init__()
        self.base = base
        self._masks: dict[tuple[int, int], Tensor] = {}  # (chunk start, steps) -> mask

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Append this step's ``k, v [B, kv_heads, T, hd]``; ``q [B, heads, T, hd]`` -> the
        attention output ``[B, heads, T, hd]`` over the keys this step may see."""
        keys, values = self.update(layer, k, v)  # [B, kv_heads, (s + 1) * T, hd]
        t = q.shape[2]
        steps = keys.shape[2] // t - 1  # earlier TTT steps: s
        size = -(-t // self.chunks)  # ceil: the last chunk may be shorter
        outs = []
        for a in range(0, t, size):
            b = min(a + size, t)
            cols = [slice(0, b)] + [slice(j * t + a, j * t + b) for j in range(1, steps + 1)]
            ks, vs = (x[:, :, :b] if not steps else torch.cat([x[:, :, c] for c in cols], dim=2)
                      for x in (keys, values))  # [B, kv_heads, b + s * (b - a), hd]
            outs.append(attend(q[:, :, a:b], ks, vs, self._mask(a, b, steps)))
        return torch.cat(outs, dim=2)  # [B, heads, T, hd]

    def _mask(self, a: int, b: int, steps: int) -> Tensor:
        """Bool ``[B, 1, b - a, b + steps * (b - a)]`` of query chunk ``[a, b)`` (kept for the
        other layers of a deeper head)."""
        key = (a, steps)
        if key not in self._masks:
            eye = torch.eye(b - a, dtype=torch.bool, device=self.base.device)
            eye = eye.expand(self.base.shape[0], -1, -1)  # [B, b - a, b - a]
            self._masks[key] = torch.cat([self.base[:, a:b, :b]] + [eye] * steps,
                                         dim=-1)[:, None]
        return self._masks[key]


def hf_layer_config(cfg: ModelConfig, *, num_layers: int = 1,
                    intermediate_size: int | None = None) -> dict:
    """A Hugging Face ``config.json`` dict for a draft layer shaped like ``cfg`` (the target).

    Written in the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``) that vLLM,
    SGLang and this project's loader all read. Sliding windows are dropped: a one-layer drafter
    attends to its whole (short) context.
    """
    r = cfg.rope
    scaling = None
    if r.type != "default":
        scaling = {"rope_type": r.type, "factor": r.factor}
        if r.type == "llama3":
            scaling.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
        if r.type == "yarn":
            scaling.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(r, key) is not None:
                    scaling[key] = getattr(r, key)
        if r.original_max_position_embeddings is not None:
            scaling["original_max_position_embeddings"] = r.original_max_position_embeddings
    return {
        "architectures": [cfg.architecture], "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": intermediate_size or cfg.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias, "tie_word_embeddings": False,
        "rope_theta": r.theta, "rope_scaling": scaling,
    }


# ---- draft vocabulary (speculators' d2t: target id = draft id + d2t[draft id]) ------------------

def d2t_from_ids(target_ids: Tensor, vocab_size: int, device: torch.device) -> Tensor:
    """``d2t [Vd]`` (int64) of a draft vocabulary given as ``target_ids [Vd]`` (distinct ids in
    ``[0, vocab_size)``); a clear error otherwise."""
    ids = torch.as_tensor(target_ids, dtype=torch.long, device=device)
    vd = ids.numel()
    if ids.dim() != 1 or ids.unique().numel() != vd or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"draft vocabulary: expected distinct target ids in [0, {vocab_size}), "
                         f"got shape {tuple(ids.shape)}")
    return ids - torch.arange(vd, device=device)


def draft_to_target_ids(draft_ids: Tensor, d2t: Tensor | None) -> Tensor:
    """Draft-vocabulary ids -> target ids, any shape (``d2t`` None: the same vocabulary)."""
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def draft_to_target_probs(q: Tensor, d2t: Tensor | None, vocab_size: int) -> Tensor:
    """``q [..., Vd]`` -> ``[..., vocab_size]``: scattered to the target ids, 0 elsewhere (the
    rejection sampler's q over the full vocabulary)."""
    if d2t is None:
        return q
    out = q.new_zeros(*q.shape[:-1], vocab_size)
    return out.index_copy_(-1, torch.arange(q.shape[-1], device=q.device) + d2t, q)


TOKEN_MAP_FILE = "speculative_token_map.json"  # beside an exported head (drafter.token_map_size)


def token_map_entry(model_dir: str | Path) -> dict:
    """``{"speculative_token_map": file}`` where a head directory holds the token map that
    draftsmith's export writes (``TOKEN_MAP_FILE``), else {}: what serving that head adds to its
    ``speculative_config``."""
    file = Path(model_dir) / TOKEN_MAP_FILE
    return {"speculative_token_map": str(file)} if file.is_file() else {}


def restrict_vocab(drafter: nn.Module, target_ids: Tensor) -> int:
    """Keep only the draft tokens of ``drafter`` (an EAGLE-3 head: ``lm_head``, ``d2t``,
    ``t2d``) among ``target_ids``, an inference-time vocabulary (``speculative_token_map``: the
    frequent tokens, as FR-Spec / SGLang do). The LM head's rows, ``d2t`` and ``t2d`` shrink to
    them, so every forward computes logits over those tokens only and a greedy draft is the
    head's argmax among them: for serving greedy drafts, where the argmax almost never lies in
    the rare rows the LM head would pay for. Returns the new draft vocabulary size; the head is
    not for saving afterwards."""
    d2t = drafter.d2t
    all_ids = draft_to_target_ids(torch.arange(d2t.numel(), device=d2t.device), d2t)  # [Vd]
    keep = torch.isin(all_ids, target_ids.to(all_ids.device)).nonzero().flatten()  # [N]
    if keep.numel() == 0:
        raise ValueError("speculative_token_map: none of its tokens is in the head's draft "
                         "vocabulary")
    weight = drafter.lm_head.weight.detach()[keep].clone()  # [N, H]
    drafter.lm_head = nn.Linear(weight.shape[1], keep.numel(), bias=False,
                                device=weight.device, dtype=weight.dtype)
    drafter.lm_head.weight = nn.Parameter(weight, requires_grad=False)
    kept = all_ids[keep]  # [N] ascending target ids
    drafter.d2t = d2t_from_ids(kept, drafter.t2d.numel(), kept.device)
    drafter.t2d.zero_()
    drafter.t2d[kept] = True
    return keep.numel()


def write_token_map(path: str | Path, token_ids: list[int]) -> Path:
    """``path/speculative_token_map.json`` (atomic): ``{"token_ids": [...]}``, what
    :func:`read_token_map` reads. JSON, not safetensors: vLLM loads every top-level
    ``*.safetensors`` of a checkpoint as weights."""
    file = Path(path) / TOKEN_MAP_FILE
    with atomic_file(file) as tmp:
        tmp.write_text(json.dumps({"token_ids": token_ids}) + "\n")
    return file


def read_token_map(path: str | Path, vocab_size: int) -> Tensor:
    """The target token ids ``[N]`` (int64, ascending, distinct) of a token map file, a JSON
    object ``{"token_ids": [...]}`` with ids in ``[0, vocab_size)`` (``speculative_token_map``;
    SGLang's frequency-ranked hot-token lists hold the same ids, in a pickle this never opens).
    A clear error names the file and what it should hold."""
    raw = read_json(path, required=("token_ids",), what="speculative_token_map")["token_ids"]
    if (not isinstance(raw, list) or not raw
            or any(isinstance(t, bool) or not isinstance(t, int) for t in raw)):
        raise FileFormatError(f"speculative_token_map {str(path)!r}: expected \"token_ids\" to be "
                              "a non-empty list of target token ids (integers)")
    ids = torch.tensor(sorted(set(raw)), dtype=torch.long)  # [N]
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise FileFormatError(f"speculative_token_map {str(path)!r}: token ids must lie in "
                              f"[0, {vocab_size}) (the target vocabulary); found "
                              f"{int(ids[0])} .. {int(ids[-1])}")
    return ids


def gather_rows(x: Tensor, index: Tensor | None) -> Tensor:
    """``x [B, T, D]`` at ``index [B, K]`` -> ``[B, K, D]`` (``index`` None: ``x`` unchanged)."""
    if index is None:
        return x
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def as_bool_mask(mask: Tensor | None) -> Tensor | None:
    """A user mask ``[B, T, S]`` / ``[B, 1, T, S]`` (True = may attend) as ``[B, 1, T, S]``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(f"attention_mask must be bool (True = attend), got {mask.dtype}")
    return mask[:, None] if mask.dim() == 3 else mask


class PairDrafter(torch.nn.Module):
    """Base of the EAGLE heads: one decoder layer over pairs ``(hidden [B, T, H], input_ids
    [B, T])``. Subclasses implement ``_states(input_ids, hidden, positions, mask, step) -> h
    [B, T, H]`` (the layers), ``_logits(h, step) -> [..., V]`` and ``_feedback(h, step)`` (the
    state the next step takes; ``step`` as ``_states`` got it); this class gives all heads the
    same cached (inference) and full-sequence (training) entry points. The split lets training
    apply the LM head only where a loss is taken (``forward_train(select=)``): with the whole
    vocabulary, the ``[B, T, V]`` logits and their softmax were most of an EAGLE-3 training
    step."""

    def init_shared_heads(self) -> None:
        """Slots for the target's embedding and LM head (shared by ``attach_target``, never
        registered) and the RoPE buffer ``init_buffers`` fills (not saved)."""
        share(self, "embed_tokens", None)
        share(self, "lm_head", None)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.rope_scale = 1.0

    def forward(self, input_ids: Tensor, hidden: Tensor, cache, slots: Tensor | None = None, *,
                num_tokens: Tensor | None = None, kv_len: int | None = None,
                logits_at: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Cached step: the pairs are appended to cache rows ``slots`` with the ragged/rollback
        contract of :meth:`infer.models.llama.Llama.forward`; outputs at ``logits_at [B, K]``
        (default: every position)."""
        b, t = input_ids.shape
        step = cache.plan(b, t, slots, num_tokens, kv_len)
        h = self._states(input_ids, hidden, step.positions, cache_mask(step), step)  # [B, T, H]
        cache.advance(step)
        h = gather_rows(h, logits_at)  # [B, K, H]
        return self._logits(h, step), self._feedback(h, step)

    def forward_groups(self, groups: list[ForwardGroup], cache) -> list[tuple[Tensor, Tensor]]:
        """Several cached steps as one forward (:class:`~infer.models.groups.GroupedStep`, each
        group's ``hidden`` its pairs' features): e.g. new prompts' backlogs and the batch's
        catch-up. Each group gets what :meth:`forward` with its arguments would return; one group
        is that plain forward."""
        if len(groups) == 1:
            g = groups[0]
            return [self(g.input_ids, g.hidden, cache, g.slots, num_tokens=g.num_tokens,
                         logits_at=g.logits_at)]
        layers = self.layer_config.num_layers  # KV cache layers (the masks: no sliding windows)
        step = plan_groups(cache, groups, lambda make: [make(None)] * layers)
        ids, positions = flat_tokens(groups, step)  # [1, N] each
        hidden = torch.cat([g.hidden.flatten(0, 1) for g in groups])[None]  # [1, N, H]
        h = self._states(ids, hidden, positions, None, step)  # [1, N, H]
        h = gather_rows(h, flat_logits_at(groups))[0]  # [K_total, H]
        return [(self._logits(x, step), self._feedback(x, step)) for x in split_picked(h, groups)]

    def forward_train(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor | None = None,
                      attention_mask: Tensor | None = None, kv: StepKV | None = None,
                      select: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Full-sequence step for training (one TTT step): ``(logits, hidden [B, T, H])``.

        ``attention_mask`` bool ``[B, T, S]`` / ``[B, 1, T, S]`` (True = attend) over the keys of
        ``kv`` (earlier steps) followed by this step's; None = causal (only without earlier keys),
        and unused with :class:`TTTKeys`, which know what each step sees.
        ``position_ids [B, T]`` default ``0 .. T-1``. ``select`` bool ``[B, T]``: logits only at
        those positions, ``[N, V]`` in row-major order (None: everywhere, ``[B, T, V]``).
        """
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = as_bool_mask(attention_mask)
        if mask is None and kv is not None and kv.length and not isinstance(kv, TTTKeys):
            raise ValueError("forward_train: an attention_mask is required once kv holds "
                             "earlier steps' keys")
        h = self._states(input_ids, hidden, position_ids, mask, kv)  # [B, T, H]
        return self._logits(h if select is None else h[select], kv), self._feedback(h, kv)
