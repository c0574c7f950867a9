"""Load Hugging Face Llama-family checkpoints into :class:`~infer.models.llama.Llama`.

Everything that knows Hugging Face's formats lives here: the per-architecture option table,
``config.json`` / ``generation_config.json`` keys (transformers 4.x ``rope_theta`` +
``rope_scaling`` and 5.x ``rope_parameters``), and weight names. Weights are read only from
safetensors (``model.safetensors`` or a sharded ``model.safetensors.index.json``); pickled
``.bin`` files are refused, never unpickled.

``dtype="auto"`` honours the checkpoint's ``dtype`` / ``torch_dtype`` (float32 when absent), also on
CPU: bfloat16 runs there, only slower; ask for ``"float32"`` explicitly if that matters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from infer.foundation.errors import FileFormatError, MissingFileError
from infer.foundation.files import check_tensors, open_safetensors, read_json
from infer.models.llama import Llama, ModelConfig, inference_layout
from infer.models.rope import ROPE_TYPES, RopeConfig
from infer.foundation.validation import config_error


@dataclass(frozen=True)
class ArchSpec:
    """How one Hugging Face architecture maps onto :class:`ModelConfig` options."""

    model_type: str
    qkv_bias: bool | None  # None: the config's ``attention_bias`` (which also covers o_proj)
    qk_norm: bool
    sliding: str  # "none"; "all": sliding_window on every layer; "layer_types": per layer


ARCHITECTURES = {
    "LlamaForCausalLM": ArchSpec("llama", qkv_bias=None, qk_norm=False, sliding="none"),
    "MistralForCausalLM": ArchSpec("mistral", qkv_bias=False, qk_norm=False, sliding="all"),
    "Qwen2ForCausalLM": ArchSpec("qwen2", qkv_bias=True, qk_norm=False, sliding="layer_types"),
    "Qwen3ForCausalLM": ArchSpec("qwen3", qkv_bias=None, qk_norm=True, sliding="layer_types"),
    # Xiaomi MiMo: the Qwen2 body; its MTP layers (model.mtp_layers.*) are infer/drafters/mtp.py's
    "MiMoForCausalLM": ArchSpec("mimo", qkv_bias=True, qk_norm=False, sliding="layer_types"),
    # Qwen3's attention with a sparse mixture of experts in place of the MLP (SparseMoE)
    "Qwen3MoeForCausalLM": ArchSpec("qwen3_moe", qkv_bias=None, qk_norm=True,
                                    sliding="layer_types"),
    # Phi-3 / Phi-4: the Llama body with q/k/v and gate/up stored fused (split at load, below)
    "Phi3ForCausalLM": ArchSpec("phi3", qkv_bias=False, qk_norm=False, sliding="all"),
}
#: fused checkpoint weights (Phi-3) -> the native parts, in the order they are stacked
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_architecture(hf: dict, where: str = "config.json") -> str:
    """The supported architecture a config names (``architectures``, else ``model_type``)."""
    names = hf.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names:
        for name, spec in ARCHITECTURES.items():
            if spec.model_type == hf.get("model_type"):
                return name
    raise config_error("architectures", names or None,
                       f"one of the supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)} "
                       f"(model_type is {hf.get('model_type')!r}){_hint(hf)}", where)


def _hint(hf: dict) -> str:
    """Point at the right key when a drafter checkpoint is given as the target model, else at
    the path a target the engine lacks still has (training through transformers)."""
    archs = " ".join(hf.get("architectures") or [])
    if "speculators_model_type" in hf or any(k in archs for k in ("Eagle", "Speculator")):
        return "; this is a drafter checkpoint: give it as speculative_config.model"
    return ("; train.py still trains drafters for it through transformers, to serve in vLLM "
            "(docs/any-target.md)")


def rope_from_hf(hf: dict) -> RopeConfig:
    """RoPE parameters from 4.x (``rope_theta``, ``rope_scaling``) or 5.x (``rope_parameters``)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in params.values()):
        raise config_error("rope_parameters", params, "one rope dict (per-layer-type rope is "
                           "not supported)", "config.json")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise config_error("rope_type", rope_type, f"one of {', '.join(ROPE_TYPES)}", "config.json")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise config_error("partial_rotary_factor", partial, "1.0 (RoPE over the whole head; "
                           "partial rotary is not supported)", "config.json")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    keys = ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale",
            "mscale_all_dim", "truncate")
    opt = {k: params[k] for k in keys if params.get(k) is not None}
    for k in ("beta_fast", "beta_slow"):  # Hugging Face treats 0 / None as "use the default"
        if params.get(k):
            opt[k] = float(params[k])
    original = params.get("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original:
        factor = hf["max_position_embeddings"] / original
    return RopeConfig(theta=float(theta), type=rope_type, factor=float(factor or 1.0),
                      original_max_position_embeddings=original, **opt)


def token_ids(value) -> tuple[int, ...]:
    """A config's token id field (an int, a list or None) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _sliding(hf: dict, spec: ArchSpec, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, layers using it): Mistral applies it everywhere; Qwen per ``layer_types``."""
    window = hf.get("sliding_window")
    if spec.sliding == "none" or window is None:
        return None, ()
    if spec.sliding == "all":
        return int(window), tuple(range(num_layers))
    if not hf.get("use_sliding_window", False):
        return None, ()
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", num_layers) else "full_attention"
        for i in range(num_layers)]
    return int(window), tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def config_from_hf(hf: dict, generation: dict | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from ``config.json`` (and ``generation_config.json``) dicts."""
    arch = resolve_architecture(hf)
    spec = ARCHITECTURES[arch]
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise config_error("hidden_act", hf["hidden_act"], "'silu'", "config.json")
    generation = generation or {}
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    attention_bias = bool(hf.get("attention_bias", False))
    window, sliding_layers = _sliding(hf, spec, layers)
    eos = token_ids(generation.get("eos_token_id")) + token_ids(hf.get("eos_token_id"))
    bos = generation.get("bos_token_id", hf.get("bos_token_id"))
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope=rope_from_hf(hf), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        model_type=spec.model_type, architecture=arch,
        qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
        o_bias=attention_bias if spec.qkv_bias is None else False,
        mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=spec.qk_norm,
        sliding_window=window, sliding_layers=sliding_layers,
        eos_token_ids=tuple(dict.fromkeys(eos)), bos_token_id=bos,
        pad_token_id=hf.get("pad_token_id"), **_experts(hf, layers),
    )


def _experts(hf: dict, num_layers: int) -> dict:
    """Qwen3-MoE's expert settings: which layers are sparse (every ``decoder_sparse_step``-th,
    but not ``mlp_only_layers``), how many experts, chosen per token, of what width."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not experts:
        return {}
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=layers)


