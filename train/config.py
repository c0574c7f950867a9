"""Typed training configuration, registered in Hydra's ConfigStore.

YAML in ``conf/`` and ``recipes/`` only states values; the schema lives here, so a misspelt key
fails at compose time with the key named (Hydra's structured-config check) instead of being
silently ignored, and a field with a fixed set of values (a ``StrChoice`` enum) rejects any other
value with the allowed ones listed. Every field carries an attribute docstring: ``python train.py
--help`` prints them all (``infer/config_docs.py``). Every recipe file ``recipes/NAME.yaml`` is
registered into the ``recipe`` group at import (``register_configs``), so ``python train.py
recipe=NAME`` selects it and an unknown name makes Hydra list the available ones. The recipe's
name is written into ``name`` (the output folder ``<output_dir>/<name>``), so recipe files state
deltas only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from infer.config import Dtype, EvalConfig, EvalEngine, LoggerKind
from infer.config_docs import register_help_resolver
from infer.foundation.validation import (check_bool, check_choice, check_fields, check_float,
                                         check_int, check_list, check_str, config_error)
from train.choices import (DataFormat, Device, DistillLoss, FeatureMode, LmHeadInit, Optimizer,
                           PositionWeights, Precision, Schedule, StorageDtype, TargetSharding,
                           WandbMode)

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "tiny_eagle3"


@dataclass
class TargetConfig:
    """The frozen target."""

    path: Optional[str] = None
    """HF model directory, hub id or smollm2 (train/real/); None: the embedded tiny target."""
    dtype: Dtype = Dtype.auto
    """auto: bfloat16 on GPU, float32 on CPU."""
    sharding: TargetSharding = TargetSharding.auto
    """How the frozen target is spread over the ranks of a multi-process run, for the target
    forwards of online features and of the offline cache build: none = every rank holds it
    whole; fsdp = FSDP2 (each decoder layer a unit, all-gathered for its forward); zero3 =
    DeepSpeed ZeRO-3 (needs deepspeed). auto = as the accelerate config shards the drafter:
    fsdp under an FSDP config, zero3 under DeepSpeed ZeRO stage 3, else none. One process: none
    (docs/scale-out.md)."""


@dataclass
class DataConfig:
    """Training data."""

    source: Optional[str] = None
    """File, folder, save_to_disk folder or hub id; None: the embedded default (stdlib code)."""
    format: Optional[DataFormat] = None
    """Column layout; None: detected from the columns."""
    split: str = "train"
    """Split of a folder or hub dataset."""
    max_length: int = 512
    """Tokens per packed row (and the cap on one example)."""
    num_examples: int = 2000
    """Size of the embedded default dataset / cap on other sources."""
    num_proc: int = 1
    """Tokenizer worker processes."""
    seed: int = 0
    """Shuffle seed."""
    pack: bool = True
    """Pack examples into rows of max_length (documents never attend across each other)."""
    enable_thinking: Optional[bool] = None
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

    enabled: bool = False
    """Rewrite every assistant answer with the target before training."""
    temperature: float = 0.0
    """Sampling temperature of the rewrite (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling of the rewrite."""
    max_tokens: int = 256
    """Tokens per answer."""
    batch_size: int = 8
    """Requests decoded together (the engine's max_num_seqs). Sampled answers depend on it, so
    a sampled regeneration resumes only with the same value; greedy answers do not."""
    max_model_len: Optional[int] = None
    """Context length of the rewrite; None: data.max_length + max_tokens (within the target's)."""
    num_examples: Optional[int] = None
    """Regenerate only the first N examples; None: all."""
    engine: EvalEngine = EvalEngine.draftsmith
    """draftsmith: this engine; vllm: one vLLM kept up for the whole rewrite (targets beyond one
    device: tensor_parallel_size; infer/eval/vllm_engine.py's VllmSession)."""
    vllm_python: Optional[str] = None
    """engine=vllm: the Python of an environment with vLLM; None: vLLM importable here."""
    tensor_parallel_size: int = 1
    """engine=vllm: GPUs the target is split across."""


@dataclass
class FeaturesConfig:
    """Target features: computed inside each training step, or cached once."""

    mode: FeatureMode = FeatureMode.online
    """online: the frozen target runs in each step; offline: a resumable safetensors cache."""
    cache_dir: Optional[str] = None
    """Offline cache folder; None: <run_dir>/features."""
    dtype: StorageDtype = StorageDtype.bfloat16
    """Storage dtype of the offline cache."""
    rows_per_shard: int = 256
    """Packed rows per cache shard."""
    batch_size: int = 4
    """Target forward batch while filling the cache."""


@dataclass
class DrafterConfig:
    """The drafter architecture; keys a method does not use are ignored by it."""

    method: str = "eagle3"
    """The objective (train/objectives/): eagle3, eagle, peagle, dflash, mlp_speculator, pard
    or mtp (the target's own MTP layer)."""
    draft_vocab_size: int = 1024
    """eagle3 / peagle / dflash: LM head over the most frequent training-target tokens."""
    token_map_size: Optional[int] = None
    """eagle3 / peagle: also export ``speculative_token_map.json``, the most frequent training-
    target tokens of the draft vocabulary, this many, and serve greedy drafts over them only
    (``speculative_token_map``; FR-Spec): a large draft vocabulary for sampled drafts at the
    LM-head cost of a small one for greedy drafts. None: no map."""
    aux_layer_ids: Optional[List[int]] = None
    """eagle3 / peagle / dflash: target residual streams fed to the head (k = the stream after
    k layers; negative ids count from the end: -1 = n, the last layer's output); None: the
    method's default (eagle3: [2, n // 2, n - 3] made valid; dflash: spread over the layers)."""
    num_layers: int = 1
    """dflash / eagle3 / peagle: draft decoder layers (dflash's reference uses 5, P-EAGLE 4)."""
    intermediate_size: Optional[int] = None
    """eagle / eagle3 / peagle / dflash: the draft layers' MLP width; None: the target's."""
    norm_before_residual: bool = True
    """eagle3: residual = hidden_norm(g) (speculators' flag)."""
    norm_output: bool = False
    """eagle3: feed norm(h) back to the next step instead of h."""
    fc_norm: bool = False
    """eagle3: one RMSNorm per aux state before fc."""
    norm_before_fc: bool = False
    """eagle3: one RMSNorm over the concatenated aux states before fc (input_norm)."""
    lm_head_init: LmHeadInit = LmHeadInit.target_rows
    """eagle3: start the LM head from the target's rows of the draft vocabulary (target_rows,
    +0.14 acceptance length measured, docs/benchmarks-history.md) or from random weights."""
    layer_from_target: bool = False
    """eagle3: start as the target's last decoder layer over its last aux stream (FastMTP)."""
    embed_requires_grad: bool = False
    """eagle3: train (and ship) its own embedding instead of sharing the target's."""
    n_predict: int = 3
    """mlp_speculator: stages (drafted tokens)."""
    inner_dim: int = 0
    """mlp_speculator: state width; 0: the target's hidden size."""
    tie_weights: bool = False
    """mlp_speculator: share embedding, head, norm and projection across stages."""
    scale_input: bool = False
    """mlp_speculator: normalise and scale the target state first."""
    model: Optional[str] = None
    """pard: the draft causal LM to adapt; None: the embedded tiny draft."""
    mask_token_id: Optional[int] = None
    """pard / peagle / dflash: the mask token; None: picked automatically (an unused id)."""
    init_from: Optional[str] = None
    """Start from an exported checkpoint of this method (mtp: a stitched target)."""


@dataclass
class ObjectiveConfig:
    """Loss settings; keys a method does not use are ignored by it."""

    ttt_steps: int = 7
    """eagle3 / eagle: training-time-test unroll length."""
    step_weight: float = 1.0
    """Step s of the unroll has weight step_weight ** s (EAGLE: 0.8, speculators: 1)."""
    position_weights: PositionWeights = PositionWeights.geometric
    """eagle3 / eagle / mtp: geometric (step_weight ** s) or dpace: step s of an anchor weighs
    sum_{m >= s} prod_{j <= m} (0.5 exp(-loss_j) + 0.5) over its valid steps (no gradient)."""
    feature_noise: float = 0.0
    """Uniform noise amplitude on the target features (EAGLE: 0.1-0.2)."""
    loss: DistillLoss = DistillLoss.kl
    """The distillation loss toward the target's distribution p (train/objectives/losses.py):
    kl = KL(p||q), rkl = KL(q||p), jsd, ce (p's argmax), tv = 1 - acceptance (sum min(p, q)),
    nla = -log acceptance, lk_hybrid = lambda KL + (1 - lambda) TV, lambda = exp(-3 acceptance)."""
    regression_weight: float = 1.0
    """eagle: SmoothL1 on the next feature."""
    ce_weight: float = 0.1
    """eagle: KL to the target's next-token distribution."""
    kd_weight: float = 0.0
    """mlp_speculator / pard: KL to the target's distribution, on top of the CE."""
    argmax_weight: float = 0.0
    """eagle3 / peagle: cross-entropy on the target's greedy token (where the draft vocabulary
    has it), on top of the KL: what a greedy draft must match."""
    pard_k: int = 8
    """pard: copies of the sequence (drafts per forward)."""
    cod_ratio: float = 0.7
    """pard / peagle: copy (depth) i keeps max(cod_ratio ** i, cod_min) of the positions."""
    cod_min: float = 0.2
    """pard / peagle: the floor of that fraction."""
    parallel_depths: int = 8
    """peagle: drafts per forward trained (depths; the most a server may ask for)."""
    block_size: int = 16
    """dflash: block slots (1 verified token + block_size - 1 masks = the most drafts)."""
    max_anchors: int = 512
    """peagle / dflash: at most this many anchors (chains / blocks) per packed row."""
    decay_gamma: float = 7.0
    """dflash: slot k's loss weight is exp(-(k - 1) / decay_gamma)."""
    stage2_steps: int = 0
    """mlp_speculator: optimizer steps of stage 2 on the target's own answers; 0: off."""
    stage2_lr_factor: float = 0.1
    """mlp_speculator: stage 2's peak lr as a fraction of trainer.lr (IBM's recipe: 0.1)."""
    stage2_warmup_steps: Optional[int] = None
    """mlp_speculator: stage 2's warmup; None: IBM's min(2000, stage2_steps // 20)."""
    stage2_min_lr_ratio: float = 0.1
    """mlp_speculator: stage 2 anneals (cosine) to this fraction of its own peak (IBM: 0.1)."""


@dataclass
class TrainerConfig:
    """The accelerate training loop (train/trainer.py)."""

    lr: float = 1e-4
    """Peak learning rate (AdamW's; Muon's matrices take 10x)."""
    optimizer: Optimizer = Optimizer.adamw
    """adamw, or muon (speculators' default): Muon on the 2-D weights but embeddings and LM
    heads (momentum 0.95, 5 Newton-Schulz steps, RMS matched to AdamW), AdamW on the rest."""
    num_threads: Optional[int] = None
    """CPU torch threads of training and its evaluation; None: one per core other
    processes leave free, re-checked while running (infer/foundation/threads.py)."""
    weight_decay: float = 0.0
    """AdamW weight decay of matrices (norms and biases get none)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    max_grad_norm: float = 0.5
    """Gradient clipping; 0: off."""
    schedule: Schedule = Schedule.cosine
    """Decay after the warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of all steps, used when warmup_steps is 0."""
    min_lr_ratio: float = 0.0
    """Floor of the decay, as a fraction of lr."""
    epochs: float = 1.0
    """Passes over the data (when max_steps is not set)."""
    max_steps: Optional[int] = None
    """Optimizer steps; overrides epochs."""
    micro_batch_size: int = 1
    """Rows per device per forward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    mixed_precision: Precision = Precision.auto
    """auto: bf16 on a GPU that has it, none on CPU."""
    log_every: int = 10
    """Optimizer steps between log lines."""
    save_every: int = 0
    """Optimizer steps between checkpoints; 0: only at the end."""
    keep_last: int = 2
    """Checkpoints kept per stage; 0 keeps all."""
    resume: str = "auto"
    """auto: the latest checkpoint of the stage, if any; never: start over (deletes the stage's
    checkpoints); PATH: that checkpoint."""
    num_workers: int = 0
    """DataLoader worker processes."""
    device: Device = Device.auto
    """auto: the rank's GPU when there is one, else CPU."""


@dataclass
class LoggerConfig:
    """Experiment tracking."""

    kind: LoggerKind = LoggerKind.wandb
    """wandb (offline without an API key or network) or none."""
    project: str = "draftsmith"
    """W&B project."""
    run_name: Optional[str] = None
    """W&B run name; None: the recipe name."""
    mode: Optional[WandbMode] = None
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

    name: str = DEFAULT_RECIPE
    """Run name, set from the recipe file name; outputs go to <output_dir>/<name>."""
    output_dir: str = "outputs"
    """Where runs are written."""
    seed: int = 0
    """Seed of initialisation, data order and noise."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The frozen target."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    """Answers rewritten by the target."""
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    """Target features."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """The drafter."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """Its loss."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment tracking."""
    eval: EvalConfig = field(default_factory=_default_eval)
    """End-of-training acceptance harness (the trained drafter beside eval.methods)."""
    plan: bool = False
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
        check_fields(self, "", _TOP_RULES, WHERE)


# ---- validation rules: one per field, called as rule(key, value, where=...) ---------------------

WHERE = "train config"


def validate_section(name: str, section) -> None:
    """One section by its rules (``validate_section("trainer", cfg.trainer)``), for code handed
    only a section or a stage's modified copy of it (the trainer, ``regenerate``, objectives)."""
    check_fields(section, name, _SECTION_RULES[name], WHERE)


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


def _nested(key: str, value, where: str, *, name: str) -> None:
    check_fields(value, key, _SECTION_RULES[name], where)


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
_SECTION_RULES = {
    "target": {"path": _opt_str, "dtype": _choice(Dtype), "sharding": _choice(TargetSharding)},
    "data": {"source": _opt_str, "format": _choice(DataFormat, True), "split": check_str,
             "max_length": partial(check_int, minimum=2), "num_examples": _pos, "num_proc": _pos,
             "seed": _seed, "pack": _flag, "enable_thinking": partial(check_bool, optional=True)},
    "regenerate": {"enabled": _flag, "temperature": _weight, "top_p": _share, "max_tokens": _pos,
                   "batch_size": _pos, "max_model_len": partial(check_int, minimum=2,
                                                                optional=True),
                   "num_examples": _opt_pos, "engine": _choice(EvalEngine),
                   "vllm_python": _opt_str, "tensor_parallel_size": _pos},
    "features": {"mode": _choice(FeatureMode), "cache_dir": _opt_str,
                 "dtype": _choice(StorageDtype), "rows_per_shard": _pos, "batch_size": _pos},
    "drafter": {"method": check_str, "draft_vocab_size": _pos, "token_map_size": _opt_pos,
                "aux_layer_ids": partial(check_list, item=check_int, optional=True),
                "num_layers": _pos, "intermediate_size": _opt_pos, "norm_before_residual": _flag,
                "norm_output": _flag, "fc_norm": _flag, "norm_before_fc": _flag,
                "lm_head_init": _choice(LmHeadInit), "layer_from_target": _flag,
                "embed_requires_grad": _flag, "n_predict": _pos, "inner_dim": _nonneg,
                "tie_weights": _flag, "scale_input": _flag, "model": _opt_str,
                "mask_token_id": _opt_nonneg, "init_from": _opt_str},
    "objective": {"ttt_steps": _pos, "step_weight": _weight, "feature_noise": _weight,
                  "loss": _choice(DistillLoss), "position_weights": _choice(PositionWeights),
                  "regression_weight": _weight, "ce_weight": _weight, "kd_weight": _weight,
                  "argmax_weight": _weight,
                  "pard_k": _pos, "cod_ratio": _share, "cod_min": _share,
                  "parallel_depths": _pos, "block_size": partial(check_int, minimum=2),
                  "max_anchors": _pos, "decay_gamma": _positive, "stage2_steps": _nonneg,
                  "stage2_lr_factor": _positive, "stage2_warmup_steps": _opt_nonneg,
                  "stage2_min_lr_ratio": _fraction},
    "trainer": {"lr": _positive, "optimizer": _choice(Optimizer), "weight_decay": _weight,
                "betas": _check_betas,
                "max_grad_norm": _weight, "schedule": _choice(Schedule), "warmup_steps": _nonneg,
                "warmup_ratio": _fraction, "min_lr_ratio": _fraction, "epochs": _positive,
                "max_steps": _opt_pos, "micro_batch_size": _pos, "grad_accum": _pos,
                "mixed_precision": _choice(Precision), "log_every": _pos, "save_every": _nonneg,
                "keep_last": _nonneg, "resume": check_str, "num_workers": _nonneg,
                "device": _check_device, "num_threads": _opt_pos},
    "logger": {"kind": _choice(LoggerKind), "project": check_str, "run_name": _opt_str,
               "mode": _choice(WandbMode, True)},
}
_TOP_RULES = {"name": check_str, "output_dir": check_str, "seed": _seed, "eval": _eval,
              "plan": _flag,
              **{name: partial(_nested, name=name) for name in _SECTION_RULES}}


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def register_configs() -> None:
    """Register the schema, ``recipes/*.yaml`` into ``recipe`` and ``recipes/shared/*.yaml``
    (parts recipes include: ``defaults: [/recipe_shared/NAME, _self_]``) into ``recipe_shared``."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, folder in (("recipe", RECIPES_DIR), ("recipe_shared", RECIPES_DIR / "shared")):
        for path in sorted(folder.glob("*.yaml")):
            node = OmegaConf.load(path) or OmegaConf.create({})
            if group == "recipe":
                node.name = path.stem
            cs.store(group=group, name=path.stem, node=node, package="_global_")
    register_help_resolver("train", TrainConfig)
