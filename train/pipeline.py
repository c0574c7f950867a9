"""The training job's stages, in the order ``python train.py`` runs them.

Today: resolve the target (building the embedded tiny target when none is given), build or load
the dataset, apply the chat template with assistant-only loss masks, pack, and derive the draft
vocabulary; both are saved under ``<output_dir>/<recipe>/data``. Drafter training, the features
cache and export are added as their stages land.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets

from infer.models.loader import load_config
from train.config import TrainConfig
from train.data import build_default_dataset, prepare_dataset
from train.vocab import DraftVocab, build_draft_vocab


@dataclass
class PreparedData:
    target_dir: str
    dataset: datasets.Dataset  # packed rows: input_ids, loss_mask, position_ids, doc_ids
    vocab: DraftVocab
    data_dir: Path


def resolve_target(cfg: TrainConfig) -> str:
    """The target directory: the configured one, or the embedded tiny target (built if needed)."""
    if cfg.target.path:
        if not Path(cfg.target.path).is_dir():
            raise FileNotFoundError(f"target.path={cfg.target.path!r} is not a directory "
                                    "(a Hugging Face model directory is expected)")
        return cfg.target.path
    from train.tiny_target_build import ensure_tiny_target

    return str(ensure_tiny_target())


def prepare_data(cfg: TrainConfig) -> PreparedData:
    """Tokenized, loss-masked, packed training data plus its draft vocabulary, saved to disk."""
    from transformers import AutoTokenizer

    target_dir = resolve_target(cfg)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    d = cfg.data
    source = d.source or build_default_dataset(d.num_examples, seed=d.seed)
    ds = prepare_dataset(source, tokenizer, max_length=d.max_length, format=d.format,
                         split=d.split, pack=d.pack, num_proc=d.num_proc, seed=d.seed,
                         max_examples=d.num_examples)
    vocab_size = load_config(target_dir).vocab_size
    vocab = build_draft_vocab(ds, vocab_size, min(cfg.drafter.draft_vocab_size, vocab_size))
    data_dir = Path(cfg.output_dir) / cfg.name / "data"
    _save_dataset_atomically(ds, data_dir / "dataset")
    vocab.save(data_dir)
    return PreparedData(target_dir, ds, vocab, data_dir)


def _save_dataset_atomically(ds: datasets.Dataset, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def run(cfg: TrainConfig) -> PreparedData:
    prepared = prepare_data(cfg)
    covered = float(prepared.vocab.counts[prepared.vocab.target_ids()].sum()
                    / max(prepared.vocab.counts.sum(), 1))
    print(f"target: {prepared.target_dir}")
    print(f"data: {len(prepared.dataset)} packed rows -> {prepared.data_dir / 'dataset'}")
    print(f"draft vocabulary: {len(prepared.vocab.d2t)} tokens covering {covered:.1%} of the "
          f"loss tokens -> {prepared.data_dir}")
    print("drafter training (EAGLE-3 objective, trainer, export) is not implemented yet; "
          "this run prepared its data.")
    return prepared
