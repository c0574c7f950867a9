"""The sizes of a target the engine may not run: what shapes a drafter for any causal LM.

draftsmith's engine (infer/models/llama.py) runs the families infer/models/loader.py lists;
training, regeneration and the planner also take any other causal LM transformers ships (through
transformers' own implementation: train/hf_target.py, infer/eval/transformers_session.py). They
need its sizes all the same: vocabulary, widths, depth, heads, and the RoPE a Llama-style drafter
layer copies. ``target_config`` gives the engine's config where the engine runs the target, else
one read from the transformers config; ``engine_gap`` says why the engine cannot (printed by the
run that takes the other path).
"""

from __future__ import annotations

from pathlib import Path

from infer.foundation.errors import ConfigError, FileFormatError
from infer.foundation.files import read_json
from infer.models.llama import ModelConfig
from infer.models.loader import (config_from_hf, load_config, resolve_model_dir, rope_from_hf,
                                 token_ids)
from infer.models.rope import RopeConfig

_WHERE = "target.path"


def engine_gap(model_dir: str | Path) -> str | None:
    """Why draftsmith's engine cannot run this target (None: it can). The same check the
    engine's loader makes, so the two never disagree."""
    hf = read_json(resolve_model_dir(model_dir, key=_WHERE) / "config.json",
                   what="the model's config")
    try:
        config_from_hf(hf)
    except ConfigError as err:
        return str(err)
    except KeyError as err:  # a key every family the engine runs has
        return f"its config.json has no {err}"
    return None


def target_config(model_dir: str | Path) -> ModelConfig:
    """The target's sizes: the engine's config when it runs the target, else what a drafter is
    shaped from, read from a transformers config (:func:`foreign_config`)."""
    model_dir = resolve_model_dir(model_dir, key=_WHERE)
    if engine_gap(model_dir) is None:
        return load_config(model_dir)
    return foreign_config(read_json(model_dir / "config.json", what="the model's config"),
                          str(model_dir / "config.json"))


def sizes_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A ``config.json`` dict's sizes, whether or not the engine runs the architecture."""
    try:
        return config_from_hf(hf)
    except (ConfigError, KeyError):
        return foreign_config(hf, where)


def foreign_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """Sizes of a target the engine does not run: vocabulary, widths, depth, heads and the
    full-attention layers' RoPE (what a Llama-style drafter layer copies). MoE targets give
    their expert width when they have no dense one."""
    text = hf.get("text_config") or hf  # multimodal wrappers nest the language model's
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads") if k not in text]
    if missing:
        raise FileFormatError(f"{where} lacks {', '.join(missing)}: not a causal LM config "
                              "transformers can build")
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    width = text.get("intermediate_size") or text.get("moe_intermediate_size") or 4 * hidden
    eps = text.get("rms_norm_eps") or text.get("layer_norm_eps") or 1e-6
    archs = hf.get("architectures") or [text.get("model_type", "unknown")]
    return ModelConfig(
        vocab_size=text["vocab_size"], hidden_size=hidden, num_layers=text["num_hidden_layers"],
        num_heads=heads, num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or hidden // heads, intermediate_size=width,
        rms_norm_eps=float(eps), rope=_full_attention_rope(text),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))),
        max_position_embeddings=text.get("max_position_embeddings", 4096),
        model_type=text.get("model_type", "unknown"), architecture=archs[0],
        eos_token_ids=token_ids(text.get("eos_token_id")), pad_token_id=text.get("pad_token_id"),
        bos_token_id=text.get("bos_token_id"))


def _full_attention_rope(text: dict) -> RopeConfig:
    """RoPE of the full-attention layers (Gemma 3 keeps one per layer type); a type the engine
    does not implement (Phi-3's longrope) falls back to plain RoPE at the same theta: only a
    drafter layer's initial positions depend on it."""
    params = text.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        text = {**text, "rope_parameters": params["full_attention"], "rope_scaling": None}
    try:
        return rope_from_hf(text)
    except ConfigError:
        theta = (text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta"))
        return RopeConfig(theta=float(theta or 10000.0))
