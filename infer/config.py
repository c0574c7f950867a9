"""Typed config of ``python infer.py`` (registered in Hydra's ConfigStore as ``infer_schema``), and
the acceptance harness's ``EvalConfig``, which ``train.py`` uses too.

``speculative_config`` is a nested mapping or a JSON string, validated by SpeculativeConfig;
``sampling`` holds SamplingParams keys, validated by SamplingParams.from_dict. Both therefore
fail with the key named, like the structured fields here. Fields with a fixed set of values are
``StrChoice`` enums, so Hydra rejects a bad value at compose time and lists the allowed ones.
Every field's docstring is what ``python infer.py --help`` prints (``infer/config_docs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from infer.config_docs import register_help_resolver
from infer.validation import StrChoice


class Mode(StrChoice):
    generate = "generate"
    eval = "eval"


class LoggerKind(StrChoice):
    wandb = "wandb"
    none = "none"


class Dtype(StrChoice):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _default_methods() -> List[Any]:
    # draft_model without a model: the embedded tiny draft when running the embedded default
    return [{"method": "ngram"}, {"method": "suffix"}, {"method": "draft_model"}]


@dataclass
class EvalConfig:
    """The acceptance harness (infer/eval/harness.py): methods x ks x temperatures x batch_sizes
    over a prompt set, for ``infer.py mode=eval`` and after ``train.py``'s training."""

    enabled: bool = True
    """train.py: evaluate the trained drafter after training (infer.py mode=eval ignores it)."""
    every_steps: int = 0
    """train.py: also measure served acceptance (the exported head through the engine, greedy,
    k = max(ks)) every N optimizer steps, logged as served/* beside the training accuracies;
    0: off."""
    every_num_prompts: int = 8
    """train.py: prompts of that periodic measurement (the first of the evaluation prompts)."""
    methods: List[Any] = field(default_factory=_default_methods)
    """speculative_config mappings without num_speculative_tokens; an optional "name" labels one
    in reports. train.py runs them beside the trained drafter."""
    ks: List[int] = field(default_factory=lambda: [1, 3, 5])
    """num_speculative_tokens values to measure."""
    temperatures: List[float] = field(default_factory=lambda: [0.0, 1.0])
    """Sampling temperatures to measure (0: greedy, checked lossless; > 0: seeded by ``seed``,
    drafts sampled for the p/q test where the drafter has a distribution)."""
    batch_sizes: List[int] = field(default_factory=lambda: [1, 8])
    """Engine batch sizes (max_num_seqs) to measure."""
    max_tokens: int = 64
    """Tokens generated per prompt."""
    num_prompts: int = 16
    """Prompts taken from the prompt set. Twice the largest batch size: all requests of a batch
    start together, and with no queue to refill it the slowest request sets the run's end (at
    batch 8 with 8 prompts that cost a learned drafter ~15 % of its speedup)."""
    dataset: Optional[str] = None
    """json/jsonl/csv/parquet file, dataset folder or hub id; None: the held-out code prompts."""
    dataset_split: str = "test"
    """Split of a dataset folder or hub dataset."""
    dataset_subset: Optional[str] = None
    """Subset (config name) of a hub dataset."""
    chat: Optional[bool] = None
    """Chat template: None = for chat-style records only, true = for every prompt."""
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Variables for the chat template, as vLLM's chat_template_kwargs (enable_thinking: false).
    train.py adds data.enable_thinking, so training and evaluation render alike."""
    ignore_eos: bool = False
    """Generate max_tokens per prompt even past EOS."""
    warmup: bool = True
    """Untimed warm-up before each timed run (on CUDA: the whole run, to capture graphs)."""
    output_dir: Optional[str] = None
    """Where results go; None: outputs/eval/<timestamp> (infer.py), <run_dir>/eval (train.py)."""
    logger: LoggerKind = LoggerKind.none
    """infer.py mode=eval: wandb or none (train.py logs through its own logger section)."""
    wandb_project: str = "draftsmith"
    """W&B project of infer.py mode=eval."""
    wandb_run_name: Optional[str] = None
    """W&B run name of infer.py mode=eval."""


@dataclass
class InferConfig:
    """Top-level config of ``python infer.py``."""

    mode: Mode = Mode.generate
    """generate: outputs and metrics for prompts; eval: the acceptance harness (eval.*)."""
    model: Optional[str] = None
    """Target model directory or hub id; None: the embedded tiny target (built if missing)."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; None: the model's."""
    speculative_config: Any = None
    """vLLM's speculative_config as a mapping or JSON string; None: no speculation."""
    sampling: Dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0,
                                                              "max_tokens": 64})
    """SamplingParams keys (vLLM names) for every prompt."""
    prompts_file: Optional[str] = None
    """Text lines (one prompt each, \\n escapes) or jsonl / json with prompt / prompt_token_ids."""
    num_prompts: int = 4
    """Held-out code prompts used when no prompts_file is given."""
    output: Optional[str] = None
    """jsonl file for the results (written atomically)."""
    dtype: Dtype = Dtype.auto
    """Weights dtype: auto = the checkpoint's on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    max_model_len: Optional[int] = None
    """Context length (prompt + output); None: the model's, at most 4096."""
    max_num_seqs: int = 8
    """Requests decoded together (continuous batching)."""
    seed: int = 0
    """Engine seed for sampled requests without their own."""
    show_outputs: bool = True
    """Print each prompt's tail and its completion."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """mode=eval: the harness matrix."""


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)
    register_help_resolver("infer", InferConfig)
