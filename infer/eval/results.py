"""What the acceptance harness produces: ``HarnessReport`` (results.json) and its rows.

results.json keys (``schema_version`` 3; documented in docs/harness.md):

- top level: ``schema_version``, ``created``, ``target``, ``settings`` (max_tokens, num_prompts
  (of a batch-1 run), requests_per_slot, repeats, ignore_eos, device (resolved), dtype, seed,
  warmup, torch, torch_threads, machine: cpu_count, usable_cores, load_average, torch_threads,
  torch_interop_threads), ``baselines``, ``results``, ``advisor``, ``recommended_k`` (method ->
  k), ``lossless`` (false iff any greedy row mismatched), ``files`` (markdown and plot file
  names).
- ``baselines[]``: ``batch_size``, ``temperature``, ``tok_s``, ``tokens``, ``seconds``,
  ``steps``, ``c_ar_s``, ``other_cores``, ``num_prompts`` (requests of the run): the
  autoregressive run before the cell's configurations; ``tok_s_after``, ``c_ar_s_after``: the
  one after them (3; a row's ``ar_tok_s`` and ``c_ar_s`` are interpolated between the two).
- ``results[]``: ``method`` (the label), ``speculative_config`` (resolved, vLLM schema), ``k``,
  ``temperature``, ``batch_size``, ``acceptance_length``, ``acceptance_rate``, ``per_position``
  (k rates), ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
  ``num_accepted_tokens_per_pos``, ``draft_coverage``, ``tokens``, ``seconds``, ``tok_s``,
  ``ar_tok_s``, ``speedup``, ``predicted_speedup``, ``tokens_per_step``, ``cost_draft``,
  ``cost_verify``, ``c_ar_s``, ``c_step_s``, ``c_draft_s``, ``c_verify_s``,
  ``c_verify_forward_s``, ``steps``, ``lossless`` (bool; null for sampled rows),
  ``mismatched_prompts`` (prompt indices), ``num_errors``, ``draft_sample_method`` (greedy or
  probabilistic drafts), ``other_cores`` (cores other processes kept busy during the timed run;
  null where the machine cannot tell), ``num_prompts`` (requests of the run: a batch-B run
  serves max(num_prompts, requests_per_slot x B)), ``speedup_runs`` (repeats > 1: each round's
  speedup; ``speedup`` is their median; empty otherwise).
- ``advisor[]``: ``method``, ``batch_size``, ``temperature``, ``measured_ks``,
  ``recommended_k``, ``predicted_speedup``, ``candidates[]`` (``k``, ``expected_accepted``,
  ``cost_draft``, ``cost_verify``, ``predicted_speedup``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from infer.eval.machine import CONTENTION_CORES

SCHEMA_VERSION = 3
#: a cell's autoregressive throughput moving by more than this share between the run before its
#: configurations and the run after their first round: the machine itself changed speed (on a
#: shared host, its neighbours; no process of this machine shows it), and a single run's speedup
#: in that cell can be off by about as much (docs/benchmarks-history.md, eleventh session: an n-gram row
#: that never drafts read 0.86-1.40 in one evening)
DRIFT_WARN = 0.15


@dataclass
class Baseline:
    batch_size: int
    temperature: float
    tok_s: float
    tokens: int
    seconds: float
    steps: int
    c_ar_s: float
    other_cores: float | None = None  # cores other processes kept busy meanwhile (machine.py)
    num_prompts: int = 0  # requests of the run (results.json before it: unknown, 0)
    # the same run again after the cell's configurations (schema 3; 0: not measured)
    tok_s_after: float = 0.0
    c_ar_s_after: float = 0.0

    @property
    def drift(self) -> float | None:
        """How much the autoregressive throughput moved across the cell (after / before - 1);
        None when the run after was not measured."""
        return self.tok_s_after / self.tok_s - 1 if self.tok_s and self.tok_s_after else None

    @property
    def drifted(self) -> bool:
        """The machine changed speed within the cell by more than :data:`DRIFT_WARN`."""
        return self.drift is not None and abs(self.drift) > DRIFT_WARN


@dataclass
class ConfigResult:
    """One row of results.json (keys documented in the module docstring)."""

    method: str
    speculative_config: dict
    k: int
    temperature: float
    batch_size: int
    acceptance_length: float
    acceptance_rate: float
    per_position: list[float]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    draft_coverage: float
    tokens: int
    seconds: float
    tok_s: float
    ar_tok_s: float
    speedup: float
    predicted_speedup: float
    tokens_per_step: float
    cost_draft: float
    cost_verify: float
    c_ar_s: float
    c_step_s: float
    c_draft_s: float
    c_verify_s: float
    c_verify_forward_s: float
    steps: int
    lossless: bool | None
    mismatched_prompts: list[int] = field(default_factory=list)
    num_errors: int = 0
    draft_sample_method: str = "greedy"  # how drafts were made (greedy, or sampled for p/q)
    other_cores: float | None = None  # cores other processes kept busy during the timed run
    num_prompts: int = 0  # requests of the run (results.json before it: unknown, 0)
    speedup_runs: list[float] = field(default_factory=list)  # repeats > 1: each round's ratio

    @property
    def contended(self) -> bool:
        """Whether another process competed for the cores during the timed run."""
        return self.other_cores is not None and self.other_cores > CONTENTION_CORES


@dataclass
class HarnessReport:
    target: str
    settings: dict
    baselines: list[Baseline]
    results: list[ConfigResult]
    advisor: list[dict]
    recommended_k: dict[str, int]
    created: str
    output_dir: str | None = None
    files: dict = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        return all(r.lossless is not False for r in self.results)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HarnessReport":
        """Rebuild a report from results.json (to redraw plots, compare runs ...)."""
        return cls(target=data["target"], settings=dict(data["settings"]),
                   baselines=[Baseline(**b) for b in data["baselines"]],
                   results=[ConfigResult(**r) for r in data["results"]],
                   advisor=list(data["advisor"]), recommended_k=dict(data["recommended_k"]),
                   created=data["created"], files=dict(data.get("files", {})))

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "created": self.created, "target": self.target,
                "settings": self.settings, "baselines": [asdict(b) for b in self.baselines],
                "results": [asdict(r) for r in self.results], "advisor": self.advisor,
                "recommended_k": self.recommended_k, "lossless": self.lossless,
                "files": self.files}
