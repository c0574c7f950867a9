"""Typed config of ``python infer.py`` (registered in Hydra's ConfigStore as ``infer_schema``).

``speculative_config`` is a nested mapping or a JSON string, validated by SpeculativeConfig;
``sampling`` holds SamplingParams keys, validated by SamplingParams.from_dict. Both therefore
fail with the key named, like the structured fields here.

``mode``: ``generate`` (default) or ``eval``: the acceptance harness (infer/harness.py) over the
``eval`` matrix, e.g. ``python infer.py mode=eval eval.ks=[1,3,5] eval.logger=wandb``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


def _default_methods() -> List[Any]:
    # draft_model without a model: the embedded tiny draft when running the embedded default
    return [{"method": "ngram"}, {"method": "suffix"}, {"method": "draft_model"}]


@dataclass
class EvalConfig:
    """``mode=eval``: methods x ks x temperatures x batch_sizes over a prompt set."""

    methods: List[Any] = field(default_factory=_default_methods)  # speculative_config mappings
    # without num_speculative_tokens; optional "name" labels a method in reports
    ks: List[int] = field(default_factory=lambda: [1, 3, 5])
    temperatures: List[float] = field(default_factory=lambda: [0.0])
    batch_sizes: List[int] = field(default_factory=lambda: [1])
    max_tokens: int = 64
    num_prompts: int = 8
    dataset: Optional[str] = None  # json/jsonl/csv/parquet file, dataset dir or hub id;
    # None: the held-out code prompts (embedded default)
    dataset_split: str = "test"
    dataset_subset: Optional[str] = None
    chat: Optional[bool] = None  # chat template: None = for chat-style records only
    ignore_eos: bool = False
    warmup: bool = True
    output_dir: Optional[str] = None  # None: outputs/eval/<timestamp>
    logger: str = "none"  # none | wandb
    wandb_project: str = "draftsmith"
    wandb_run_name: Optional[str] = None


@dataclass
class InferConfig:
    mode: str = "generate"  # generate | eval
    model: Optional[str] = None  # None: the embedded tiny target (built if missing)
    tokenizer: Optional[str] = None
    speculative_config: Any = None  # mapping or JSON string (vLLM schema); None: none
    sampling: Dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0,
                                                              "max_tokens": 64})
    prompts_file: Optional[str] = None  # text lines or jsonl ("prompt" / "prompt_token_ids")
    num_prompts: int = 4  # held-out code prompts when no prompts_file is given
    output: Optional[str] = None  # jsonl of results
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 8
    seed: int = 0
    show_outputs: bool = True
    eval: EvalConfig = field(default_factory=EvalConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)
