"""EAGLE-3 draft model in the speculators format that vLLM loads (docs/reference.md §4).

Architecture (one step, per position ``t``)::

    g_t   = fc(cat(aux states of the target at t))            # [.., n_aux * H_t] -> [.., H]
            (optionally RMS-normed first: ``input_norm`` over the concatenation when
             ``norm_before_fc``, one ``fc_norm.i`` per aux state when ``fc_norm``)
    x     = cat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))    # [.., 2H]
    h     = residual + attn(x);  residual = g_t (or hidden_norm(g_t) if norm_before_residual)
    h     = h + mlp(post_attention_layernorm(h))
    h     = DecoderLayer_i(h)  for i = 1 .. N - 1      # only with num_hidden_layers = N > 1
    logits over the draft vocabulary = lm_head(norm(h));  draft id i -> target id i + d2t[i]

Layers ``1 .. N - 1`` are plain pre-norm Llama layers over ``h`` alone (q/k/v take ``H``, no
embedding, no ``hidden_norm``), as vLLM's ``Eagle3LlamaForCausalLM`` builds them (>= 0.11.1,
``llama_eagle3.py``: its fused add+norm threads ``residual`` so that layer ``i`` sees
``input_layernorm(h_{i-1})`` and the final ``norm`` takes the running sum ``h``). vLLM creates a
``hidden_norm`` in every layer but only layer 0 uses it and a missing one is never checked
(``load_weights`` returns no loaded-name set), so checkpoints carry it for layer 0 only; a
``layers.{i>=1}.hidden_norm.weight`` found on load is dropped, as vLLM never reads it.

The next step feeds ``h`` back in place of ``g`` (``norm(h)`` when ``norm_output``): at
inference that chains the k drafts, in training it is the training-time-test unroll. Positions
follow vLLM: the pair ``(g_t, token_{t+1})`` sits at position ``t``; RoPE only sees differences,
so any consistent offset (speculators trains from 1) gives the same attention.

Aux layer ids: id ``k`` is the target's residual stream after ``k`` layers (0 = embeddings, N =
last layer before the final norm); the states are concatenated in *sorted* id order, whatever
order the config lists them in (vLLM collects them while walking the layers). vLLM captures ids
0 and N only from 0.18 and sizes a Llama drafter's ``fc`` for other than three states only from
0.22, through ``num_aux_hidden_states`` (written into ``transformer_layer_config`` when needed);
this engine accepts any ids in ``[0, N]``. ``default_aux_layer_ids`` picks ones every vLLM with
custom ids (0.11.1+) serves; ``train/export.py`` lists the version each choice needs.

Checkpoint: ``config.json`` with the speculators keys (:class:`Eagle3Config`) and
``model.safetensors`` with ``fc.weight``, ``layers.0.*`` (``q/k/v`` take ``2H``,
``layers.0.hidden_norm.weight``), ``layers.{1..N-1}.*`` (plain Llama layers), ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``, and ``embed_tokens.weight`` only when the drafter has its
own embedding (absent -> the target's is shared, as vLLM does). ``input_norm.weight`` /
``fc_norm.{i}.weight`` exist only with their flags. SGLang's layout (``midlayer.*`` names, its
Llama-style ``config.json``: ``from_sglang_dict``) is accepted on load; ``verifier_*`` tensors
are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from infer.drafters.common import (PairDrafter, StepKV, d2t_from_ids,
                                   draft_to_target_ids, draft_to_target_probs, hf_layer_config,
                                   read_checkpoint, share, write_checkpoint)
from infer.foundation.files import check_tensors
from infer.kv_cache import CacheStep
from infer.models.functional import AttentionWeights, Embed, MLPWeights, ModelParts, Norm
from infer.models.llama import MLP, Attention, DecoderLayer, ModelConfig, RMSNorm, proj_of
from infer.models.rope import rope_frequencies, step_rope
from infer.models.snapshot import snapshot_of, uses_snapshot
from infer.models.loader import config_from_hf, resolve_dtype
from infer.foundation.validation import check_int, config_error

ARCHITECTURE = "Eagle3DraftModel"
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang / SpecForge layout (read only)
SPECULATORS_VERSION = "0.3.0"
_WHERE = "eagle3 config.json"
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")


def _unused_hidden_norm(name: str) -> bool:
    """``layers.{i>=1}.hidden_norm.weight``: vLLM builds one in every layer but reads only layer
    0's, so another exporter may ship the rest; they are dropped on load (vLLM ignores them)."""
    parts = name.split(".")
    return (len(parts) == 4 and parts[0] == "layers" and parts[1] not in ("0", "")
            and parts[2] == "hidden_norm")


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """speculators' ``[2, n // 2, n - 3]``, made valid for small targets.

    Ids are kept in ``[1, n - 1]`` (the range every vLLM captures) and must be three distinct
    ones (older vLLM's ``fc`` takes exactly ``3 * H_target``): out-of-range ids are clamped,
    and collisions are replaced by the free id farthest from those already chosen (ties: the
    lower id). So n = 32 -> [2, 16, 29], n = 4 -> [1, 2, 3], n = 6 -> [2, 3, 5]. Needs n >= 4.
    """
    n = num_target_layers
    if isinstance(n, bool) or not isinstance(n, int) or n < 4:
        raise config_error("num_target_layers", n, "an integer >= 4: EAGLE-3 needs three distinct "
                           "aux layers in [1, n - 1]; for a smaller target pass "
                           "eagle_aux_hidden_state_layer_ids explicitly (this engine accepts "
                           "ids in [0, n], vLLM < 0.18 only [1, n - 1])",
                           "default_aux_layer_ids")
    chosen = sorted({min(max(k, 1), n - 1) for k in (2, n // 2, n - 3)})
    while len(chosen) < 3:
        free = [k for k in range(1, n) if k not in chosen]
        chosen = sorted(chosen + [max(free, key=lambda k: (min(abs(k - c) for c in chosen), -k))])
    return chosen


@dataclass
class Eagle3Config:
    """The speculators ``config.json`` of an EAGLE-3 drafter, read and written losslessly."""

    transformer_layer_config: dict  # HF config of the draft layer; vocab_size = target vocab
    draft_vocab_size: int
    eagle_aux_hidden_state_layer_ids: list[int] | None  # None: the target decides (default ids)
    target_hidden_size: int | None = None  # None: the draft layer's hidden_size
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states (``input_norm``)
    norm_before_residual: bool = True  # residual = hidden_norm(g); vLLM's default when absent
    norm_output: bool = False  # feed back norm(h) instead of h
    fc_norm: bool = False  # one RMSNorm per aux state before fc (``fc_norm.{i}``)
    embed_requires_grad: bool = False
    speculative_tokens: int = 3  # K of the greedy proposal method (vLLM's default k)
    verifier_architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    verifier_name_or_path: str | None = None
    speculators_version: str = SPECULATORS_VERSION
    extra: dict = field(default_factory=dict)  # other top-level keys, written back unchanged

    def __post_init__(self) -> None:
        if not isinstance(self.transformer_layer_config, dict):
            raise config_error("transformer_layer_config", self.transformer_layer_config,
                               "a JSON object (the draft layer's Llama/Qwen3 config)", _WHERE)
        check_int("transformer_layer_config.num_hidden_layers",
                  self.transformer_layer_config.get("num_hidden_layers", 1), _WHERE, minimum=1)
        vocab = self.transformer_layer_config.get("vocab_size")
        check_int("transformer_layer_config.vocab_size", vocab, _WHERE, minimum=1)
        check_int("draft_vocab_size", self.draft_vocab_size, _WHERE, minimum=1)
        if self.draft_vocab_size > vocab:
            raise config_error("draft_vocab_size", self.draft_vocab_size,
                               f"<= the target vocabulary ({vocab})", _WHERE)
        check_int("target_hidden_size", self.target_hidden_size, _WHERE, minimum=1, optional=True)
        check_int("speculative_tokens", self.speculative_tokens, _WHERE, minimum=1)
        ids = self.eagle_aux_hidden_state_layer_ids
        if ids is not None and (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
                                or any(isinstance(k, bool) or not isinstance(k, int) or k < 0
                                       for k in ids)):
            raise config_error("eagle_aux_hidden_state_layer_ids", ids,
                               "a non-empty list of distinct layer ids >= 0", _WHERE)

    # ---- derived -----------------------------------------------------------------------------

    @property
    def layer(self) -> ModelConfig:
        """The draft layer as this project's :class:`ModelConfig` (via the HF loader rules)."""
        return config_from_hf(self.transformer_layer_config)

    @property
    def vocab_size(self) -> int:
        return self.transformer_layer_config["vocab_size"]

    @property
    def num_layers(self) -> int:
        """Draft decoder layers: the EAGLE-3 layer + ``num_layers - 1`` plain Llama layers."""
        return self.transformer_layer_config.get("num_hidden_layers", 1)

    @property
    def target_hidden(self) -> int:
        return self.target_hidden_size or self.transformer_layer_config["hidden_size"]

    @property
    def num_aux(self) -> int:
        return len(self.eagle_aux_hidden_state_layer_ids or (0, 0, 0))

    # ---- config.json -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The speculators ``config.json`` (every key vLLM and speculators read)."""
        return {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden,
            "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
            "norm_before_fc": self.norm_before_fc,
            "norm_before_residual": self.norm_before_residual,
            "norm_output": self.norm_output,
            "fc_norm": self.fc_norm,
            "embed_requires_grad": self.embed_requires_grad,
            "tie_word_embeddings": False,
            "transformer_layer_config": self._layer_dict(),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": self.speculative_tokens,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"architectures": list(self.verifier_architectures),
                             "name_or_path": self.verifier_name_or_path},
            },
            "speculators_version": self.speculators_version,
        }

    def _layer_dict(self) -> dict:
        """``transformer_layer_config``, with ``num_aux_hidden_states`` when there are not
        three aux states: vLLM's Llama EAGLE-3 drafter (<= 0.32 at least) sizes ``fc`` from
        that key, not from the id list, and assumes three without it."""
        layer = dict(self.transformer_layer_config)
        if self.num_aux != 3:
            layer["num_aux_hidden_states"] = self.num_aux
        return layer

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """Parse a speculators EAGLE-3 ``config.json``; missing optional keys get vLLM's defaults
        (``norm_before_residual`` True, ``draft_vocab_size`` = the target vocabulary). SGLang's
        ``LlamaForCausalLMEagle3`` layout is read too (:meth:`from_sglang_dict`)."""
        if "speculators_model_type" not in d and SGLANG_ARCHITECTURE in (d.get("architectures")
                                                                         or ()):
            return cls.from_sglang_dict(d)
        if d.get("speculators_model_type") != "eagle3":
            raise config_error("speculators_model_type", d.get("speculators_model_type"),
                               "'eagle3'", _WHERE)
        layer = d.get("transformer_layer_config")
        spec = d.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        verifier = spec.get("verifier") or {}
        known = {"architectures", "speculators_model_type", "draft_vocab_size",
                 "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                 "norm_before_residual", "norm_output", "fc_norm", "embed_requires_grad",
                 "tie_word_embeddings", "transformer_layer_config", "speculators_config",
                 "speculators_version"}
        vocab = layer.get("vocab_size") if isinstance(layer, dict) else None
        return cls(
            transformer_layer_config=layer,
            draft_vocab_size=d.get("draft_vocab_size") or vocab,
            eagle_aux_hidden_state_layer_ids=d.get("eagle_aux_hidden_state_layer_ids"),
            target_hidden_size=d.get("target_hidden_size"),
            norm_before_fc=bool(d.get("norm_before_fc") or False),
            norm_before_residual=bool(d.get("norm_before_residual", True)),
            norm_output=bool(d.get("norm_output") or False),
            fc_norm=bool(d.get("fc_norm") or False),
            embed_requires_grad=bool(d.get("embed_requires_grad") or False),
            speculative_tokens=methods[0].get("speculative_tokens", 3),
            verifier_architectures=list(verifier.get("architectures") or []),
            verifier_name_or_path=verifier.get("name_or_path"),
            speculators_version=str(d.get("speculators_version", SPECULATORS_VERSION)),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_sglang_dict(cls, d: dict) -> "Eagle3Config":
        """SGLang / SpecForge ``config.json``: a one-layer Llama config + ``draft_vocab_size``,
        ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``, where
        SGLang's id ``j`` is the output of layer ``j`` (this project's id ``j + 1``; absent: the
        target's default). SGLang's layer keeps the raw ``fc`` output as residual and feeds the
        pre-norm state back: ``norm_before_residual`` / ``norm_output`` are False."""
        where = "eagle3 (SGLang LlamaForCausalLMEagle3) config.json"
        if d.get("bias"):
            raise config_error("bias", d["bias"], "false (this engine's EAGLE-3 fc has no bias)",
                               where)
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or any(
                isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in ids)):
            raise config_error("eagle_config.eagle_aux_hidden_state_layer_ids", ids,
                               "a list of layer indices >= 0", where)
        layer = {k: v for k, v in d.items()
                 if k not in ("draft_vocab_size", "target_hidden_size", "eagle_config", "bias")}
        layer.update(architectures=["LlamaForCausalLM"], model_type="llama")
        return cls(transformer_layer_config=layer,
                   draft_vocab_size=d.get("draft_vocab_size") or d.get("vocab_size"),
                   eagle_aux_hidden_state_layer_ids=[j + 1 for j in ids] if ids else None,
                   target_hidden_size=d.get("target_hidden_size"),
                   norm_before_residual=False, verifier_architectures=[])

    @classmethod
    def for_target(cls, target: ModelConfig, *, draft_vocab_size: int | None = None,
                   aux_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                   verifier_name_or_path: str | None = None, num_layers: int = 1,
                   **flags) -> "Eagle3Config":
        """A drafter shaped like ``target`` (same heads, hidden size and RoPE) with
        ``num_layers`` decoder layers (speculators' P-EAGLE uses 4).

        The draft layer is a plain Llama layer whatever the target family (no attention bias, no
        qk-norm): vLLM builds every speculators EAGLE-3 head as ``Eagle3LlamaForCausalLM``, and
        speculators' own Qwen3 heads declare ``model_type: llama`` too.
        """
        layer = hf_layer_config(target, num_layers=num_layers,
                                intermediate_size=intermediate_size)
        layer.update(architectures=["LlamaForCausalLM"], model_type="llama",
                     attention_bias=False, mlp_bias=False)
        return cls(
            transformer_layer_config=layer,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            eagle_aux_hidden_state_layer_ids=(aux_layer_ids
                                              or default_aux_layer_ids(target.num_layers)),
            target_hidden_size=target.hidden_size,
            verifier_architectures=[target.architecture],
            verifier_name_or_path=verifier_name_or_path, **flags)


def eagle3_layer(layer, embeds: Tensor, g: Tensor, cos: Tensor, sin: Tensor,
                 mask: Tensor | None, step=None) -> Tensor:
    """Layer 0 (an :class:`Eagle3Layer` or its bundle): ``embeds, g [B, T, H]`` ->
    ``[B, T, H]``."""
    normed = layer.hidden_norm(g)
    residual = normed if layer.norm_before_residual else g
    x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
    h = residual + layer.self_attn(x, cos, sin, mask, step)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass(frozen=True, slots=True)
class Eagle3LayerWeights:
    """Layer 0's bundle (:mod:`infer.models.functional`), member names as the module's."""

    input_layernorm: Norm
    hidden_norm: Norm
    self_attn: AttentionWeights
    post_attention_layernorm: Norm
    mlp: MLPWeights
    norm_before_residual: bool

    def __call__(self, embeds: Tensor, g: Tensor, cos: Tensor, sin: Tensor,
                 mask: Tensor | None, step=None) -> Tensor:
        return eagle3_layer(self, embeds, g, cos, sin, mask, step)


class Eagle3Layer(nn.Module):
    """Decoder layer 0: q/k/v over ``cat(input_layernorm(embeds), hidden_norm(g))``."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 0)
        attn = self.self_attn  # widen q/k/v to the 2H input (same names, as speculators does)
        attn.q_proj = nn.Linear(2 * h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        attn.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        attn.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def weights(self) -> Eagle3LayerWeights:
        return Eagle3LayerWeights(self.input_layernorm.weights(), self.hidden_norm.weights(),
                                  self.self_attn.weights(),
                                  self.post_attention_layernorm.weights(), self.mlp.weights(),
                                  self.norm_before_residual)

    def forward(self, embeds: Tensor, g: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                step=None) -> Tensor:
        """``embeds, g [B, T, H]`` -> ``[B, T, H]``."""
        return eagle3_layer(self, embeds, g, cos, sin, mask, step)


class Eagle3Drafter(PairDrafter):
    """EAGLE-3 draft model: see the module doc for the math and the checkpoint format."""

    #: the config.json class ``from_pretrained`` parses (P-EAGLE's head extends both)
    config_class: ClassVar[type[Eagle3Config]] = Eagle3Config

    def __init__(self, config: Eagle3Config, *, with_embedding: bool | None = None):
        super().__init__()
        self.config = config
        lc = self.layer_config = config.layer
        h, ht, eps = lc.hidden_size, config.target_hidden, lc.rms_norm_eps
        n_in = config.num_aux * ht
        self.input_norm = RMSNorm(n_in, eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(ht, eps) for _ in range(config.num_aux))
                        if config.fc_norm else None)
        self.fc = nn.Linear(n_in, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(lc, config.norm_before_residual)] + [
            DecoderLayer(lc, i) for i in range(1, lc.num_layers)])  # KV cache layer i = layer i
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if with_embedding is None:
            with_embedding = config.embed_requires_grad
        self.embed_tokens = nn.Embedding(lc.vocab_size, h) if with_embedding else None
        share(self, "shared_embed", None)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(lc.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.rope_scale = 1.0
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute RoPE frequencies on the weights' device (after a meta-device build)."""
        self.inv_freq, self.rope_scale = rope_frequencies(self.layer_config, self.fc.weight.device)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target residual streams to capture, sorted (the concatenation order of ``fc``)."""
        return tuple(sorted(self.config.eagle_aux_hidden_state_layer_ids or ()))

    # ---- vocabulary and embedding ------------------------------------------------------------

    def share_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's embedding (frozen, not saved) when the drafter has none."""
        share(self, "shared_embed", embedding)

    def embed(self, ids: Tensor) -> Tensor:
        return self._embedding()(ids)

    def _embedding(self) -> nn.Embedding:
        emb = self.embed_tokens if self.embed_tokens is not None else self.shared_embed
        if emb is None:
            raise RuntimeError("Eagle3Drafter has no embedding: the checkpoint has no "
                               "embed_tokens.weight; call share_embedding(target.embed_tokens)")
        return emb

    def set_vocab(self, target_ids: Tensor) -> None:
        """Draft vocabulary = ``target_ids [draft_vocab_size]`` (distinct target token ids)."""
        if torch.as_tensor(target_ids).shape != (self.config.draft_vocab_size,):
            raise ValueError(f"set_vocab: expected {self.config.draft_vocab_size} target ids, got "
                             f"shape {tuple(torch.as_tensor(target_ids).shape)}")
        d2t = d2t_from_ids(target_ids, self.layer_config.vocab_size, self.d2t.device)
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[self.to_target_ids(torch.arange(d2t.numel(), device=d2t.device))] = True

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (``i + d2t[i]``), any shape."""
        return draft_to_target_ids(draft_ids, self.d2t)

    def to_target_probs(self, q: Tensor) -> Tensor:
        """``q [..., draft_vocab]`` -> ``[..., vocab]``: scattered to target ids, 0 elsewhere."""
        return draft_to_target_probs(q, self.d2t, self.layer_config.vocab_size)

    # ---- forwards ----------------------------------------------------------------------------

    def prepare(self, aux: Tensor) -> Tensor:
        """Aux states concatenated in sorted id order ``[.., n_aux * H_t]`` -> ``g [.., H]``."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            parts = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(aux)

    def _states(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor | None,
                step: CacheStep | StepKV | None) -> Tensor:
        parts = self.parts(step)
        embeds = parts.embed(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = step_rope(self, positions, hidden.dtype, step)
        h = parts.layers[0](embeds, hidden, cos, sin, mask, step)  # [B, T, H]
        for layer in parts.layers[1:]:  # plain Llama layers over h (vLLM's layer_idx > 0)
            h = layer(h, cos, sin, mask, step)  # [B, T, H]
        return h

    def _logits(self, h: Tensor, step=None) -> Tensor:
        parts = self.parts(step)
        return parts.lm_head(parts.norm(h))  # [..., Vd]

    def _feedback(self, h: Tensor, step=None) -> Tensor:
        return self.parts(step).norm(h) if self.config.norm_output else h

    def parts(self, step) -> ModelParts:
        """The modules, or for a cached forward without gradients their bundles, built once
        (:func:`~infer.models.snapshot.snapshot_of`; the shared embedding is watched too)."""
        if not uses_snapshot(step):
            return ModelParts(self.embed, self.layers, self.norm, self.lm_head)
        emb = self._embedding()
        return snapshot_of(self, lambda: ModelParts(
            Embed(emb.weight), tuple(layer.weights() for layer in self.layers),
            self.norm.weights(), proj_of(self.lm_head)), step, shared=[emb])

    # ---- checkpoint --------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """Write the speculators checkpoint (atomic); the shared embedding is not saved."""
        return write_checkpoint(path, self.config.to_dict(), self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = "auto",
                        device: str | torch.device = "cpu") -> "Eagle3Drafter":
        """Load a speculators (or SGLang ``midlayer``) EAGLE-3 checkpoint, frozen, eval mode."""
        raw, state, model_dir = read_checkpoint(path, "eagle3")
        config = cls.config_class.from_dict(raw)
        state = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
                 for k, v in state.items() if k not in _IGNORED and not _unused_hidden_norm(k)}
        cls.check_state(state, model_dir)
        with torch.device("meta"):
            model = cls(config, with_embedding="embed_tokens.weight" in state)
        if "d2t" not in state:  # vLLM's default: identity over the first draft_vocab_size ids
            state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(config.draft_vocab_size) + state["d2t"]] = True
            state["t2d"] = t2d
        check_tensors(model_dir, model.state_dict(), state)
        torch_dtype = resolve_dtype(dtype, {**config.transformer_layer_config, **config.extra})
        model.load_state_dict({k: v.to(device=device, dtype=torch_dtype if v.is_floating_point()
                                       else v.dtype) for k, v in state.items()}, assign=True)
        model.init_buffers()
        return model.requires_grad_(False).eval()

    @classmethod
    def check_state(cls, state: dict[str, Tensor], model_dir: Path) -> None:
        """Hook for subclasses: refuse a checkpoint lacking a tensor they need with a message
        naming it (before the generic missing/unexpected-weights check)."""
