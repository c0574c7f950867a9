"""DFlash block-diffusion drafter (arXiv 2602.06036, docs/reference.md §12; vLLM ``dflash``).

Architecture::

    ctx_t  = hidden_norm(fc(cat(aux states of the target at t)))    # [.., n_t * H_t] -> [.., H]
    block  = [x_p, MASK, .., MASK] at positions p .. p + K           # 1 + K rows (K <= B - 1)
    h      = embed(block)
    per layer i (a Qwen3 decoder layer: q_norm / k_norm, SwiGLU):
        keys/values = [k_norm(k_proj_i(ctx_{<p})) roped at 0 .. p-1 ; v_proj_i(ctx_{<p})]
                      followed by the block's own k/v               # "KV injection"
        queries     = the block rows only; attention is NOT causal: every block row sees all
                      context and the whole block
        h = h + attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))[1 .. K]        # row j predicts the token at position p + j

No ``input_layernorm`` on the context (vLLM's ``precompute_and_store_context_kv`` normalises it
with ``hidden_norm`` only). The embedding and LM head are the target's (shared, never saved)
unless the checkpoint has its own ``embed_tokens.weight`` / ``lm_head.weight``. A draft
vocabulary (``draft_vocab_size`` < the target's) needs its own ``lm_head`` over the draft rows
plus ``d2t`` (target id = i + d2t[i]): vLLM shares the target's head only when the checkpoint has
none, and reads ``d2t`` only when the sizes differ, so ``d2t`` is saved only then.

Aux layer ids: this project's id ``k`` is the target's residual stream after ``k`` layers (the
EAGLE-3 convention, ``infer/models/output.py``). z-lab's ``target_layer_ids`` are 0-based layer
*outputs*, i.e. z-lab id ``j`` = our id ``j + 1``; vLLM converts the same way in both directions
(``speculators/algos.py::update_dflash`` writes ``target_layer_ids = aux - 1``;
``eagle3_utils.get_eagle3_aux_layers_from_config`` captures ``target_layer_ids + 1``).

Export layout: the speculators one (``speculators_model_type: "dflash"``), because
(1) our schema and vLLM both infer ``method: dflash`` and K from it, so ``{"model": dir}`` alone
serves in both engines; (2) vLLM 0.32 maps it to the same ``DFlashDraftModel`` config as z-lab's
and we write ``sliding_window_non_causal: true`` so ``dflash_config.causal`` is explicitly False
(docs/reference.md §12 pitfall: a serialised ``false`` runs every layer causally). Both layouts
load here.

Matched against vLLM 0.32: ``model_executor/models/qwen3_dflash.py`` (tensor names, hidden_norm
before the context k/v, k_norm + RoPE on context keys, lm_head / d2t handling, no mask_hidden),
``transformers_utils/configs/speculators/algos.py::update_dflash`` (config keys),
``v1/spec_decode/dflash.py`` + ``utils.copy_and_expand_dflash_inputs_kernel`` (query positions
``last verified position + 1 + offset``, slot 0 = the sampled token, slots 1..K = mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.drafters.common import (d2t_from_ids, draft_to_target_ids, draft_to_target_probs,
                                   hf_layer_config, read_checkpoint, share, write_checkpoint)
from infer.foundation.files import check_tensors
from infer.models.functional import Embed, ModelParts
from infer.models.llama import DecoderLayer, ModelConfig, RMSNorm
from infer.models.loader import config_from_hf, resolve_dtype
from infer.models.rope import apply_rope, rope_cos_sin, rope_frequencies, step_rope
from infer.models.snapshot import snapshot_of, uses_snapshot
from infer.foundation.validation import config_error

ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_VERSION = "0.3.0"
_WHERE = "dflash config.json"


def default_aux_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's ``round(1 + i * (L - 4) / (n - 1))`` (0-based layer outputs) + 1 = our ids.

    ``n == 1``: z-lab's ``[L // 2]`` (the middle layer's output). Ids are clamped into
    ``[1, L]`` and duplicates dropped (tiny targets), so fewer than ``n`` may come back.
    Qwen3-8B (36 layers, 5 draft layers): z-lab [1, 9, 17, 25, 33] -> [2, 10, 18, 26, 34].
    """
    n, layers = num_draft_layers, num_target_layers
    if n < 1 or layers < 1:
        raise config_error("num_target_layers", layers, "a target with >= 1 layer and >= 1 draft "
                           "layer", "dflash default_aux_layer_ids")
    if n == 1:
        zlab = [layers // 2]
    else:
        zlab = [int(round(1 + i * (layers - 4) / (n - 1))) for i in range(n)]
    return sorted({min(max(j + 1, 1), layers) for j in zlab})


@dataclass
class DFlashConfig:
    """A DFlash drafter's config: the speculators ``config.json`` (z-lab's read too)."""

    MODEL_TYPE = "dflash"  # speculators_model_type (DSpark's config extends this one)

    transformer_layer_config: dict  # HF Qwen3 config of the draft layers; vocab = target vocab
    aux_layer_ids: list[int]  # our ids (= speculators' aux_hidden_state_layer_ids), sorted
    mask_token_id: int
    block_size: int = 16
    draft_vocab_size: int | None = None  # None: the target vocabulary (shared LM head)
    target_hidden_size: int | None = None  # None: the draft layers' hidden_size
    verifier_architectures: list[str] = field(default_factory=lambda: ["Qwen3ForCausalLM"])
    verifier_name_or_path: str | None = None
    extra: dict = field(default_factory=dict)  # other top-level keys, written back unchanged

    def __post_init__(self) -> None:
        if not isinstance(self.transformer_layer_config, dict):
            raise config_error("transformer_layer_config", self.transformer_layer_config,
                               "a Hugging Face Qwen3 config dict", _WHERE)
        ids = self.aux_layer_ids
        if not isinstance(ids, list) or not ids or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ids):
            raise config_error("aux_hidden_state_layer_ids", ids, "a non-empty list of target "
                               "layer ids >= 0", _WHERE)
        self.aux_layer_ids = sorted(ids)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 2:
            raise config_error("block_size", self.block_size, "an integer >= 2", _WHERE)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise config_error("mask_token_id", self.mask_token_id,
                               f"a token id in [0, {self.vocab_size})", _WHERE)

    @property
    def layer(self) -> ModelConfig:
        """The draft layers as a :class:`ModelConfig` (Qwen3: qk-norm on)."""
        hf = {**self.transformer_layer_config, "architectures": ["Qwen3ForCausalLM"],
              "model_type": "qwen3"}
        return config_from_hf(hf)

    @property
    def vocab_size(self) -> int:
        return self.transformer_layer_config["vocab_size"]

    @property
    def num_layers(self) -> int:
        return self.transformer_layer_config["num_hidden_layers"]

    @property
    def target_hidden(self) -> int:
        return self.target_hidden_size or self.transformer_layer_config["hidden_size"]

    def to_dict(self) -> dict:
        """The speculators ``config.json`` (see the module doc for why this layout)."""
        return {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "speculators_model_type": "dflash",
            "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden,
            "sample_from_anchor": False,  # slot 0 is the verified token; masks give the drafts
            "sliding_window_non_causal": True,  # -> dflash_config.causal = False in vLLM
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "transformer_layer_config": dict(self.transformer_layer_config),
            "speculators_config": {
                "algorithm": "dflash",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": self.block_size - 1,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"architectures": list(self.verifier_architectures),
                             "name_or_path": self.verifier_name_or_path},
            },
            "speculators_version": SPECULATORS_VERSION,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        """Parse the speculators layout, or z-lab's (``DFlashDraftModel`` + ``dflash_config``)."""
        if d.get("speculators_model_type") is None:
            return cls.from_zlab_dict(d)
        if d.get("speculators_model_type") != cls.MODEL_TYPE:
            raise config_error("speculators_model_type", d.get("speculators_model_type"),
                               f"'{cls.MODEL_TYPE}'", f"{cls.MODEL_TYPE} config.json")
        for key in ("aux_hidden_state_layer_ids", "mask_token_id", "transformer_layer_config"):
            if d.get(key) is None:
                raise config_error(key, None, "present (vLLM requires it too)", _WHERE)
        if d.get("sliding_window_non_causal", True) is False:
            raise config_error("sliding_window_non_causal", False, "true (or absent): a causal "
                               "DFlash block is not what this engine serves", _WHERE)
        methods = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
        verifier = (d.get("speculators_config") or {}).get("verifier") or {}
        known = {"architectures", "speculators_model_type", "aux_hidden_state_layer_ids",
                 "mask_token_id", "block_size", "draft_vocab_size", "target_hidden_size",
                 "sample_from_anchor", "sliding_window_non_causal", "hidden_act",
                 "tie_word_embeddings", "transformer_layer_config", "speculators_config",
                 "speculators_version", "torch_dtype"}
        block = d.get("block_size") or (methods[0].get("speculative_tokens", 15) + 1)
        return cls(transformer_layer_config=d["transformer_layer_config"],
                   aux_layer_ids=list(d["aux_hidden_state_layer_ids"]),
                   mask_token_id=d["mask_token_id"], block_size=block,
                   draft_vocab_size=d.get("draft_vocab_size"),
                   target_hidden_size=d.get("target_hidden_size"),
                   verifier_architectures=list(verifier.get("architectures") or []),
                   verifier_name_or_path=verifier.get("name_or_path"),
                   extra={k: v for k, v in d.items() if k not in known})

    @classmethod
    def from_zlab_dict(cls, d: dict) -> "DFlashConfig":
        """z-lab's layout: a Qwen3 config + ``block_size`` + ``dflash_config: {mask_token_id,
        target_layer_ids}`` (0-based layer outputs: our id = z-lab id + 1)."""
        where = "dflash (z-lab DFlashDraftModel) config.json"
        dflash = d.get("dflash_config") or {}
        ids, mask = dflash.get("target_layer_ids"), dflash.get("mask_token_id")
        if not isinstance(ids, list) or not ids:
            raise config_error("dflash_config.target_layer_ids", ids, "a list of 0-based target "
                               "layer indices", where)
        if not isinstance(mask, int):
            raise config_error("dflash_config.mask_token_id", mask, "a token id", where)
        if dflash.get("causal") or d.get("is_causal"):
            raise config_error("dflash_config.causal", True, "false: this engine serves "
                               "non-causal DFlash blocks", where)
        layer = {k: v for k, v in d.items()
                 if k not in ("dflash_config", "block_size", "auto_map", "num_target_layers")}
        return cls(transformer_layer_config=layer, aux_layer_ids=[j + 1 for j in ids],
                   mask_token_id=mask, block_size=d.get("block_size", 16),
                   draft_vocab_size=d.get("draft_vocab_size"),
                   target_hidden_size=d.get("target_hidden_size"), verifier_architectures=[])

    @classmethod
    def for_target(cls, target: ModelConfig, *, num_layers: int, mask_token_id: int,
                   block_size: int = 16, aux_layer_ids: list[int] | None = None,
                   draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                   verifier_name_or_path: str | None = None) -> "DFlashConfig":
        """Draft layers shaped like ``target`` (heads, widths, RoPE), as Qwen3 layers."""
        layer = hf_layer_config(target, num_layers=num_layers,
                                intermediate_size=intermediate_size)
        layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                     attention_bias=False, mlp_bias=False)
        return cls(transformer_layer_config=layer,
                   aux_layer_ids=aux_layer_ids or default_aux_layer_ids(target.num_layers,
                                                                        num_layers),
                   mask_token_id=mask_token_id, block_size=block_size,
                   draft_vocab_size=draft_vocab_size or target.vocab_size,
                   target_hidden_size=target.hidden_size,
                   verifier_architectures=[target.architecture],
                   verifier_name_or_path=verifier_name_or_path)


