"""The training job's stages, in the order ``python train.py`` runs them.

target (the embedded tiny target is built when none is given) -> dataset (shuffled, capped)
-> optional regeneration of the answers by the target -> chat template + assistant-only loss
masks + packing -> draft vocabulary (both saved under ``<run_dir>/data``) -> objective (the
method's registered class) -> target features (online: the frozen target runs inside each step;
offline: a sharded safetensors cache computed once) -> trainer (accelerate) -> deployment-format
checkpoint at ``<run_dir>/final`` -> acceptance harness on held-out prompts.

With several processes (``accelerate launch``) every rank runs this file; data preparation and
the tiny-target build happen on the main process first (the others then read the caches), the
offline feature cache is split across ranks, and the evaluation runs on the main process.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets

from infer.models.loader import load_config
from train.config import TrainConfig
from train.data import build_default_dataset, load_source, pad_token_id, prepare_dataset
from train.vocab import DraftVocab, build_draft_vocab


@dataclass
class PreparedData:
    target_dir: str
    dataset: datasets.Dataset  # packed rows: input_ids, loss_mask, position_ids, doc_ids
    vocab: DraftVocab
    data_dir: Path
    raw: datasets.Dataset | None = None  # the examples before tokenization (for stage 2)


def resolve_target(cfg: TrainConfig) -> str:
    """The target directory: the configured one, or the embedded tiny target (built if needed)."""
    if cfg.target.path:
        path = Path(cfg.target.path)
        if path.is_dir():
            return str(path)
        if path.is_absolute() or cfg.target.path.startswith("."):
            raise FileNotFoundError(f"target.path={cfg.target.path!r} is not a directory "
                                    "(a Hugging Face model directory is expected)")
        return download(cfg.target.path, "target.path")
    from train.tiny_target_build import ensure_tiny_target

    return str(ensure_tiny_target())


def download(repo_id: str, key: str) -> str:
    """A hub model id -> its local snapshot (downloaded unless cached or ``HF_HUB_OFFLINE``)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                          "*.txt", "*.jinja"])
    except Exception as err:  # offline and not cached, gated, typo ...
        raise FileNotFoundError(f"{key}={repo_id!r}: not a local directory and the hub download "
                                f"failed ({type(err).__name__}: {err})") from None


def load_examples(cfg: TrainConfig) -> datasets.Dataset:
    """The raw examples: ``data.source`` (or the embedded default), shuffled, first N."""
    d = cfg.data
    if d.source is None:
        return build_default_dataset(d.num_examples, seed=d.seed)
    ds = load_source(d.source, d.split).shuffle(seed=d.seed)
    return ds.select(range(min(d.num_examples, len(ds))))


def regenerated(cfg: TrainConfig, target_dir: str, raw: datasets.Dataset, name: str
                ) -> datasets.Dataset:
    """``raw`` with its answers rewritten by the target (resumable, under ``<run_dir>/name``)."""
    from train.regenerate import regenerate

    n = cfg.regenerate.num_examples
    if n is not None:
        raw = raw.select(range(min(n, len(raw))))
    return regenerate(raw, target_dir, cfg.regenerate, cfg.run_dir / name,
                      format=cfg.data.format, seed=cfg.seed,
                      device=cfg.trainer.device)


def prepare_data(cfg: TrainConfig, target_dir: str | None = None, save: bool = True
                 ) -> PreparedData:
    """Tokenized, loss-masked, packed training data plus its draft vocabulary, saved to disk
    (``save``: by the main process only; the other ranks rebuild the same from the caches)."""
    from transformers import AutoTokenizer

    target_dir = target_dir or resolve_target(cfg)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    raw = load_examples(cfg)
    if cfg.regenerate.enabled:
        raw = regenerated(cfg, target_dir, raw, "regenerated")
    ds = tokenize(cfg, raw, tokenizer)
    vocab_size = load_config(target_dir).vocab_size
    vocab = build_draft_vocab(ds, vocab_size, min(cfg.drafter.draft_vocab_size, vocab_size))
    data_dir = cfg.run_dir / "data"
    if save:
        _save_dataset_atomically(ds, data_dir / "dataset")
        vocab.save(data_dir)
    return PreparedData(target_dir, ds, vocab, data_dir, raw)


def tokenize(cfg: TrainConfig, raw: datasets.Dataset, tokenizer) -> datasets.Dataset:
    """Loss-masked packed rows (regenerated examples keep their source's format)."""
    d = cfg.data
    return prepare_dataset(raw, tokenizer, max_length=d.max_length, format=d.format,
                           pack=d.pack, num_proc=d.num_proc, seed=d.seed, shuffle=False)


