"""A GGUF checkpoint -> a Hugging Face model folder that the engine, transformers and vLLM load.

Real instruct models reach this machine only as GGUF files inside registry packages (the
SmolLM2 target: train/real/targets.py). transformers reads GGUF with the ``gguf`` package and
dequantizes it at load (``from_pretrained(folder, gguf_file=name)``), but transformers 5 refuses
``save_pretrained`` and ``.float()`` on such a model. So the conversion is done by hand, once:

- weights: the loaded float32 state dict written with safetensors, ``lm_head.weight`` dropped
  when the embeddings are tied (safetensors refuses shared storage, and tied checkpoints omit it);
- config: transformers' config without ``quantization_config`` (the weights are plain float32
  now), with ``architectures`` set (absent after GGUF loading) and ``dtype: float32``;
- tokenizer: transformers' GGUF tokenizer, saved; its bos / eos / pad ids are checked against the
  GGUF's own metadata (older transformers swapped bos and eos for Llama GGUF tokenizers) and its
  chat template must render a conversation exactly as the GGUF's template does.

Everything is written into a temporary folder that becomes ``out_dir`` only when complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.foundation.atomic import atomic_dir
from infer.foundation.errors import FileFormatError, MissingFileError

# a conversation that exercises the template: system default inserted, two turns, generation
# prompt (the rendering of the saved tokenizer must equal the GGUF template's, character for char)
CHECK_CONVERSATION = [{"role": "user", "content": "What is 2 + 2?"},
                      {"role": "assistant", "content": "4."},
                      {"role": "user", "content": "And 3 + 3?"}]


@dataclass(frozen=True)
class GgufTokenizerMeta:
    """What the GGUF file itself says about its tokenizer (``tokenizer.ggml.*``)."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None
    tokens: tuple[str, ...]


def read_tokenizer_meta(gguf_path: Path) -> GgufTokenizerMeta:
    """The tokenizer metadata of a GGUF file, read with the ``gguf`` package's reader."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(gguf_path).fields
    except Exception as err:  # truncated or not a GGUF file at all
        raise FileFormatError(f"{gguf_path}: not a readable GGUF file "
                              f"({type(err).__name__}: {err})") from None

    def scalar(key: str):
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.contents()

    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise FileFormatError(f"{gguf_path}: no tokenizer.ggml.tokens (a GGUF without its "
                              "tokenizer cannot be served)")
    template = fields.get("tokenizer.chat_template")
    return GgufTokenizerMeta(scalar("bos_token_id"), scalar("eos_token_id"),
                             scalar("padding_token_id"),
                             None if template is None else template.contents(),
                             tuple(tokens.contents()))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into a float32 Hugging Face folder at ``out_dir`` (atomically)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise MissingFileError(f"GGUF file {gguf_path} does not exist")
    meta = read_tokenizer_meta(gguf_path)
    tokenizer = _load_tokenizer(gguf_path, meta)
    model = _load_model(gguf_path)
    with atomic_dir(out_dir) as tmp:
        _write_weights(model, tmp)
        tokenizer.save_pretrained(tmp)
        _write_config(model, tokenizer, tmp)
        _check_saved_tokenizer(tmp, meta, gguf_path)
    return Path(out_dir)


def _load_tokenizer(gguf_path: Path, meta: GgufTokenizerMeta):
    """transformers' tokenizer for the GGUF, special ids set from the GGUF's own metadata."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for role in ("bos", "eos", "pad"):
        wanted = getattr(meta, f"{role}_token_id")
        if wanted is not None and getattr(tokenizer, f"{role}_token_id") != wanted:
            setattr(tokenizer, f"{role}_token", meta.tokens[wanted])  # e.g. bos / eos swapped
    if meta.chat_template is not None:
        tokenizer.chat_template = meta.chat_template
    return tokenizer


def _load_model(gguf_path: Path):
    """The GGUF model dequantized to float32 by transformers (a ``PreTrainedModel``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32)


def _write_weights(model, folder: Path) -> None:
    """``model.safetensors``: every tensor float32 and contiguous, the tied head left out."""
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {name: t.detach().to(torch.float32).contiguous()
             for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_config(model, tokenizer, folder: Path) -> None:
    """``config.json`` / ``generation_config.json`` as a float32 checkpoint's, not a GGUF's."""
    config = model.config.to_diff_dict()  # what differs from the class defaults, as saved
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    for role in ("bos", "eos", "pad"):
        config[f"{role}_token_id"] = getattr(tokenizer, f"{role}_token_id")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if tokenizer.pad_token_id is not None:
        generation["pad_token_id"] = tokenizer.pad_token_id
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _check_saved_tokenizer(folder: Path, meta: GgufTokenizerMeta, gguf_path: Path) -> None:
    """The saved tokenizer, reloaded as a user will load it: its special ids are the GGUF's and
    its chat template renders :data:`CHECK_CONVERSATION` as the GGUF's template does."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder)
    for role in ("bos", "eos"):
        wanted, got = getattr(meta, f"{role}_token_id"), getattr(saved, f"{role}_token_id")
        if wanted is not None and got != wanted:
            raise FileFormatError(f"{gguf_path}: the converted tokenizer's {role} id is {got}, "
                                  f"the GGUF says {wanted}")
    if meta.chat_template is None:
        return
    mine = saved.apply_chat_template(CHECK_CONVERSATION, tokenize=False,
                                     add_generation_prompt=True)
    theirs = saved.apply_chat_template(CHECK_CONVERSATION, tokenize=False,
                                       add_generation_prompt=True,
                                       chat_template=meta.chat_template)
    if mine != theirs:
        raise FileFormatError(f"{gguf_path}: the converted chat template renders differently "
                              f"from the GGUF's ({mine!r} against {theirs!r})")
