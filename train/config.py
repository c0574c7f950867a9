"""Typed training configuration, registered in Hydra's ConfigStore.

YAML in ``conf/`` and ``recipes/`` only states values; the schema lives here, so a misspelt key
fails at compose time with the key named (Hydra's structured-config check) instead of being
silently ignored. Every recipe file ``recipes/NAME.yaml`` is registered into the ``recipe``
group at import (``register_configs``), so ``python train.py recipe=NAME`` selects it and an
unknown name makes Hydra list the available ones. The recipe's name is written into ``name``
(the output folder ``<output_dir>/<name>``), so recipe files state deltas only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "tiny_eagle3"


@dataclass
class TargetConfig:
    """The frozen target. ``path`` None means the embedded tiny target (built if missing)."""

    path: Optional[str] = None  # HF model directory or hub id
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, fp32 on CPU)


@dataclass
class DataConfig:
    """Training data. ``source`` None means the embedded default dataset (stdlib code)."""

    source: Optional[str] = None
    format: Optional[str] = None  # auto-detected from the columns when None
    split: str = "train"
    max_length: int = 512
    num_examples: int = 2000  # embedded default dataset size / cap on other sources
    num_proc: int = 1
    seed: int = 0
    pack: bool = True


@dataclass
class RegenerateConfig:
    """Self-distillation: the target rewrites the answers with the engine (train/regenerate.py)."""

    enabled: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256  # per answer
    batch_size: int = 8  # engine max_num_seqs
    max_model_len: Optional[int] = None  # None: the target's context length
    num_examples: Optional[int] = None  # regenerate only the first N examples (None: all)


@dataclass
class FeaturesConfig:
    """Target features: ``online`` (target forward inside each step) or ``offline`` (precomputed
    once into sharded safetensors under ``cache_dir``, default ``<run>/features``)."""

    mode: str = "online"  # online | offline
    cache_dir: Optional[str] = None
    dtype: str = "bfloat16"  # storage dtype of the offline cache: bfloat16 | float16 | float32
    rows_per_shard: int = 256
    batch_size: int = 4  # target forward batch while precomputing


@dataclass
class DrafterConfig:
    """The drafter architecture. Keys not used by ``method`` are ignored by it."""

    method: str = "eagle3"  # eagle3 | eagle | mlp_speculator | pard (train/objectives/)
    draft_vocab_size: int = 1024  # eagle3: reduced LM head over the most frequent loss tokens
    aux_layer_ids: Optional[List[int]] = None  # eagle3: None = default_aux_layer_ids(n)
    intermediate_size: Optional[int] = None  # eagle / eagle3 draft layer MLP; None = target's
    norm_before_residual: bool = True  # eagle3 flags (speculators config.json keys)
    norm_output: bool = False
    fc_norm: bool = False
    embed_requires_grad: bool = False  # eagle3: train (and ship) its own embedding
    n_predict: int = 3  # mlp_speculator stages
    inner_dim: int = 0  # mlp_speculator; 0 = target hidden size
    tie_weights: bool = False  # mlp_speculator
    scale_input: bool = False  # mlp_speculator
    model: Optional[str] = None  # pard: the draft causal LM to adapt (None: embedded tiny draft)
    mask_token_id: Optional[int] = None  # pard: None = picked automatically (pard objective)
    init_from: Optional[str] = None  # start from an exported checkpoint of this method


@dataclass
class ObjectiveConfig:
    """Loss settings. Keys not used by the method are ignored by it."""

    ttt_steps: int = 7  # eagle3 / eagle: training-time-test unroll length
    step_weight: float = 1.0  # step s has weight step_weight ** s (EAGLE: 0.8, speculators: 1)
    feature_noise: float = 0.0  # uniform noise amplitude on target features (EAGLE: 0.1-0.2)
    regression_weight: float = 1.0  # eagle: SmoothL1 on features
    ce_weight: float = 0.1  # eagle: soft CE against the target distribution
    kd_weight: float = 0.0  # mlp_speculator / pard: KD against the target distribution
    pard_k: int = 8  # pard: number of copies (drafts per forward)
    cod_ratio: float = 0.7  # pard: copy i keeps max(cod_ratio ** i, cod_min) of positions
    cod_min: float = 0.2
    stage2_steps: int = 0  # mlp_speculator: stage 2 on target-generated text (0 = off)


@dataclass
class TrainerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 0.5
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr
    epochs: float = 1.0
    max_steps: Optional[int] = None  # optimizer steps; overrides epochs
    micro_batch_size: int = 1
    grad_accum: int = 1
    mixed_precision: str = "auto"  # auto (bf16 on GPU, no on CPU) | no | bf16 | fp16
    log_every: int = 10
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # checkpoints kept per stage; 0 keeps all
    resume: str = "auto"  # auto: the latest checkpoint of the same stage, if any; never: delete
    # that stage's old checkpoints and start over; PATH: that checkpoint
    num_workers: int = 0
    device: str = "auto"  # auto | cpu | cuda (accelerate picks the rank's GPU)


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # wandb (offline without API key / network) | none
    project: str = "draftsmith"
    run_name: Optional[str] = None  # None: the recipe name
    mode: Optional[str] = None  # online | offline | disabled; None: from key / WANDB_MODE


@dataclass
class EvalConfig:
    """End-of-training acceptance harness on held-out prompts (infer/harness.py)."""

    enabled: bool = True
    ks: List[int] = field(default_factory=lambda: [3])
    num_prompts: int = 8
    max_tokens: int = 64
    dataset: Optional[str] = None  # None: held-out code prompts (embedded default)
    dataset_split: str = "test"
    baselines: List[str] = field(default_factory=lambda: ["ngram"])  # methods run beside it
    batch_size: int = 1


@dataclass
class TrainConfig:
    """Top-level config of ``python train.py``."""

    name: str = DEFAULT_RECIPE  # set from the recipe file name
    output_dir: str = "outputs"
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        """``<output_dir>/<name>``: data, features, checkpoints, final, report."""
        return Path(self.output_dir) / self.name

    @property
    def final_dir(self) -> Path:
        """The stable path of the trained drafter, e.g. ``outputs/tiny_eagle3/final``."""
        return self.run_dir / "final"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def register_configs() -> None:
    """Register the schema (``train_schema``) and every ``recipes/*.yaml`` into ``recipe``."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name in recipe_names():
        node = OmegaConf.load(RECIPES_DIR / f"{name}.yaml") or OmegaConf.create({})
        node.name = name
        cs.store(group="recipe", name=name, node=node, package="_global_")
