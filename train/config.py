"""Typed training configuration, registered in Hydra's ConfigStore.

YAML in ``conf/`` and ``recipes/`` only states values; the schema lives here, so a misspelt key
fails at compose time with the key named (Hydra's structured-config check) instead of being
silently ignored, and a field with a fixed set of values (a ``StrChoice`` enum) rejects any other
value with the allowed ones listed. Every field carries an attribute docstring: ``python train.py
--help`` prints them all (``infer/config_docs.py``). Every recipe file ``recipes/NAME.yaml`` is
registered into the ``recipe`` group at import (``register_configs``), so ``python train.py
recipe=NAME`` selects it and an unknown name makes Hydra list the available ones. The recipe's
name is written into ``name`` (the output folder ``<output_dir>/<name>``), so recipe files state
deltas only. The ``drafter`` and ``objective`` sections are the chosen method's own dataclasses
(``train/methods/``), options of the ``drafter`` / ``objective`` groups; each field declares its
rule and whether a resumed run must match it beside it (``setting(default, rule, resume=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from infer.config import Dtype, EvalConfig, EvalEngine, LoggerKind
from infer.config_docs import register_help_resolver, schema_help
from infer.foundation.validation import (check_bool, check_choice, check_fields, check_float,
                                         check_int, check_section, check_str, config_error,
                                         setting)
from train.choices import (DataFormat, Device, FeatureMode, Optimizer, Precision, Schedule,
                           StorageDtype, TargetSharding, WandbMode)
from train.methods.base import METHODS, DrafterConfig, ObjectiveConfig, keys_of
from train.methods.eagle3 import Eagle3DrafterConfig, Eagle3ObjectiveConfig

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "tiny_eagle3"


# ---- rules the fields name (setting(default, rule)), called as rule(key, value, where=...) ----

WHERE = "train config"


def validate_section(name: str, section) -> None:
    """One section by its fields' rules (``validate_section("trainer", cfg.trainer)``), for code
    handed only a section or a stage's modified copy of it (the trainer, ``regenerate``,
    objectives)."""
    check_fields(section, name, WHERE)


def _check_betas(key: str, value, where: str) -> None:
    if (isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                       for b in value)):
        raise config_error(key, list(value) if hasattr(value, "__iter__") else value,
                           "two numbers in [0, 1)", where)


def _check_device(key: str, value, where: str) -> None:
    if check_choice(key, value, Device, where) == Device.cuda:
        import torch

        if not torch.cuda.is_available():
            raise config_error(key, value, "auto or cpu (no CUDA device is visible)", where)


def _eval(key: str, value, where: str) -> None:
    value.validate(where)


def _choice(choices, optional: bool = False):
    return partial(check_choice, choices=choices, optional=optional)


_opt_str, _flag = partial(check_str, optional=True), check_bool
_pos, _nonneg = partial(check_int, minimum=1), partial(check_int, minimum=0)
_opt_pos, _opt_nonneg = (partial(check_int, minimum=m, optional=True) for m in (1, 0))
_weight, _fraction = partial(check_float, low=0.0), partial(check_float, low=0.0, high=1.0)
_positive = partial(check_float, low=0.0, low_open=True)
_share = partial(check_float, low=0.0, high=1.0, low_open=True)  # (0, 1]
_seed = partial(check_int, minimum=0, maximum=2**32 - 1)  # numpy's range (set_seed, shuffles)

@dataclass
class TargetConfig:
    """The frozen target."""

    path: Optional[str] = setting(None, _opt_str, resume=True)
    """HF model directory, hub id or smollm2 (train/real/); None: the embedded tiny target."""
    dtype: Dtype = setting(Dtype.auto, _choice(Dtype), resume=True)
    """auto: bfloat16 on GPU, float32 on CPU."""
    sharding: TargetSharding = setting(TargetSharding.auto, _choice(TargetSharding), resume=True)
    """How the frozen target is spread over the ranks of a multi-process run, for the target
    forwards of online features and of the offline cache build: none = every rank holds it
    whole; fsdp = FSDP2 (each decoder layer a unit, all-gathered for its forward); zero3 =
    DeepSpeed ZeRO-3 (needs deepspeed). auto = as the accelerate config shards the drafter:
    fsdp under an FSDP config, zero3 under DeepSpeed ZeRO stage 3, else none. One process: none
    (docs/scale-out.md)."""


@dataclass
class DataConfig:
    """Training data."""

    source: Optional[str] = setting(None, _opt_str, resume=True)
    """File, folder, save_to_disk folder or hub id; None: the embedded default (stdlib code)."""
    format: Optional[DataFormat] = setting(None, _choice(DataFormat, True), resume=True)
    """Column layout; None: detected from the columns."""
    split: str = setting("train", check_str, resume=True)
    """Split of a folder or hub dataset."""
    max_length: int = setting(512, partial(check_int, minimum=2), resume=True)
    """Tokens per packed row (and the cap on one example)."""
    num_examples: int = setting(2000, _pos, resume=True)
    """Size of the embedded default dataset / cap on other sources."""
    num_proc: int = setting(1, _pos)
    """Tokenizer worker processes."""
    seed: int = setting(0, _seed, resume=True)
    """Shuffle seed."""
    pack: bool = setting(True, _flag, resume=True)
    """Pack examples into rows of max_length (documents never attend across each other)."""
    enable_thinking: Optional[bool] = setting(None, partial(check_bool, optional=True), resume=True)
    """Thinking models (Qwen3): the chat template's enable_thinking, passed alike to the
    regeneration prompts, the training renders and the evaluation prompts; None: the template's
    default."""

    @property
    def template_kwargs(self) -> dict:
        """Variables for the chat template (vLLM's ``chat_template_kwargs``)."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


@dataclass
class RegenerateConfig:
    """Self-distillation: the target rewrites the answers with the engine (train/regenerate.py)."""

    enabled: bool = setting(False, _flag, resume=True)
    """Rewrite every assistant answer with the target before training."""
    temperature: float = setting(0.0, _weight, resume=True)
    """Sampling temperature of the rewrite (0: greedy)."""
    top_p: float = setting(1.0, _share, resume=True)
    """Nucleus sampling of the rewrite."""
    max_tokens: int = setting(256, _pos, resume=True)
    """Tokens per answer."""
    batch_size: int = setting(8, _pos, resume=True)
    """Requests decoded together (the engine's max_num_seqs). Sampled answers depend on it, so
    a sampled regeneration resumes only with the same value; greedy answers do not."""
    max_model_len: Optional[int] = setting(None, partial(check_int, minimum=2,
                                                                optional=True), resume=True)
    """Context length of the rewrite; None: data.max_length + max_tokens (within the target's)."""
    num_examples: Optional[int] = setting(None, _opt_pos, resume=True)
    """Regenerate only the first N examples; None: all."""
    engine: EvalEngine = setting(EvalEngine.draftsmith, _choice(EvalEngine), resume=True)
    """draftsmith: this engine; vllm: one vLLM kept up for the whole rewrite (targets beyond one
    device: tensor_parallel_size; infer/eval/vllm_engine.py's VllmSession)."""
    vllm_python: Optional[str] = setting(None, _opt_str, resume=True)
    """engine=vllm: the Python of an environment with vLLM; None: vLLM importable here."""
    tensor_parallel_size: int = setting(1, _pos, resume=True)
    """engine=vllm: GPUs the target is split across."""
    seed: Optional[int] = setting(None, partial(_seed, optional=True), resume=True)
    """Seed of the sampled rewrite; None: the run's ``seed``. Set it to train several seeds on
    one regenerated set (the answers are keyed by it, so a run with another ``seed`` and the
    same ``regenerate.seed`` reuses them instead of regenerating)."""


@dataclass
class FeaturesConfig:
    """Target features: computed inside each training step, or cached once."""

    mode: FeatureMode = setting(FeatureMode.online, _choice(FeatureMode), resume=True)
    """online: the frozen target runs in each step; offline: a resumable safetensors cache."""
    cache_dir: Optional[str] = setting(None, _opt_str)
    """Offline cache folder; None: <run_dir>/features."""
    dtype: StorageDtype = setting(StorageDtype.bfloat16, _choice(StorageDtype), resume=True)
    """Storage dtype of the offline cache."""
    rows_per_shard: int = setting(256, _pos)
    """Packed rows per cache shard."""
    batch_size: int = setting(4, _pos)
    """Target forward batch while filling the cache."""


@dataclass
class TrainerConfig:
    """The accelerate training loop (train/trainer.py)."""

    lr: float = setting(1e-4, _positive)
    """Peak learning rate (AdamW's; Muon's matrices take 10x)."""
    optimizer: Optimizer = setting(Optimizer.adamw, _choice(Optimizer))
    """adamw, or muon (speculators' default): Muon on the 2-D weights but embeddings and LM
    heads (momentum 0.95, 5 Newton-Schulz steps, RMS matched to AdamW), AdamW on the rest."""
    num_threads: Optional[int] = setting(None, _opt_pos)
    """CPU torch threads of training and its evaluation; None: one per core other
    processes leave free, re-checked while running (infer/foundation/threads.py)."""
    weight_decay: float = setting(0.0, _weight)
    """AdamW weight decay of matrices (norms and biases get none)."""
    betas: List[float] = setting(check=_check_betas, factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    max_grad_norm: float = setting(0.5, _weight)
    """Gradient clipping; 0: off."""
    schedule: Schedule = setting(Schedule.cosine, _choice(Schedule))
    """Decay after the warmup."""
    warmup_steps: int = setting(0, _nonneg)
    """Linear warmup steps."""
    warmup_ratio: float = setting(0.0, _fraction)
    """Warmup as a fraction of all steps, used when warmup_steps is 0."""
    min_lr_ratio: float = setting(0.0, _fraction)
    """Floor of the decay, as a fraction of lr."""
    epochs: float = setting(1.0, _positive)
    """Passes over the data (when max_steps is not set)."""
    max_steps: Optional[int] = setting(None, _opt_pos)
    """Optimizer steps; overrides epochs."""
    micro_batch_size: int = setting(1, _pos, resume=True)
    """Rows per device per forward."""
    grad_accum: int = setting(1, _pos, resume=True)
    """Micro-batches per optimizer step."""
    mixed_precision: Precision = setting(Precision.auto, _choice(Precision))
    """auto: bf16 on a GPU that has it, none on CPU."""
    log_every: int = setting(10, _pos)
    """Optimizer steps between log lines."""
    save_every: int = setting(0, _nonneg)
    """Optimizer steps between checkpoints; 0: only at the end."""
    keep_last: int = setting(2, _nonneg)
    """Checkpoints kept per stage; 0 keeps all."""
    resume: str = setting("auto", check_str)
    """auto: the latest checkpoint of the stage, if any; never: start over (deletes the stage's
    checkpoints); PATH: that checkpoint."""
    num_workers: int = setting(0, _nonneg)
    """DataLoader worker processes."""
    device: Device = setting(Device.auto, _check_device)
    """auto: the rank's GPU when there is one, else CPU."""


@dataclass
class LoggerConfig:
    """Experiment tracking."""

    kind: LoggerKind = setting(LoggerKind.wandb, _choice(LoggerKind))
    """wandb (offline without an API key or network) or none."""
    project: str = setting("draftsmith", check_str)
    """W&B project."""
    run_name: Optional[str] = setting(None, _opt_str)
    """W&B run name; None: the recipe name."""
    mode: Optional[WandbMode] = setting(None, _choice(WandbMode, True))
    """W&B mode; None: from the API key / WANDB_MODE."""


def _default_eval() -> EvalConfig:
    # the free drafters beside the trained one; draft_model without a model: the untrained tiny
    # draft LM, which exists only beside the embedded target (train/evaluate.py), a reference
    # row measured at k=3 whatever eval.ks says (the recipe's ks are for the comparison)
    return EvalConfig(methods=[{"method": "ngram"}, {"method": "suffix"},
                               {"method": "draft_model", "ks": [3]}], ks=[3])


@dataclass
class TrainConfig:
    """Top-level config of ``python train.py``."""

    name: str = setting(DEFAULT_RECIPE, check_str)
    """Run name, set from the recipe file name; outputs go to <output_dir>/<name>."""
    output_dir: str = setting("outputs", check_str)
    """Where runs are written."""
    seed: int = setting(0, _seed, resume=True)
    """Seed of initialisation, data order and noise."""
    target: TargetConfig = setting(check=check_section, factory=TargetConfig)
    """The frozen target."""
    data: DataConfig = setting(check=check_section, factory=DataConfig)
    """Training data."""
    regenerate: RegenerateConfig = setting(check=check_section, factory=RegenerateConfig)
    """Answers rewritten by the target."""
    features: FeaturesConfig = setting(check=check_section, factory=FeaturesConfig)
    """Target features."""
    drafter: DrafterConfig = setting(check=check_section, factory=Eagle3DrafterConfig)
    """The drafter: its method's own settings (train/methods/), chosen with drafter=NAME."""
    objective: ObjectiveConfig = setting(check=check_section, factory=Eagle3ObjectiveConfig)
    """Its loss: the same method's objective settings (follows the drafter's choice)."""
    trainer: TrainerConfig = setting(check=check_section, factory=TrainerConfig)
    """The training loop."""
    logger: LoggerConfig = setting(check=check_section, factory=LoggerConfig)
    """Experiment tracking."""
    eval: EvalConfig = setting(check=_eval, factory=_default_eval)
    """End-of-training acceptance harness (the trained drafter beside eval.methods)."""
    plan: bool = setting(False, _flag)
    """Print what the run will cost (tokens, steps, cache bytes, target GPU memory per rank;
    train/plan.py) and exit, reading config.json only (a named target is converted first)."""

    @property
    def run_dir(self) -> Path:
        """``<output_dir>/<name>``: data, features, checkpoints, final, report."""
        return Path(self.output_dir) / self.name

    @property
    def final_dir(self) -> Path:
        """The stable path of the trained drafter, e.g. ``outputs/tiny_eagle3/final``."""
        return self.run_dir / "final"

    def validate(self) -> None:
        """Every key of every section, named by its dotted path (``eval.ks[0]``), checked before
        any work starts: hours of work must not end in an error a look at the config could have
        given. What needs the target or a file is checked where those are first read."""
        check_fields(self, "", WHERE)


def explain_method_keys(message: str) -> str:
    """Hydra's "Key 'n_predict' not in 'Eagle3DrafterConfig'" in the user's terms: which
    method's section lacks the key, the keys it has, and how to choose another method."""
    for name in METHODS.names():
        drafter = METHODS.get(name)
        for section, cls in (("drafter", drafter), ("objective", drafter.objective_config)):
            if f"not in '{cls.__name__}'" in message:
                keys = ", ".join(k for k in keys_of(cls) if k != "method") or "none"
                return (f"{message}\n  the {name} method's {section} section has no such key; "
                        f"its keys: {keys} (another method: drafter=NAME, one of "
                        f"{', '.join(METHODS.names())})")
    return message


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def register_configs() -> None:
    """Register the schema, each method's settings into the ``drafter`` and ``objective`` groups
    (train/methods/; conf/train.yaml makes ``objective`` follow ``drafter``), ``recipes/*.yaml``
    into ``recipe`` and ``recipes/shared/*.yaml`` (parts recipes include: ``defaults:
    [/recipe_shared/NAME, _self_]``) into ``recipe_shared``."""
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(TrainConfig)
    schema.drafter, schema.objective = MISSING, MISSING  # a group option fills each in
    cs.store(name="train_schema", node=schema)
    for name in METHODS.names():
        drafter = METHODS.get(name)
        cs.store(group="drafter", name=name, node=drafter)
        cs.store(group="objective", name=name, node=drafter.objective_config)
    for group, folder in (("recipe", RECIPES_DIR), ("recipe_shared", RECIPES_DIR / "shared")):
        for path in sorted(folder.glob("*.yaml")):
            node = OmegaConf.load(path) or OmegaConf.create({})
            if group == "recipe":
                node.name = path.stem
            cs.store(group=group, name=path.stem, node=node, package="_global_")
    register_help_resolver("train", TrainConfig, methods_help)


def methods_help() -> str:
    """``--help``'s list of every method's own settings (those above are eagle3's, the
    default): ``drafter=NAME`` brings that method's drafter and objective keys."""
    lines = ["\n\n== Methods (drafter=NAME: its drafter.* and objective.* keys; those above "
             "are eagle3's) =="]
    for name in METHODS.names():
        drafter = METHODS.get(name)
        lines += [f"-- drafter={name}", schema_help(drafter, "drafter.")]
        if keys_of(drafter.objective_config):
            lines.append(schema_help(drafter.objective_config, "objective."))
    return "\n".join(lines)
