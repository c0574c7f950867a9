"""Build, cache and validate the embedded default target and its small draft LM.

``ensure_tiny_target()`` returns the cached target directory, building it only when it is missing,
corrupt or was built with other settings; ``ensure_tiny_draft()`` does the same for the draft LM
(same tokenizer, same data, smaller and shorter). Both are normal Hugging Face model directories::

    config.json  model.safetensors  generation_config.json      LlamaForCausalLM, fp32
    tokenizer.json  tokenizer_config.json                       chat template, eos <|end|>
    draftsmith_meta.json                                        split, seed, tokens, loss ...

A build trains the byte-level BPE tokenizer on the train split, packs raw code and chat-formatted
prefix -> continuation examples into fixed-length rows, and trains each LM for a fixed number of
steps (AdamW, warmup + cosine) in a seeded order, then the target a short unlikelihood phase
against greedy loops (``train/tiny/unlikelihood.py``), so it is deterministic for a given machine
and torch thread count (one per free core, recorded in the meta); a wall-clock cap only stops a
build on a machine far slower than planned, and the meta says so.
Outputs are written to a temporary directory beside the destination and moved into place with
``os.replace``: an interrupted build never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from filelock import FileLock
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infer.foundation.atomic import atomic_dir, remove_leftovers
from infer.foundation.threads import GOVERNOR
from train.tiny.corpus import (DOC_TOKEN, EOS_TOKEN, TinyData, capped_corpus,
                               default_target_dir, paired_draft_dir, prepare_data, read_texts,
                               stdlib_root, train_tokenizer)
from train.tiny import quality, unlikelihood
from train.tiny.unlikelihood import UnlikelihoodSpec
from train.tiny.lm import (MAX_POSITIONS, TinyLMSpec, greedy_continuation, heldout_loss,
                           make_model, train_lm, utf8_bytes)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: corpus without codec tables, pydoc data, Tk; 8-layer target
META_FILE = "draftsmith_meta.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES,
                  META_FILE)


# Tuned on 2 CPU cores (AMD EPYC), docs/benchmarks-history.md "The rebuilt embedded target": 8 narrow layers
# learn more per second than 4 wide ones (8,200 training tokens/s with two threads), reach a
# held-out cross-entropy under 0.6x the unigram model's at 2,400 steps of 4 x 256 tokens (lr
# 4e-3; 3e-3 and 1,800 steps stop at 0.61), and the unlikelihood phase removes most greedy loops.
# Its continuations are generated 25 steps' worth at a time (100 rows per ``generate``: ~50 s
# instead of ~115 s, as effective; docs/benchmarks-history.md, ninth session). ~8 min for the target
# with two threads on an idle machine.
TARGET_SPEC = TinyLMSpec(hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2,
                         intermediate_size=352, steps=2400, lr=4e-3, max_seconds=900.0,
                         unlikelihood=UnlikelihoodSpec(steps=150, generate_every=25))
DRAFT_SPEC = TinyLMSpec(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                        intermediate_size=384, steps=600, max_seconds=150.0)


@dataclass(frozen=True)
class TinyBuildConfig:
    """Everything that determines a build. Recorded in the meta; a cached build whose recorded
    config differs from the requested one is rebuilt."""

    seed: int = 0
    corpus_root: str | None = None  # None: the running interpreter's standard library
    heldout_fraction: float = 0.1
    max_files: int | None = None  # cap on train files (held-out files scaled alike); None: all
    vocab_size: int = 4096
    seq_len: int = 256  # training context; the model itself takes MAX_POSITIONS
    chat_fraction: float = 0.35  # share of training characters in chat-template form
    eval_rows: int = 128  # fixed held-out sample: rows of seq_len tokens
    sample_tokens: int = 64  # length of the greedy sample recorded in the meta
    target: TinyLMSpec = TARGET_SPEC
    draft: TinyLMSpec = DRAFT_SPEC


def _resolve(config: TinyBuildConfig | None, overrides: dict) -> TinyBuildConfig:
    return dataclasses.replace(config or TinyBuildConfig(), **overrides)


def _fingerprint(cfg: TinyBuildConfig, kind: str) -> dict:
    """The part of ``cfg`` a ``kind`` build depends on, as it reads back from JSON."""
    d = dataclasses.asdict(cfg)
    d.pop("draft" if kind == "target" else "target")
    return json.loads(json.dumps(d))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def corpus_split(cfg: TinyBuildConfig) -> tuple[Path, list[str], list[str]]:
    """Root and (train, held-out) relative files of a build."""
    root = Path(cfg.corpus_root) if cfg.corpus_root else stdlib_root()
    return (root, *capped_corpus(root, cfg.seed, cfg.heldout_fraction, cfg.max_files))


def _data_args(cfg: TinyBuildConfig) -> dict:
    return {"seed": cfg.seed, "chat_fraction": cfg.chat_fraction, "seq_len": cfg.seq_len,
            "eval_rows": cfg.eval_rows}


# ----------------------------------------------------------------------------- saving, checking

def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json with the chat template inline (older transformers
    and vLLM read it there; they also know ``PreTrainedTokenizerFast`` by that name)."""
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(out, save_jinja_files=False)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in cfg and "additional_special_tokens" not in cfg:
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def check_tiny_build(path: str | os.PathLike, kind: str = "target",
                     config: TinyBuildConfig | None = None, *,
                     target_dir: str | os.PathLike | None = None) -> str | None:
    """Why the ``kind`` ("target" / "draft") build at ``path`` cannot be used; None if it can.

    Checks the files, the meta's format version, kind and (with ``config``) build settings, that
    the weights and tokenizer load, and for a draft that it shares ``target_dir``'s tokenizer.
    """
    path = Path(path)
    if not path.is_dir():
        return "missing"
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        meta = json.loads((path / META_FILE).read_text())
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable json: {e}"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
    if meta.get("kind") != kind:
        return f"kind {meta.get('kind')!r}, expected {kind!r}"
    if config is not None and meta.get("build_config") != _fingerprint(config, kind):
        return "built with other settings"
    try:
        if not load_file(path / "model.safetensors"):
            return "model.safetensors holds no tensors"
        Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any failure to load means rebuild
        return f"does not load: {type(e).__name__}: {e}"
    sha = _sha256(path / "tokenizer.json")
    if meta.get("tokenizer", {}).get("sha256") != sha:
        return "tokenizer.json differs from the one recorded in the meta"
    if target_dir is not None and (Path(target_dir) / "tokenizer.json").is_file() \
            and _sha256(Path(target_dir) / "tokenizer.json") != sha:
        return "tokenizer differs from the target's"
    return None