class ContextKV:
    """Keys/values a block attends to before its own (duck-types ``CacheStep.update``).

    Holds the context ``k, v [B, kv_heads, C, hd]`` of every layer; ``update`` appends the
    block's ``[B, kv_heads, S, hd]`` after them, so keys are ``[context C ; block S]``.
    """

    def __init__(self, kv: list[tuple[Tensor, Tensor]]) -> None:
        self.kv = kv

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        ck, cv = self.kv[layer]
        return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)


class DFlashDrafter(nn.Module):
    """The DFlash draft model (module doc); forwards over explicit positions and masks."""

    CONFIG = DFlashConfig  # what from_pretrained parses (DSpark's drafter extends this one)

    def __init__(self, config: DFlashConfig, *, with_embedding: bool = False,
                 with_lm_head: bool | None = None):
        super().__init__()
        self.config = config
        lc = self.layer_config = config.layer
        h = lc.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden, h, bias=False)
        self.hidden_norm = RMSNorm(h, lc.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(lc, i) for i in range(lc.num_layers))
        self.norm = RMSNorm(h, lc.rms_norm_eps)
        reduced = config.draft_vocab_size != lc.vocab_size
        if with_lm_head is None:
            with_lm_head = reduced
        if reduced and not with_lm_head:
            raise config_error("draft_vocab_size", config.draft_vocab_size, "the target's "
                               f"vocab_size ({lc.vocab_size}) when the drafter has no lm_head "
                               "of its own", _WHERE)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False) if with_lm_head else None
        self.embed_tokens = nn.Embedding(lc.vocab_size, h) if with_embedding else None
        share(self, "shared_embed", None)
        share(self, "shared_lm_head", None)
        if reduced:  # vLLM reads d2t only for a reduced vocabulary
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.rope_scale = 1.0
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute RoPE frequencies on the weights' device (after a meta-device build)."""
        self.inv_freq, self.rope_scale = rope_frequencies(self.layer_config, self.fc.weight.device)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layer_ids)

    # ---- shared target pieces and vocabulary -------------------------------------------------

    def share_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Use the target's embedding / LM head (frozen, not saved) where the drafter has none."""
        share(self, "shared_embed", embed_tokens)
        share(self, "shared_lm_head", lm_head)

    def embed(self, ids: Tensor) -> Tensor:
        return self._embedding()(ids)

    def _embedding(self) -> nn.Embedding:
        emb = self.embed_tokens if self.embed_tokens is not None else self.shared_embed
        if emb is None:
            raise RuntimeError("DFlashDrafter has no embedding: call share_target(...)")
        return emb

    def logits(self, h: Tensor) -> Tensor:
        """``h [.., H]`` (after ``norm``) -> logits over the draft vocabulary ``[.., Vd]``."""
        head = self.lm_head if self.lm_head is not None else self.shared_lm_head
        if head is None:
            raise RuntimeError("DFlashDrafter has no lm_head: call share_target(...)")
        return head(h)

    def set_vocab(self, target_ids: Tensor) -> None:
        """Draft vocabulary = ``target_ids [draft_vocab_size]`` (distinct, ascending ids)."""
        if self.d2t is not None:
            self.d2t.copy_(d2t_from_ids(target_ids, self.layer_config.vocab_size,
                                        self.d2t.device))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_to_target_ids(draft_ids, self.d2t)

    def to_target_probs(self, q: Tensor) -> Tensor:
        """``q [..., Vd]`` -> ``[..., vocab]`` scattered to target ids (0 outside)."""
        return draft_to_target_probs(q, self.d2t, self.layer_config.vocab_size)

    # ---- forwards ----------------------------------------------------------------------------

    def context(self, aux: Tensor) -> Tensor:
        """Aux states in sorted id order ``[.., n_t * H_t]`` -> context features ``[.., H]``."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer the context keys (k_norm, RoPE at ``positions [B, C]``) and values, each
        ``[B, kv_heads, C, hd]``, from ``ctx [B, C, H]`` (no input_layernorm, as vLLM)."""
        b, c, _ = ctx.shape
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.rope_scale, ctx.dtype)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.k_proj(ctx).view(b, c, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(ctx).view(b, c, attn.num_kv_heads, attn.head_dim)
            k = apply_rope(attn.k_norm(k).transpose(1, 2), cos, sin)  # [B, kv_heads, C, hd]
            out.append((k, v.transpose(1, 2)))
        return out

    def block_forward(self, ids: Tensor, positions: Tensor, mask: Tensor, kv) -> Tensor:
        """Block rows ``ids, positions [B, S]`` -> ``norm(h) [B, S, H]``.

        ``mask`` bool ``[B, 1, S, C + S]`` (True = attend) over the keys ``kv.update`` returns:
        the context's, then the block's own. ``kv``: :class:`ContextKV` or a ``CacheStep``.
        """
        parts = self.parts(kv)
        h = parts.embed(ids).to(self.fc.weight.dtype)  # [B, S, H]
        cos, sin = step_rope(self, positions, h.dtype, kv)
        for layer in parts.layers:
            h = layer(h, cos, sin, mask, kv)
        return parts.norm(h)

    def parts(self, step) -> ModelParts:
        """The modules, or for a cached block forward without gradients their bundles, built
        once (:func:`~infer.models.snapshot.snapshot_of`; a shared embedding watched too). The
        LM head runs apart (:meth:`logits`)."""
        if not uses_snapshot(step):
            return ModelParts(self.embed, self.layers, self.norm, self.logits)
        emb = self._embedding()
        return snapshot_of(self, lambda: ModelParts(
            Embed(emb.weight), tuple(layer.weights() for layer in self.layers),
            self.norm.weights(), self.logits), step, shared=[emb])

    # ---- checkpoint --------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """The speculators checkpoint (atomic); shared target pieces are not saved."""
        return write_checkpoint(path, self.config.to_dict(), self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = "auto",
                        device: str | torch.device = "cpu") -> "DFlashDrafter":
        """Load a speculators (or z-lab) checkpoint of this drafter, frozen, in eval mode."""
        raw, state, model_dir = read_checkpoint(path, cls.CONFIG.MODEL_TYPE)
        config = cls.CONFIG.from_dict(raw)
        state = {k.removeprefix("model."): v for k, v in state.items() if k != "t2d"}
        if any("mask_hidden" in k for k in state):
            raise config_error("mask_hidden", "present", "absent: a DFlash drafter embeds its "
                               "mask slots with mask_token_id (vLLM refuses it too)", _WHERE)
        with torch.device("meta"):
            model = cls(config, with_embedding="embed_tokens.weight" in state,
                        with_lm_head="lm_head.weight" in state)
        if model.d2t is not None and "d2t" not in state:  # vLLM: identity over the first ids
            state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        check_tensors(model_dir, model.state_dict(), state)
        torch_dtype = resolve_dtype(dtype, {**config.transformer_layer_config, **raw})
        model.load_state_dict({k: v.to(device=device, dtype=torch_dtype if v.is_floating_point()
                                       else v.dtype) for k, v in state.items()}, assign=True)
        model.init_buffers()
        return model.requires_grad_(False).eval()