def resolve_model_dir(path: str | Path, key: str = "model") -> Path:
    """A local directory, or a hub id (``owner/name``) already in the local Hugging Face cache."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if not p.is_absolute() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(str(path), local_files_only=True,
                                          allow_patterns=["*.json", "*.safetensors"]))
        except Exception:  # not cached (or hub library absent): report the path below
            pass
    if p.exists():
        raise MissingFileError(f"{key}={str(path)!r} is a file; expected a model directory")
    raise MissingFileError(f"{key}={str(path)!r}: model directory not found (a local directory, "
                           "or a hub id already downloaded to the Hugging Face cache)")


# config.json keys without a default: a Llama-family config lacking one cannot be built
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")


def _read_hf_configs(model_dir: Path) -> tuple[dict, dict | None]:
    """``config.json`` and (when present) ``generation_config.json`` as dicts."""
    cfg_path, gen_path = model_dir / "config.json", model_dir / "generation_config.json"
    if not cfg_path.is_file():
        raise MissingFileError(f"no config.json in model directory {model_dir}")
    hf = read_json(cfg_path, what="the model's config")
    resolve_architecture(hf, where=str(cfg_path))
    missing = [k for k in REQUIRED_KEYS if k not in hf]
    if missing:
        raise FileFormatError(f"{cfg_path} lacks required key(s) {', '.join(missing)} of a "
                              f"{hf.get('model_type', 'llama')} config")
    return hf, read_json(gen_path) if gen_path.is_file() else None


def load_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a model directory (or locally cached hub id)."""
    return config_from_hf(*_read_hf_configs(resolve_model_dir(path)))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: a single file or the shards of an index."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, required=("weight_map",))["weight_map"]
        shards = [model_dir / s for s in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise MissingFileError(f"{index} lists shard(s) {absent[:4]} that are not in "
                                   f"{model_dir}: an incomplete download?")
        return shards
    if single.is_file():
        return [single]
    pickled = sorted(p.name for p in model_dir.glob("*.bin"))
    found = (f"; found only {', '.join(pickled)} (pickled weights are never loaded)"
             if pickled else "")
    raise MissingFileError(f"no safetensors weights in {model_dir}: expected model.safetensors "
                            f"or model.safetensors.index.json{found}. safetensors is required; "
                            "convert once with transformers (from_pretrained(dir)"
                            ".save_pretrained(dir) writes safetensors)")


def native_name(hf_name: str) -> str | None:
    """Hugging Face weight name -> ours (drop the ``model.`` prefix); None = not a weight we use."""
    if hf_name.endswith("rotary_emb.inv_freq") or hf_name.startswith("model.mtp_layers."):
        return None  # MTP layers: loaded by the mtp proposer (infer/drafters/mtp.py)
    return hf_name.removeprefix("model.")


def resolve_dtype(dtype: str | torch.dtype, hf: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise config_error("dtype", dtype, f"'auto' or one of {', '.join(DTYPES)}", "load_model")
    return DTYPES[dtype]


def load_model(path: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", fuse: bool = True) -> Llama:
    """Build the model for a Hugging Face checkpoint directory and load its weights.

    The model is built on the meta device (no random init), the safetensors tensors are assigned
    in place, converted to ``dtype`` on ``device``. Returned frozen (``requires_grad=False``) and
    in eval mode: it is a target model, in the inference layout (infer/models/layout.py: fused
    q/k/v and gate/up, and on CPU its large linear weights oneDNN-packed). To train it, load with
    ``fuse=False`` (PyTorch's layout, every parameter its own storage, as sharded optimizers
    need) and call ``requires_grad_(True)``.
    """
    model_dir = resolve_model_dir(path)
    config, torch_dtype = model_config_and_dtype(model_dir, dtype)
    with torch.device("meta"):
        model = Llama(config)
    state = {}
    for name, t in checkpoint_tensors(model_dir, config, model.named_parameters()):
        state[name] = t.to(device=device, dtype=torch_dtype if t.is_floating_point() else t.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # assign replaced the embedding parameter; re-share it
    model.init_buffers()
    if fuse:
        inference_layout(model)  # one q/k/v and one gate/up matmul per layer; packed on CPU
    return model.requires_grad_(False).eval()


def model_config_and_dtype(model_dir: Path, dtype: str | torch.dtype = "auto"
                           ) -> tuple[ModelConfig, torch.dtype]:
    """The checkpoint's :class:`ModelConfig` and the torch dtype ``dtype`` resolves to for it."""
    hf, generation = _read_hf_configs(model_dir)
    return config_from_hf(hf, generation), resolve_dtype(dtype, hf)


def checkpoint_tensors(model_dir: Path, config: ModelConfig, parameters
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(native name, CPU tensor in the checkpoint's dtype)`` of every weight the model uses,
    one at a time (file by file, memory-mapped), so that a sharded load never holds more than one
    whole tensor. ``parameters``: the model's ``named_parameters()`` (meta, DTensor or ZeRO-3
    placeholders alike: only names and full shapes are read; ZeRO-3's are in ``ds_shape``). The
    names and shapes of the whole checkpoint are checked against them, from the safetensors
    headers, before the first tensor is read."""
    expected = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in parameters}
    entries: dict[Path, list[tuple[str, str, slice | None]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(model_dir):
        with open_safetensors(file) as f:
            for hf_name in f.keys():
                name = native_name(hf_name)
                if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                shape = tuple(f.get_slice(hf_name).get_shape())
                for part, rows in fused_parts(name, shape, config):
                    entries.setdefault(file, []).append((part, hf_name, rows))
                    shapes[part] = shape if rows is None else (rows.stop - rows.start, *shape[1:])
    check_tensors(model_dir, expected, shapes, f" (for {config.architecture})")
    for file, names in entries.items():
        with open_safetensors(file) as f:
            for name, hf_name, rows in names:
                yield name, f.get_tensor(hf_name) if rows is None else f.get_slice(hf_name)[rows]


def fused_parts(name: str, shape: tuple[int, ...], config: ModelConfig
                ) -> list[tuple[str, slice | None]]:
    """A checkpoint tensor's native names and the rows each takes: itself whole (None), or the parts
    of a fused q/k/v or gate/up weight (``FUSED``), in the order they are stacked."""
    suffix = next((k for k in FUSED if name.endswith(k)), None)
    if suffix is None:
        return [(name, None)]
    prefix = name.removesuffix(suffix)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = (q, kv, kv) if suffix.startswith("self_attn") else (config.intermediate_size,) * 2
    if sum(sizes) != shape[0]:
        raise FileFormatError(f"{name} has {shape[0]} rows, expected {sum(sizes)} (the fused "
                              f"parts {' + '.join(map(str, sizes))} of its config.json)")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(prefix + part, slice(a, a + n)) for part, a, n in zip(FUSED[suffix], starts, sizes)]
