"""A draft LM derived from a target that ships no smaller sibling (SmolLM2-135M-Instruct): the
target's first decoder layers with its embedding, final norm and LM head.

``draft_model`` and PARD need a causal LM that shares the target's tokenizer. Real families
ship one (Llama-3.2-1B beside 8B, Qwen3-0.6B beside 8B); a 135M model has none. Cutting the
target after its first layers gives a model with the same tokenizer, the same vocabulary and
weights that already fit together (the head reads the same residual stream the later layers
would have refined), so fine-tuning it (PARD's objective, ``recipes/smollm2_pard.yaml``) starts
from a sensible model instead of random weights. It is written beside the target as
``<target>-draft`` (``train/tiny/corpus.py:paired_draft_dir``), where PARD's ``drafter.model``
default and the harness's ``draft_model`` rows look for a paired draft.

At SmolLM2's shapes the tied LM head (49,152 x 576) is a fifth of the weights, so even a 4-layer
draft reads ~0.3 of the target's bytes per step: it pays with PARD's one forward for all k
drafts, hardly as a k-forward ``draft_model`` chain.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from infer.foundation.atomic import atomic_dir
from infer.foundation.files import TOKENIZER_FILES, open_safetensors
from infer.models.loader import weight_files
from infer.foundation.validation import config_error

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def derive_draft(target_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Write ``out_dir``: the target's first ``num_layers`` decoder layers, its embedding, final
    norm and (untied) head, float32 safetensors; config.json, generation config and tokenizer
    files copied with the layer count changed. Atomic: a killed write leaves no folder."""
    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if isinstance(num_layers, bool) or not 1 <= int(num_layers) < total:
        raise config_error("draft layers", num_layers,
                           f"an integer in [1, {total - 1}] (the target has {total})",
                           str(target_dir))
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen3, Gemma)
        config["layer_types"] = config["layer_types"][:num_layers]
    with atomic_dir(out_dir) as tmp:
        _write_first_layers(target_dir, tmp / "model.safetensors", num_layers)
        for name in _side_files(target_dir):
            shutil.copyfile(target_dir / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)


def _write_first_layers(target_dir: Path, dest: Path, num_layers: int) -> None:
    from safetensors.torch import save_file

    state = {}
    for file in weight_files(target_dir):
        with open_safetensors(file) as f:
            for name in f.keys():
                layer = _LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    state[name] = f.get_tensor(name).contiguous()
    save_file(state, str(dest), metadata={"format": "pt"})


def _side_files(target_dir: Path) -> list[str]:
    """Tokenizer, chat template and generation config: everything a loader reads besides the
    weights and config.json."""
    names = (*TOKENIZER_FILES, "generation_config.json")
    return [n for n in names if (target_dir / n).is_file()]