def load_meta(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


# ----------------------------------------------------------------------------- building

@contextlib.contextmanager
def _torch_threads(n: int | None):
    """The build's torch threads: ``n``, or the thread policy (one per core other processes
    leave free, re-checked while training: infer/foundation/threads.py). On 2 cores beside one
    busy process
    two spin-waiting threads made a target step 0.8-1.8 s against ~0.4 s with one, while alone
    two threads train 1.65x faster than one."""
    before = GOVERNOR.fixed
    GOVERNOR.start(n)
    try:
        yield
    finally:
        GOVERNOR.start(before)


def _train(model, spec: TinyLMSpec, seed: int, data: TinyData, *, progress: bool,
           desc: str) -> dict:
    """Next-token training, then the unlikelihood phase if the spec has one; stats for the meta."""
    stats = train_lm(model, data.train_rows, spec, seed, progress=progress, desc=desc)
    if spec.unlikelihood.steps:
        stats["unlikelihood"] = unlikelihood.finetune(
            model, data.train_rows, spec.unlikelihood, seed, progress=progress,
            desc=f"{desc} (unlikelihood)")
    return stats


def _build_one(kind: str, dest: Path, spec: TinyLMSpec, cfg: TinyBuildConfig,
               tokenizer: PreTrainedTokenizerBase, data: TinyData, *, progress: bool,
               tokenizer_from: Path | None = None) -> dict:
    """Train one LM on ``data`` and write it to ``dest``; returns its meta."""
    t0 = time.monotonic()
    model = make_model(spec, tokenizer, cfg.seed)
    stats = _train(model, spec, cfg.seed, data, progress=progress, desc=f"tiny {kind}")
    loss = heldout_loss(model, data.eval_rows)
    sample = greedy_continuation(model, tokenizer, data.sample_prompt, cfg.sample_tokens)
    chat_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": data.sample_prompt.rstrip("\n")}], tokenize=False,
        add_generation_prompt=True)
    chat_sample = greedy_continuation(model, tokenizer, chat_prompt, cfg.sample_tokens)
    mc = model.config
    meta = {
        "format_version": FORMAT_VERSION, "kind": kind, "seed": cfg.seed,
        "build_config": _fingerprint(cfg, kind),
        "corpus": {"root": str(data.root), "python": platform.python_version(),
                   "heldout_fraction": cfg.heldout_fraction, "train_files": data.train_files,
                   "heldout_files": data.heldout_files, "train_rows": len(data.train_rows)},
        "model": {"architecture": "LlamaForCausalLM", "hidden_size": mc.hidden_size,
                  "num_hidden_layers": mc.num_hidden_layers,
                  "num_attention_heads": mc.num_attention_heads,
                  "num_key_value_heads": mc.num_key_value_heads,
                  "intermediate_size": mc.intermediate_size, "vocab_size": mc.vocab_size,
                  "max_position_embeddings": mc.max_position_embeddings,
                  "num_parameters": sum(p.numel() for p in model.parameters())},
        "tokenizer": {"vocab_size": len(tokenizer), "eos_token": EOS_TOKEN,
                      "pad_token": DOC_TOKEN},
        "training": stats, "tokens_seen": stats["tokens_seen"],
        "heldout_loss": round(loss, 5), "heldout_tokens": data.eval_rows[:, 1:].numel(),
        **quality.measure(model, loss, data.train_rows, data.eval_rows),
        # tokenizer-independent: the same total loss per UTF-8 byte of the predicted text, in bits
        "heldout_bits_per_byte": round(loss * data.eval_rows[:, 1:].numel() / math.log(2)
                                       / utf8_bytes(tokenizer, data.eval_rows[:, 1:]), 5),
        "sample": {"prompt": data.sample_prompt, "completion": sample},
        "chat_sample": {"prompt": chat_prompt, "completion": chat_sample},
        "data_prep_seconds": round(data.seconds, 2),
        "build_seconds": round(time.monotonic() - t0 + (data.seconds if kind == "target" else 0),
                               2),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }

    with atomic_dir(dest) as tmp:  # a cache is shared like any download: normal permissions
        model.save_pretrained(tmp)  # config.json, generation_config.json, model.safetensors
        if tokenizer_from is None:
            _save_tokenizer(tokenizer, tmp)
        else:  # byte-identical to the target's
            for name in TOKENIZER_FILES:
                shutil.copy2(tokenizer_from / name, tmp / name)
        meta["tokenizer"]["sha256"] = _sha256(tmp / "tokenizer.json")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("tiny %s: held-out loss %.4f after %d steps (%d tokens) -> %s", kind, loss,
             stats["steps"], stats["tokens_seen"], dest)
    return meta