def _save_dataset_atomically(ds: datasets.Dataset, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


# ---- the whole job ---------------------------------------------------------------------------

def build_objective(cfg: TrainConfig, prepared: PreparedData, state):
    """The method's objective and its feature source (online target or offline cache).

    The heads are loaded first (the objective is built on them), then the objective tells which
    features it needs (``train.features.make_feature_source`` takes the spec as a callable).
    """
    from train.objectives.base import get_objective

    cls = get_objective(cfg.drafter.method)
    built = []

    def spec(heads):
        built.append(cls(cfg, heads, prepared.vocab, prepared.target_dir))
        return built[0].feature_spec()

    source = feature_source(cfg, prepared, state, spec)
    return built[0], source


def feature_source(cfg: TrainConfig, prepared: PreparedData, state, spec):
    from train.features import make_feature_source

    return make_feature_source(cfg, prepared.target_dir, prepared.dataset, spec,
                               device=state.device, rank=state.process_index,
                               world_size=state.num_processes, barrier=state.wait_for_everyone)


def stage2(cfg: TrainConfig, prepared: PreparedData, state) -> PreparedData:
    """Stage-2 data: the same prompts, answered by the target itself (MLP speculator recipe)."""
    from transformers import AutoTokenizer

    with state.main_process_first():
        raw = regenerated(cfg, prepared.target_dir, prepared.raw, "stage2_data")
        ds = tokenize(cfg, raw, AutoTokenizer.from_pretrained(prepared.target_dir))
    return dataclasses.replace(prepared, dataset=ds, raw=raw)


@dataclass
class RunResult:
    final_dir: Path
    train: object  # train.trainer.TrainResult of the last stage
    report: object = None  # infer.harness.HarnessReport (None when eval is off / not rank 0)


def run(cfg: TrainConfig) -> RunResult:
    """``python train.py``: every stage, then the acceptance report."""
    from accelerate import PartialState
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    from infer.tracking import make_logger
    from train.evaluate import evaluate
    from train.trainer import train, use_cpu

    state = PartialState(cpu=use_cpu(cfg.trainer))
    set_seed(cfg.seed)
    with state.main_process_first():
        target_dir = resolve_target(cfg)
        prepared = prepare_data(cfg, target_dir, save=state.is_main_process)
    print(f"target: {target_dir}\ndraft vocabulary: {prepared.vocab.draft_vocab_size} tokens "
          f"-> {prepared.data_dir}")
    pad_id = pad_token_id(AutoTokenizer.from_pretrained(target_dir))
    objective, feats = build_objective(cfg, prepared, state)
    logger = make_logger(cfg.logger.kind, rank=state.process_index, project=cfg.logger.project,
                         name=cfg.logger.run_name or cfg.name, config=dataclasses.asdict(cfg),
                         dir=cfg.run_dir, mode=cfg.logger.mode, job_type="train")
    two_stage = cfg.objective.stage2_steps > 0
    try:
        result = train(cfg, objective, feats.rows, feats.add_features, pad_id=pad_id,
                       run_dir=cfg.run_dir, final_dir=None if two_stage else cfg.final_dir,
                       logger=logger)
        step = result.step
        if two_stage:
            cfg2 = dataclasses.replace(
                cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=cfg.objective.stage2_steps,
                                                 warmup_steps=0, warmup_ratio=0.0),
                features=dataclasses.replace(cfg.features, cache_dir=(
                    f"{cfg.features.cache_dir or cfg.run_dir / 'features'}_stage2")))
            feats = feature_source(cfg2, stage2(cfg, prepared, state), state,
                                   objective.feature_spec())
            result = train(cfg2, objective, feats.rows, feats.add_features, pad_id=pad_id,
                           run_dir=cfg.run_dir, final_dir=cfg.final_dir, logger=logger,
                           stage="stage2")
            step += result.step  # W&B steps must not go backwards
        report = None
        if cfg.eval.enabled and state.is_main_process:
            k = max(cfg.eval.ks)
            report = evaluate(cfg, target_dir, objective.speculative_config(cfg.final_dir, k),
                              logger, step=step, device=cfg.trainer.device)
    finally:
        logger.finish()
    print(f"final drafter: {cfg.final_dir}")
    return RunResult(cfg.final_dir, result, report)
