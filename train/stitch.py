"""Stitched MTP checkpoints: a copy of the target with trained MTP layers under their native
names, which vLLM serves unchanged as ``method: mtp`` (docs/reference.md §14).

vLLM has no loader for a separate MTP checkpoint: its ``mtp`` draft is the target directory
itself (it rewrites the target's config into the MTP model's and loads only
``model.mtp_layers.*``, the embedding and the LM head). So the deployable artifact is the whole
target with the layers swapped in:

- every file of the target but its weights is copied (tokenizer, generation config ...);
- each weight shard is rewritten without the old ``model.mtp_layers.*`` tensors (vLLM and
  transformers read every tensor of every shard they are given: a stale copy beside the new one
  would load in file order), and the new layers are added (into the single file, or as one more
  shard listed in the index);
- ``config.json`` says ``architectures: ["MiMoForCausalLM"]`` and
  ``num_nextn_predict_layers``. A target that was not MiMo (the embedded tiny Llama) becomes one:
  ``model_type`` ``qwen2`` (MiMo's body; transformers and vLLM know it without remote code,
  where ``mimo`` needs Xiaomi's), with zero q/k/v biases added, which computes exactly what the
  Llama body computed.

``mtp_layers/mtp_layers.safetensors`` inside the export holds the trained tensors alone (a
subfolder: loaders never look there), with a ``config.json`` naming the layer count.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from infer.foundation.atomic import atomic_dir, remove_leftovers
from infer.drafters.mtp import NUM_LAYERS_KEY, PREFIX
from infer.foundation.errors import FileFormatError
from infer.foundation.files import read_json
from infer.models.loader import weight_files

INDEX = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"
ALONE = "mtp_layers"


def mimo_config(target: dict, num_layers: int) -> dict:
    """The target's config.json as a MiMo target with ``num_layers`` MTP layers."""
    kind = target.get("model_type")
    if kind not in ("llama", "qwen2", "mimo"):
        raise FileFormatError(f"an MTP layer can be stitched into a Llama, Qwen2 or MiMo target, "
                              f"not model_type {kind!r}")
    if kind == "llama" and (target.get("attention_bias") or target.get("mlp_bias")):
        raise FileFormatError("a Llama target with attention_bias / mlp_bias has an o_proj / MLP "
                              "bias MiMo's Qwen2 body lacks: it cannot be stitched")
    out = {**target, "architectures": ["MiMoForCausalLM"], NUM_LAYERS_KEY: num_layers}
    if kind == "llama":  # Qwen2's keys for what the Llama body did
        out.update(model_type="qwen2", use_sliding_window=False, sliding_window=None,
                   max_window_layers=target["num_hidden_layers"])
        for key in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim"):
            if key == "head_dim" and target.get(key) not in (None, target["hidden_size"]
                                                               // target["num_attention_heads"]):
                raise FileFormatError(f"head_dim {target[key]} differs from hidden_size / heads; "
                                      "Qwen2 (MiMo's body) cannot express it")
            out.pop(key, None)
    return out


def _zero_biases(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """q/k/v biases of zeros for every body layer whose q/k/v weights are in ``tensors``."""
    out = {}
    for name, w in tensors.items():
        for proj in ("q_proj", "k_proj", "v_proj"):
            if name.startswith("model.layers.") and name.endswith(f"self_attn.{proj}.weight"):
                bias = name.removesuffix("weight") + "bias"
                if bias not in tensors:
                    out[bias] = w.new_zeros(w.shape[0])
    return out


def _read(file: Path) -> dict[str, Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if not k.startswith(PREFIX)}


def write_stitched(target_dir: str | Path, path: str | Path, mtp: dict[str, Tensor],
                   num_layers: int) -> Path:
    """Write the target at ``target_dir`` with ``mtp`` (names ``model.mtp_layers.i.*``) into
    ``path``, atomically (module doc)."""
    src = Path(target_dir)
    hf = read_json(src / "config.json", what="the target's config")
    config = mimo_config(hf, num_layers)
    flat = {k: v.detach().to("cpu").contiguous() for k, v in mtp.items()}
    remove_leftovers(path)
    with atomic_dir(path) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in (INDEX,
                                                                            "config.json"):
                shutil.copy2(f, tmp / f.name)
        files = weight_files(src)
        weight_map = {}
        for file in files:
            tensors = _read(file)
            if hf.get("model_type") == "llama":
                tensors.update(_zero_biases(tensors))
            if len(files) == 1:
                tensors.update(flat)
            save_file(tensors, str(tmp / file.name), metadata={"format": "pt"})
            weight_map.update({k: file.name for k in tensors})
        if len(files) > 1:
            save_file(flat, str(tmp / MTP_SHARD), metadata={"format": "pt"})
            weight_map.update({k: MTP_SHARD for k in flat})
            (tmp / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                indent=2))
        (tmp / ALONE).mkdir()
        save_file(flat, str(tmp / ALONE / "mtp_layers.safetensors"), metadata={"format": "pt"})
        (tmp / ALONE / "config.json").write_text(json.dumps(
            {NUM_LAYERS_KEY: num_layers, "target": str(src)}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(path)
