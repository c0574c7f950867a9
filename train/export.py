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

vLLM reads the speculators layout as it is, but which of its keys it honours depends on the
version (checked against the source of every release from 0.10 to 0.32, docs/reference.md §4).
``vllm_requirements`` lists, for a head, each feature an older vLLM would load as a different
function (silently, or failing on a weight name) and the first release that serves it; the
trainer prints them before training starts and ``python -m train.export --vllm HEAD`` for any
checkpoint. Nothing a current vLLM serves is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infer.drafters.common import read_checkpoint, write_checkpoint
from infer.drafters.eagle3 import SGLANG_ARCHITECTURE, Eagle3Config, default_aux_layer_ids
from infer.drafters.peagle import PEagleConfig
from infer.draft_config import checkpoint_type
from infer.foundation.validation import config_error

_SGLANG_WEIGHTS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}  # + midlayer.*
_SGLANG_FIXED = {  # flag -> the value SGLang's LlamaForCausalLMEagle3 implements
    "norm_before_residual": False, "norm_output": False, "fc_norm": False,
    "norm_before_fc": False, "embed_requires_grad": False,
}


@dataclass(frozen=True)
class VllmRequirement:
    """One feature of a head and the first vLLM release that serves it as trained."""

    feature: str  # the drafter key / config value, e.g. "fc_norm=true"
    version: tuple[int, int, int]  # the first vLLM release that honours it
    older: str  # what earlier releases do with such a checkpoint

    def line(self) -> str:
        return (f"{self.feature}: needs vLLM >= {'.'.join(map(str, self.version))}; "
                f"older vLLM {self.older}")


def vllm_requirements(config: Eagle3Config, num_target_layers: int | None = None
                      ) -> list[VllmRequirement]:
    """What serving ``config`` asks of vLLM, beyond its oldest EAGLE-3 support (0.10.1:
    speculators configs with ``norm_before_residual``)."""
    out = [VllmRequirement("norm_before_residual", (0, 10, 1), "has no speculators EAGLE-3")]
    if getattr(config, "mask_token_id", None) is not None:  # a P-EAGLE head (PEagleConfig)
        out.append(VllmRequirement("P-EAGLE (speculators_model_type peagle, served as eagle3 + "
                                   "parallel_drafting)", (0, 16, 0),
                                   "has no parallel drafting for EAGLE heads"))
    if config.num_layers > 1:  # vllm#26164, opened after 0.11.0 was cut; the release is
        # inferred from its date, not read from release source like the others
        out.append(VllmRequirement(f"num_hidden_layers={config.num_layers}", (0, 11, 1),
                                   "builds one decoder layer and fails to load layers.1.*"))
    if config.norm_before_fc:
        out.append(VllmRequirement("norm_before_fc=true", (0, 19, 0),
                                   "drops the key and skips input_norm (0.18) or cannot load "
                                   "input_norm.weight: the head runs without its input norm"))
    if config.fc_norm:
        out.append(VllmRequirement("fc_norm=true", (0, 25, 0), "cannot load fc_norm.*.weight "
                                   "(or ignores the key): the head runs without those norms"))
    if config.norm_output:
        out.append(VllmRequirement("norm_output=true", (0, 25, 0), "ignores it and feeds the "
                                   "pre-norm state back: every draft after the first differs"))
    if config.embed_requires_grad:
        out.append(VllmRequirement("embed_requires_grad=true (embed_tokens.weight shipped)",
                                   (0, 11, 1), "replaces the trained embedding with the "
                                   "target's (vLLM keeps a shipped one unless it equals the "
                                   "target's)"))
    out += _aux_requirements(config, num_target_layers)
    return out


def _aux_requirements(config: Eagle3Config, n: int | None) -> list[VllmRequirement]:
    ids = config.eagle_aux_hidden_state_layer_ids
    out: list[VllmRequirement] = []
    if ids is None:
        return out
    if n is None or sorted(ids) != default_aux_layer_ids(n):
        out.append(VllmRequirement(f"eagle_aux_hidden_state_layer_ids={sorted(ids)}",
                                   (0, 11, 1), "captures its default layers [2, n // 2, n - 3]"))
    if min(ids) == 0 or (n is not None and max(ids) == n):
        out.append(VllmRequirement("aux id 0 (embeddings) or n (last layer)", (0, 18, 0),
                                   "crashes on id 0 and never captures id n"))
    if len(ids) != 3:
        out.append(VllmRequirement(f"{len(ids)} aux states (num_aux_hidden_states)",
                                   (0, 22, 0), "builds fc for three states and fails to load "
                                   "fc.weight"))
    return out


def min_vllm_version(requirements: list[VllmRequirement]) -> str:
    """The first vLLM release that serves every requirement."""
    return ".".join(map(str, max(r.version for r in requirements)))


def sglang_config(config: Eagle3Config, where: str = "export_sglang") -> dict:
    """The SGLang ``config.json`` of a speculators EAGLE-3 config (raises when SGLang would
    compute something else, see the module doc)."""
    for flag, value in _SGLANG_FIXED.items():
        if getattr(config, flag) != value:
            raise config_error(flag, getattr(config, flag), f"{value}: SGLang's "
                               f"{SGLANG_ARCHITECTURE} implements only {flag}={value} (train "
                               f"with drafter.{flag}={str(value).lower()} for an SGLang export)",
                               where)
    if config.num_layers != 1:
        raise config_error("transformer_layer_config.num_hidden_layers", config.num_layers,
                           f"1: SGLang's {SGLANG_ARCHITECTURE} has one decoder layer (midlayer; "
                           "train with drafter.num_layers=1 for an SGLang export)", where)
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
    raw, state, model_dir = read_checkpoint(speculators_dir, "eagle3")
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


def vllm_report(config: Eagle3Config, num_target_layers: int | None = None) -> str:
    """The lines printed for a head: the minimum vLLM version and each feature that sets it."""
    reqs = vllm_requirements(config, num_target_layers)
    lines = [f"vLLM: this head needs vLLM >= {min_vllm_version(reqs)}"]
    lines += [f"  {r.line()}" for r in reqs if r.version > (0, 10, 1)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m train.export SPECULATORS_DIR OUT_DIR``: write the SGLang layout;
    ``python -m train.export --vllm SPECULATORS_DIR``: the vLLM versions that serve it."""
    import argparse

    ap = argparse.ArgumentParser(description="Convert a speculators EAGLE-3 checkpoint (what "
                                 "train.py writes, what vLLM loads) into SGLang's layout, or "
                                 "with --vllm say which vLLM versions serve it as trained.")
    ap.add_argument("speculators_dir")
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--vllm", action="store_true", help="print the vLLM requirements only")
    args = ap.parse_args(argv)
    if args.vllm:
        raw, _, _ = read_checkpoint(args.speculators_dir, "eagle3")  # eagle3 or peagle
        parse = PEagleConfig.from_dict if checkpoint_type(raw) == "peagle" \
            else Eagle3Config.from_dict
        print(vllm_report(parse(raw)))
        return
    if args.out_dir is None:
        ap.error("OUT_DIR is required (or pass --vllm)")
    print(f"wrote {export_sglang(args.speculators_dir, args.out_dir)}")


if __name__ == "__main__":
    main()
