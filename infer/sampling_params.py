"""``SamplingParams``: per-request sampling settings with vLLM's names, and their validation.

Torch-free on purpose: the same dataclass is the ``sampling`` node of ``python infer.py``'s typed
config (``infer/config.py``), so Hydra knows every key (``sampling.top_p=0.9`` needs no ``+``, a
misspelt key is refused by name at compose time), ``--help`` prints the attribute docstrings
below, and loading the config does not import torch. The sampling functions that use these
settings are in ``infer/sampling.py``, which re-exports this class.

Validation runs on construction and again in ``LLM.generate`` (``validate``), because a
dataclass can be changed after it was built (``p.temperature = -1``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf

from infer.spec_config import SpeculativeConfig
from infer.foundation.validation import check_float, check_int, config_error, reject_unknown_keys

_WHERE = "SamplingParams"


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM names). temperature 0 means greedy."""

    temperature: float = 1.0
    """0: greedy (argmax); > 0: logits are divided by it before top-k / top-p and sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose mass reaches top_p; 1: off."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 or -1: off."""
    max_tokens: int = 16
    """Tokens to generate at most (fewer when a stop token or max_model_len comes first)."""
    min_tokens: int = 0
    """Stop tokens (EOS, stop_token_ids) are suppressed until this many tokens are generated."""
    seed: Optional[int] = None
    """The request's own random stream (its samples then do not depend on the rest of the
    batch); None: the engine's generator."""
    stop: List[str] = field(default_factory=list)
    """Strings that end the request (vLLM's ``stop``): the output stops at the first token that
    completes one, and the text is cut before it (infer/detokenize.py). A single string is
    taken as a list of one. Needs a tokenizer."""
    stop_token_ids: List[int] = field(default_factory=list)
    """Token ids that end the request (kept in the output), besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (until max_tokens or a stop_token_ids token)."""
    n: int = 1
    """Completions per prompt; only 1 is supported."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ``ConfigError`` naming the first invalid field, its value and what is
        allowed. Called on construction and by ``LLM.generate`` for every request, so values set
        after construction are checked before they reach the sampler."""
        check_float("temperature", self.temperature, _WHERE, low=0.0)
        if not math.isfinite(self.temperature):  # logits / inf is 0 (or nan on masked logits)
            raise config_error("temperature", self.temperature, "a finite number >= 0", _WHERE)
        check_float("top_p", self.top_p, _WHERE, low=0.0, high=1.0, low_open=True)
        check_int("top_k", self.top_k, _WHERE, minimum=-1)
        check_int("max_tokens", self.max_tokens, _WHERE, minimum=1)
        check_int("min_tokens", self.min_tokens, _WHERE, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise config_error("min_tokens", self.min_tokens,
                               f"an integer <= max_tokens ({self.max_tokens})", _WHERE)
        check_int("seed", self.seed, _WHERE, optional=True)
        self._check_stop()
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids):
            raise config_error("stop_token_ids", self.stop_token_ids,
                               "a list of non-negative token ids", _WHERE)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise config_error("ignore_eos", self.ignore_eos, "true or false", _WHERE)
        check_int("n", self.n, _WHERE)
        if self.n != 1:
            raise config_error("n", self.n, "1 (one output per prompt is supported)", _WHERE)

    def _check_stop(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise config_error("stop", self.stop, "a string or a list of non-empty strings",
                               _WHERE)
        self.stop = list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @classmethod
    def from_dict(cls, obj: dict[str, Any] | DictConfig | SamplingParams | None
                  ) -> "SamplingParams":
        """Build from a mapping (or copy an instance: the typed config's ``sampling`` node),
        rejecting unknown keys by name (speculative keys get a hint); the one validation path
        of every configured SamplingParams."""
        if isinstance(obj, SamplingParams):
            # vars, not asdict: Hydra's ``+sampling.topp=1`` reaches OmegaConf.to_object's
            # instance as an extra attribute, which must be refused, not dropped
            obj = dict(vars(obj))
        if isinstance(obj, DictConfig):  # dict() would keep ListConfig values
            obj = OmegaConf.to_container(obj, resolve=True)
        obj = dict(obj or {})
        hints = {f.name: "it belongs in speculative_config, not in the sampling parameters"
                 for f in fields(SpeculativeConfig)}
        reject_unknown_keys(obj, [f.name for f in fields(cls)], _WHERE, hints)
        return cls(**obj)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