def build_tiny_target(out_dir: str | os.PathLike | None = None, *,
                      draft_dir: str | os.PathLike | None = None, with_draft: bool = True,
                      config: TinyBuildConfig | None = None, progress: bool = True,
                      num_threads: int | None = None, **overrides) -> Path:
    """Build the tiny target (and, with ``with_draft``, the draft LM) from scratch.

    ``overrides`` replace fields of ``config`` (e.g. ``seed=1, max_files=10``). Does not lock the
    destination; ``ensure_tiny_target`` does. Returns the target directory.
    """
    cfg = _resolve(config, overrides)
    target = Path(out_dir) if out_dir is not None else default_target_dir()
    with _torch_threads(num_threads):
        t0 = time.monotonic()
        root, train_files, held_files = corpus_split(cfg)
        train_texts = read_texts(root, train_files)
        tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
        data = prepare_data(tokenizer, root, train_files, held_files, train_texts=train_texts,
                            **_data_args(cfg))
        data.seconds = time.monotonic() - t0  # tokenizer training included
        _build_one("target", target, cfg.target, cfg, tokenizer, data, progress=progress)
        if with_draft:
            draft = Path(draft_dir) if draft_dir is not None else paired_draft_dir(target)
            _build_one("draft", draft, cfg.draft, cfg, tokenizer, data, progress=progress,
                       tokenizer_from=target)
    return target


