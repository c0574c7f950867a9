"""The training job, in the order ``python train.py`` runs it (``run``):

1. data: target directory (the embedded tiny target is built when none is given) -> dataset
   (shuffled, capped) -> optional regeneration of the answers by the target -> chat template +
   assistant-only loss masks + packing -> draft vocabulary (saved under ``<run_dir>/data``);
2. the frozen target's heads (``FrozenTarget``: embedding + LM head; the full model only when
   features are computed);
3. the objective (the method's registered class, built on those heads);
4. per training stage the objective lists (``Objective.stages``): that stage's rows -> the
   feature source for the objective's ``FeatureSpec`` (online: the frozen target runs inside each
   step; offline: a sharded safetensors cache computed once) -> the trainer (accelerate);
5. export: the deployment-format checkpoint at ``<run_dir>/final``;
6. evaluation: the acceptance harness on held-out prompts.

With several processes (``accelerate launch``) every rank runs this file; data preparation and
the tiny-target build happen on the main process first (the others then read the caches), the
offline feature cache is split across ranks, and export and evaluation run on the main process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import datasets

from infer.config import EvalEngine
from infer.foundation.atomic import atomic_dir, remove_leftovers
from infer.foundation.errors import check_writable
from infer.foundation.signals import raise_on_signals
from train.config import FeatureMode, TrainConfig
from train.data import load_source, pad_token_id, prepare_dataset
from train.features import FeatureSource, make_feature_source
from train.objectives.base import OBJECTIVES, Objective, Stage, StageData
from train.plan import RunPlan, check_offline_cache, run_plan
from train.real.targets import local_target
from train.frozen_target import FrozenTarget, resolve_sharding
from infer.models.foreign import target_config
from train.meter import PhaseClock
from train.served_eval import ServedEval
from train.tiny.examples import build_default_dataset
from train.vocab import DraftVocab, build_draft_vocab


@dataclass
class PreparedData:
    target_dir: str
    dataset: datasets.Dataset  # packed rows: input_ids, loss_mask, position_ids, doc_ids
    vocab: DraftVocab
    data_dir: Path
    raw: datasets.Dataset | None = None  # the examples before tokenization (for later stages)


@dataclass
class RunResult:
    final_dir: Path
    train: object  # train.trainer.TrainResult of the last stage
    report: object = None  # infer.eval.results.HarnessReport (None: eval off / not rank 0)


RESUME_NOTE = ("finished work is kept (regenerated chunks, feature-cache shards, checkpoints); "
               "rerun the same command to resume")


def run(cfg: TrainConfig) -> RunResult | RunPlan:
    """``python train.py``: every stage, then the acceptance report (see the module doc);
    with ``plan=true`` only the cost estimate (train/plan.py): nothing is loaded or written.

    The output folders are checked for writability first. SIGINT / SIGTERM raise
    ``infer.foundation.errors.Interrupted`` (exit 130 / 143 at the entry point): at once outside
    the
    training loop, where every phase resumes from what it finished (temporaries of writes in
    progress are removed as the exception unwinds), and after checkpointing the current step
    inside it (train/trainer.py)."""
    validate(cfg)
    if cfg.plan:
        return run_plan(cfg)
    check_outputs(cfg)
    with raise_on_signals(RESUME_NOTE):
        return _run(cfg)


def validate(cfg: TrainConfig) -> None:
    """Every configuration value before any work starts (a bad ``eval.ks`` used to surface after
    the whole training run): each key (``TrainConfig.validate``), the objective's name, an
    explicit ``trainer.resume`` checkpoint, and eval's chat-template variables against the
    data's; ``drafter.init_from`` / ``drafter.model`` exist. Later stages re-check what they
    are handed, through the same rules."""
    from infer.models.loader import resolve_model_dir
    from train.checkpoint import checkpoint_root, resolve_resume
    from train.evaluate import template_kwargs

    cfg.validate()
    OBJECTIVES.get(cfg.drafter.method)
    if cfg.trainer.resume not in ("auto", "never"):
        resolve_resume(cfg.trainer.resume, checkpoint_root(cfg.run_dir, "main"))
    for key, path in cfg.drafter.model_paths().items():
        if path:  # read after data preparation: check they exist now
            resolve_model_dir(path, key=key)
    template_kwargs(cfg)


def check_outputs(cfg: TrainConfig) -> None:
    """Every folder the run writes can be created and written, checked before any work starts
    (a permission error after hours of training would lose them)."""
    check_writable(cfg.run_dir, "output_dir")
    for key, value in (("features.cache_dir", cfg.features.cache_dir),
                       ("eval.output_dir", cfg.eval.output_dir)):
        if value:
            check_writable(value, key)


def _run(cfg: TrainConfig) -> RunResult:
    from accelerate import PartialState
    from accelerate.utils import set_seed

    from train.trainer import use_cpu

    state, clock = PartialState(cpu=use_cpu(cfg.trainer)), PhaseClock()
    set_seed(cfg.seed)
    with state.main_process_first():
        prepared = prepare_data(cfg, save=state.is_main_process)
    clock.lap("data (target, regeneration, tokenization)")
    print(f"target: {prepared.target_dir}\ndraft vocabulary: {prepared.vocab.draft_vocab_size} "
          f"tokens -> {prepared.data_dir}")
    sharding = resolve_sharding(cfg.target.sharding, state.num_processes)
    target = FrozenTarget(prepared.target_dir, cfg.target.dtype, state.device, sharding)
    if target.sharded and state.is_main_process:
        print(f"target sharded across {state.num_processes} ranks ({sharding.value})", flush=True)
    if state.is_main_process:
        print(f"target features through {target.backend}", flush=True)
    # Again: building the embedded target or regenerating answers draws from the global RNG
    # only when their caches are cold, and the drafter's initial weights must not depend on
    # that (measured: a cold and a warm `make demo` trained heads 6 % apart in acceptance).
    set_seed(cfg.seed)
    objective = OBJECTIVES.get(cfg.drafter.method)(cfg, target.heads, prepared.vocab,
                                                   prepared.target_dir)
    notes = objective.serving_notes()
    if notes and state.is_main_process:
        print(notes, flush=True)
    logger = _make_logger(cfg, state)
    served = ServedEval.from_config(cfg, objective, target)  # every rank joins its gather
    try:
        stages, step, result = objective.stages(), 0, None
        for i, stage in enumerate(stages):
            following = stages[i + 1] if i + 1 < len(stages) else None
            rows = stage_rows(cfg, stage, prepared, state)
            source = feature_source(cfg, target, objective, rows, stage, state)
            clock.lap("features")
            moments = result.optimizer_state if result and stage.carry_optimizer else None
            result = train_stage(cfg, objective, source, stage, prepared, logger,
                                 last=following is None, optimizer_state=moments,
                                 keep_optimizer_state=bool(following and following.carry_optimizer),
                                 served=served)
            step += result.step  # W&B steps must not go backwards
            clock.lap("training")
        export(objective, result, cfg.final_dir, state)
        clock.lap("export")
        report = None
        if cfg.eval.enabled and state.is_main_process and not _evaluable(cfg, target):
            print(f"evaluation skipped: draftsmith's engine does not run the target "
                  f"({target.gap}); eval.engine=vllm measures {cfg.final_dir} in vLLM "
                  "(docs/any-target.md)")
        elif cfg.eval.enabled and state.is_main_process:
            report = evaluate_drafter(cfg, prepared.target_dir, objective, logger, step)
            clock.lap("evaluation")
    finally:
        logger.finish()
    print(f"final drafter: {cfg.final_dir}\n{clock.summary()}")
    return RunResult(cfg.final_dir, result, report)


def _evaluable(cfg: TrainConfig, target: FrozenTarget) -> bool:
    """Whether the end-of-run harness can run: in draftsmith's engine when it runs the target,
    in vLLM (``eval.engine=vllm``) for any target vLLM serves."""
    return target.gap is None or cfg.eval.engine == EvalEngine.vllm


# ---- 1. data ---------------------------------------------------------------------------------

def resolve_target(cfg: TrainConfig) -> str:
    """The target directory: the configured one (a named target converted first), or the
    embedded tiny target (built if needed)."""
    if cfg.target.path:
        path = Path(local_target(cfg.target.path))
        if path.is_dir():
            return str(path)
        if path.is_absolute() or cfg.target.path.startswith("."):
            raise FileNotFoundError(f"target.path={cfg.target.path!r} is not a directory "
                                    "(a Hugging Face model directory is expected)")
        return download(cfg.target.path, "target.path")
    from train.tiny.build import ensure_tiny_target

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
    seed = cfg.seed if cfg.regenerate.seed is None else cfg.regenerate.seed
    return regenerate(raw, target_dir, cfg.regenerate, cfg.run_dir / name,
                      format=cfg.data.format, seed=seed, device=cfg.trainer.device,
                      template_kwargs=cfg.data.template_kwargs,
                      context=cfg.data.max_length + cfg.regenerate.max_tokens)


def prepare_data(cfg: TrainConfig, target_dir: str | None = None, save: bool = True
                 ) -> PreparedData:
    """Tokenized, loss-masked, packed training data plus its draft vocabulary, saved to disk
    (``save``: by the main process only; the other ranks rebuild the same from the caches)."""
    from infer.foundation.files import load_tokenizer

    target_dir = target_dir or resolve_target(cfg)
    tokenizer = load_tokenizer(target_dir, key="target.path")
    raw = load_examples(cfg)
    if cfg.regenerate.enabled:
        raw = regenerated(cfg, target_dir, raw, "regenerated")
    ds = tokenize(cfg, raw, tokenizer)
    vocab_size = target_config(target_dir).vocab_size
    vocab = build_draft_vocab(ds, vocab_size, cfg.drafter.draft_vocab(vocab_size))
    data_dir = cfg.run_dir / "data"
    if save:
        remove_leftovers(data_dir / "*")  # of killed writes; the main process alone writes here
        with atomic_dir(data_dir / "dataset") as tmp:
            ds.save_to_disk(str(tmp))
        vocab.save(data_dir)
    return PreparedData(target_dir, ds, vocab, data_dir, raw)


def tokenize(cfg: TrainConfig, raw: datasets.Dataset, tokenizer) -> datasets.Dataset:
    """Loss-masked packed rows (regenerated examples keep their source's format)."""
    d = cfg.data
    return prepare_dataset(raw, tokenizer, max_length=d.max_length, format=d.format,
                           pack=d.pack, num_proc=d.num_proc, seed=d.seed, shuffle=False,
                           template_kwargs=d.template_kwargs)


# ---- 4. stages -------------------------------------------------------------------------------

def stage_rows(cfg: TrainConfig, stage: Stage, prepared: PreparedData,
               state) -> datasets.Dataset:
    """The packed rows a stage trains on: the prepared data, or the same prompts answered by
    the target itself (regenerated under ``<run_dir>/<stage>_data``)."""
    if stage.data == StageData.dataset:
        return prepared.dataset
    from infer.foundation.files import load_tokenizer

    with state.main_process_first():
        raw = regenerated(cfg, prepared.target_dir, prepared.raw, f"{stage.name}_data")
        return tokenize(cfg, raw, load_tokenizer(prepared.target_dir, key="target.path"))


def feature_source(cfg: TrainConfig, target: FrozenTarget, objective: Objective,
                   rows: datasets.Dataset, stage: Stage, state) -> FeatureSource:
    """The stage's rows with the objective's target features. Offline, the cache of these
    exact rows must fit on its disk (checked before the first shard: train/plan.py), and the
    target model is in memory only while it is filled (training then needs only the heads)."""
    base = cfg.features.cache_dir or cfg.run_dir / "features"
    cache_dir = base if stage.name == "main" else f"{base}_{stage.name}"
    spec, f = objective.feature_spec(), cfg.features
    if f.mode == FeatureMode.offline and spec.needs_target and cfg.data.pack:
        check_offline_cache(cache_dir, len(rows), cfg.data.max_length, spec,
                            target_config(target.dir).hidden_size, f.dtype, f.rows_per_shard)
    source = make_feature_source(cfg.features, target, rows, spec, cache_dir,
                                 rank=state.process_index, world_size=state.num_processes,
                                 barrier=state.wait_for_everyone)
    if cfg.features.mode == FeatureMode.offline:
        target.release()
    return source


def train_stage(cfg: TrainConfig, objective: Objective, source: FeatureSource, stage: Stage,
                prepared: PreparedData, logger, last: bool,
                optimizer_state: dict | None = None, keep_optimizer_state: bool = False,
                served: ServedEval | None = None):
    """The trainer on one stage (its ``trainer`` overrides applied, from ``optimizer_state``
    when given; its own returned with ``keep_optimizer_state``, for a next stage that carries it
    over); the ``last`` stage also gathers the objective's state for the export; ``served``
    measures served acceptance every ``eval.every_steps``."""
    from infer.foundation.files import load_tokenizer

    from train.trainer import train

    stage_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                                     **stage.trainer))
    pad_id = pad_token_id(load_tokenizer(prepared.target_dir, key="target.path"))
    return train(stage_cfg, objective, source, pad_id=pad_id, run_dir=cfg.run_dir, logger=logger,
                 stage=stage.name, gather_state=last, optimizer_state=optimizer_state,
                 keep_optimizer_state=keep_optimizer_state, served=served)


# ---- 5. export, 6. evaluation ----------------------------------------------------------------

def export(objective: Objective, result, final_dir: Path, state) -> None:
    """The trained drafter in its deployment format at ``final_dir`` (main process, atomic)."""
    from train.checkpoint import export_atomically

    if state.is_main_process:
        export_atomically(objective, result.state_dict, final_dir)
    result.state_dict = None  # a full copy of the weights under FSDP / ZeRO-3: not kept
    state.wait_for_everyone()


def evaluate_drafter(cfg: TrainConfig, target_dir: str, objective: Objective, logger, step: int):
    """The exported drafter through the acceptance harness (train/evaluate.py)."""
    from train.evaluate import evaluate

    return evaluate(cfg, target_dir, objective.served_config(cfg.final_dir), logger,
                    step=step, device=cfg.trainer.device)


def _make_logger(cfg: TrainConfig, state):
    from infer.foundation.tracking import make_logger

    return make_logger(cfg.logger.kind, rank=state.process_index, project=cfg.logger.project,
                       name=cfg.logger.run_name or cfg.name, config=dataclasses.asdict(cfg),
                       dir=cfg.run_dir, mode=cfg.logger.mode, job_type="train")
