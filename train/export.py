"""Deployment formats beyond the speculators one each objective writes (``Objective.export``).

SGLang / SpecForge EAGLE-3 layout (what ``--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR`` loads, ``sglang/srt/models/llama_eagle3.py``)::

    config.json        a one-layer Llama config (hidden / heads / rope / vocab_size = target's)
                       + architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
                       target_hidden_size, tie_word_embeddings false and
                       eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}
    model.safetensors  fc.weight, midlayer.* (the decoder layer, hidden_norm included),
                       norm.weight, lm_head.weight, d2t, t2d

Differences that matter (checked against SGLang's model code, not just the names):

- aux ids: SGLang's id ``j`` is the *output of layer j* (it captures ``j + 1``); speculators /
  vLLM / draftsmith id ``k`` is the residual stream after ``k`` layers. So ``j = k - 1``, and id 0
  (the embeddings) cannot be expressed.
- SGLang's layer always uses the raw ``fc`` output as the residual, feeds back the pre-norm state,
  has no ``fc_norm`` / ``input_norm``, a 3-layer ``fc`` and always serves with the *target's*
  embedding (it replaces ``embed_tokens``). Heads trained otherwise (``norm_before_residual``,
  ``norm_output``, ``fc_norm``, ``norm_before_fc``, ``embed_requires_grad``, not three aux ids)
  would run as a different function there, so they are refused instead of exported wrongly.

``Eagle3Drafter.from_pretrained`` reads this layout back (``Eagle3Config.from_sglang_dict``).
"""

from __future__ import annotations

from pathlib import Path

from infer.drafters.common import read_checkpoint, write_checkpoint
from infer.drafters.eagle3 import SGLANG_ARCHITECTURE, Eagle3Config
from infer.validation import config_error

_SGLANG_WEIGHTS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}  # + midlayer.*
_SGLANG_FIXED = {  # flag -> the value SGLang's LlamaForCausalLMEagle3 implements
    "norm_before_residual": False, "norm_output": False, "fc_norm": False,
    "norm_before_fc": False, "embed_requires_grad": False,
}


def sglang_config(config: Eagle3Config, where: str = "export_sglang") -> dict:
    """The SGLang ``config.json`` of a speculators EAGLE-3 config (raises when SGLang would
    compute something else, see the module doc)."""
    for flag, value in _SGLANG_FIXED.items():
        if getattr(config, flag) != value:
            raise config_error(flag, getattr(config, flag), f"{value}: SGLang's "
                               f"{SGLANG_ARCHITECTURE} implements only {flag}={value} (train "
                               f"with drafter.{flag}={str(value).lower()} for an SGLang export)",
                               where)
    ids = config.eagle_aux_hidden_state_layer_ids
    if ids is not None and (len(ids) != 3 or min(ids) < 1):
        raise config_error("eagle_aux_hidden_state_layer_ids", ids, "three ids >= 1 (SGLang's "
                           "fc takes three aux states and cannot capture the embeddings)", where)
    layer = dict(config.transformer_layer_config)
    layer.pop("torch_dtype", None)  # written from the weights
    out = {**layer, "architectures": [SGLANG_ARCHITECTURE], "model_type": "llama",
           "num_hidden_layers": 1, "tie_word_embeddings": False,
           "draft_vocab_size": config.draft_vocab_size,
           "target_hidden_size": config.target_hidden}
    if ids is not None:  # absent: SGLang's default [2, n // 2, n - 3], speculators' too
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in sorted(ids)],
                               "use_aux_hidden_state": True}
    return out


def export_sglang(speculators_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a speculators EAGLE-3 checkpoint into SGLang's layout in ``out_dir`` (atomic)."""
    raw, state, model_dir = read_checkpoint(speculators_dir)
    config = Eagle3Config.from_dict(raw)
    config_json = sglang_config(config, f"export_sglang({model_dir})")
    tensors = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
               for k, v in state.items() if not k.startswith("verifier_")}  # SGLang skips them
    unexpected = sorted(k for k in tensors
                        if k not in _SGLANG_WEIGHTS and not k.startswith("midlayer."))
    if unexpected:
        raise ValueError(f"export_sglang({model_dir}): weights SGLang would not load: "
                         f"{unexpected[:8]}")
    return write_checkpoint(out_dir, config_json, tensors)


def main(argv: list[str] | None = None) -> None:
    """``python -m train.export SPECULATORS_DIR OUT_DIR``: write the SGLang layout."""
    import argparse

    ap = argparse.ArgumentParser(description="Convert a speculators EAGLE-3 checkpoint (what "
                                 "train.py writes, what vLLM loads) into SGLang's layout.")
    ap.add_argument("speculators_dir")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    print(f"wrote {export_sglang(args.speculators_dir, args.out_dir)}")


if __name__ == "__main__":
    main()