def build_tiny_draft(out_dir: str | os.PathLike | None = None, *,
                     target_dir: str | os.PathLike | None = None,
                     config: TinyBuildConfig | None = None, progress: bool = True,
                     num_threads: int | None = None, **overrides) -> Path:
    """Build the draft LM alone, with the tokenizer and file split of an existing target."""
    cfg = _resolve(config, overrides)
    target = Path(target_dir) if target_dir is not None else default_target_dir()
    draft = Path(out_dir) if out_dir is not None else paired_draft_dir(target)
    corpus = load_meta(target)["corpus"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    with _torch_threads(num_threads):
        data = prepare_data(tokenizer, Path(corpus["root"]), corpus["train_files"],
                            corpus["heldout_files"], **_data_args(cfg))
        _build_one("draft", draft, cfg.draft, cfg, tokenizer, data, progress=progress,
                   tokenizer_from=target)
    return draft


@contextlib.contextmanager
def _locked(dest: Path):
    """Serialise builders of ``dest`` across processes; clears leftovers of killed builds."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        remove_leftovers(dest)
        yield


def ensure_tiny_target(out_dir: str | os.PathLike | None = None, *, with_draft: bool = True,
                       draft_dir: str | os.PathLike | None = None, force: bool = False,
                       config: TinyBuildConfig | None = None, progress: bool = True,
                       num_threads: int | None = None, **overrides) -> Path:
    """The cached tiny target directory, built first if missing, corrupt or built otherwise.

    With ``with_draft`` (the default) the draft LM at ``draft_dir`` is ensured too, so callers may
    rely on ``paired_draft_dir(target)``. ``force`` rebuilds regardless. ``num_threads``: torch
    threads while building (default: the thread policy of infer/foundation/threads.py). Default
    locations:
    ``<cache>/tiny-target`` and ``<cache>/tiny-draft`` (see ``default_cache_dir``).
    """
    cfg = _resolve(config, overrides)
    target = Path(out_dir) if out_dir is not None else default_target_dir()
    draft = Path(draft_dir) if draft_dir is not None else paired_draft_dir(target)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_locked(target))  # always target before draft: no deadlock
        if with_draft:
            stack.enter_context(_locked(draft))
        reason = "forced" if force else check_tiny_build(target, "target", cfg)
        if reason:
            log.info("building the tiny target in %s (%s)", target, reason)
            build_tiny_target(target, draft_dir=draft, with_draft=with_draft, config=cfg,
                              progress=progress, num_threads=num_threads)
        elif with_draft:
            reason = check_tiny_build(draft, "draft", cfg, target_dir=target)
            if reason:
                log.info("building the tiny draft in %s (%s)", draft, reason)
                build_tiny_draft(draft, target_dir=target, config=cfg, progress=progress,
                                 num_threads=num_threads)
    return target


def ensure_tiny_draft(out_dir: str | os.PathLike | None = None, *,
                      target_dir: str | os.PathLike | None = None, force: bool = False,
                      config: TinyBuildConfig | None = None, progress: bool = True,
                      num_threads: int | None = None, **overrides) -> Path:
    """The cached draft LM directory (its target ensured first, since they share a tokenizer)."""
    target = Path(target_dir) if target_dir is not None else default_target_dir()
    draft = Path(out_dir) if out_dir is not None else paired_draft_dir(target)
    ensure_tiny_target(target, with_draft=True, draft_dir=draft, force=force, config=config,
                       progress=progress, num_threads=num_threads, **overrides)
    return draft
