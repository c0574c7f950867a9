"""How the harness runs its matrix: one typed object instead of a keyword list, built from the
typed evaluation config (``EvalConfig.harness_options``) by both entry points, so
``infer.py mode=eval`` and ``train.py``'s evaluation cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HarnessOptions:
    """Settings of one harness run (``run_harness``); the fields' meaning is ``EvalConfig``'s
    (infer/config.py), the last five the engine's."""

    max_tokens: int = 64
    ignore_eos: bool = False
    warmup: bool = True
    engine: str = "draftsmith"  # or "vllm": every configuration runs on vLLM instead
    vllm_python: str | None = None
    tensor_parallel_size: int = 1
    num_prompts: int | None = None  # a batch-1 run's prompts; None: all
    requests_per_slot: int = 0
    repeats: int = 1
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    num_threads: int | None = None  # CPU thread policy (infer/foundation/threads.py)
