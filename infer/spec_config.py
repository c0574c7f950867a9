"""`speculative_config`: vLLM's schema, validated once, so every later stage can trust it.

draftsmith speaks the same `speculative_config` as vLLM, so a drafter trained here runs unchanged
in vLLM and the other way round. This module only validates and normalises the mapping; which
methods the engine can actually serve is decided by the proposer registry (`infer/proposers/`).

Normalisation happens in `__post_init__`, so after construction every config is *resolved*:
`method` is set (inferred from the draft's config.json or name when omitted),
`num_speculative_tokens` is set (from the draft's config.json when it gives one), and the
prompt-lookup pair is filled in. Resolved configs re-validate to themselves, which is what makes
`parse(cfg.to_dict()) == cfg` hold.

Inputs (`SpeculativeConfig.parse`): None (no speculation), a dict, a JSON string (the CLI form),
an OmegaConf DictConfig (the YAML form) or a SpeculativeConfig. Reading a draft's config.json is
plain JSON from a local directory: no remote code, no network; a hub id uses the name rules only.
"""

from __future__ import annotations

import json
import logging
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from infer.draft_config import (VARIANTS, cached_config_path, checkpoint_method, checkpoint_type,
                                 draft_config_path, read_draft_config)
from infer.foundation.errors import ConfigError, MissingFileError
from infer.foundation.validation import check_float, check_int, config_error, reject_unknown_keys
from infer.k_schedule import KEY as SCHEDULE_KEY
from infer.k_schedule import Schedule, k_for_batch, parse_schedule

_WHERE = "speculative_config"
log = logging.getLogger(__name__)

# vLLM's method names. The schema accepts all of them; the engine decides which it serves.
METHODS = ("ngram", "ngram_gpu", "suffix", "draft_model", "eagle", "eagle3", "dflash",
           "dspark", "mlp_speculator", "mtp", "medusa")
REJECTION_SAMPLE_METHODS = ("strict", "probabilistic", "block", "synthetic")  # sampler's
# vLLM's newer spelling: the rejection test "standard" and how drafts are made; "standard" with
# greedy drafts is "strict" (accept with p(x)), with sampled drafts "probabilistic" (the p/q test)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
_REJECTION_SPELLINGS = (*REJECTION_SAMPLE_METHODS, "standard")

_NEEDS_MODEL = ("draft_model", "eagle", "eagle3", "dflash", "dspark", "mlp_speculator",
                "medusa")
# These draft from the context alone: a `model` would be silently ignored, so it is an error.
_NO_MODEL = ("ngram", "ngram_gpu", "suffix")
# vLLM allows parallel drafting for the EAGLE family (MTP is one) and draft models (PARD);
# DFlash and DSpark always draft a block in one forward (vLLM forces it on): the flag is accepted.
_PARALLEL_DRAFTING = ("draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark")
_PROMPT_LOOKUP_DEFAULT = 5
_ADAPTIVE = ("draft_model", "eagle", "eagle3", "dflash", "dspark", "mlp_speculator",
             "mtp")  # the drafters that give confidences
# vLLM 0.32's deprecated per-model names of method "mtp" (a warning, then "mtp")
MTP_ALIASES = (
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp", "inkling_mtp",
    "glm5_next_mtp")
MTP_LAYERS_KEY = "num_nextn_predict_layers"  # a target's MTP layer count (config.json)

# vLLM's per-request sampling keys (a superset of draftsmith's SamplingParams fields): people copy
# them into speculative_config; the error points them at SamplingParams instead.
VLLM_SAMPLING_KEYS = (
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs")
_KEY_HINTS = {k: "it is a sampling parameter (set it in SamplingParams), not a speculative_config "
                 "field" for k in VLLM_SAMPLING_KEYS}
_KEY_HINTS["tensor_parallel_size"] = ("use 'draft_tensor_parallel_size' (draftsmith's engine "
                                      "serves one device, so it can only be 1)")


def _check_choice(key: str, value: Any, where: str, *, choices: tuple[str, ...],
                  optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in choices:
        raise config_error(key, value, f"one of {', '.join(choices)}", where)


def _check_str(key: str, value: Any, where: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        allowed = "a non-empty string" + (" or None" if optional else "")
        raise config_error(key, value, allowed, where)


def _check_bool(key: str, value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise config_error(key, value, "true or false", where)


def _check_num_tokens(key: str, value: Any, where: str) -> None:
    check_int(key, value, where, optional=True)
    if value is not None and value <= 0:  # vLLM's wording, which scripts grep for
        raise config_error(key, value, "an integer > 0 (Expected num_speculative_tokens to be "
                                       "greater than zero)", where)


_TREE_METHODS = ("eagle", "eagle3")  # chain heads whose drafts come with a next-best list

# Type and range of each field on its own; rules between fields are the methods below.
_FIELD_RULES: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    "method": (_check_choice, {"choices": METHODS, "optional": True}),
    "model": (_check_str, {"optional": True}),
    "revision": (_check_str, {"optional": True}),
    "num_speculative_tokens": (_check_num_tokens, {}),
    "draft_tensor_parallel_size": (check_int, {"minimum": 1, "optional": True}),
    "max_model_len": (check_int, {"minimum": 1, "optional": True}),
    "parallel_drafting": (_check_bool, {}),
    "rejection_sample_method": (_check_choice, {"choices": _REJECTION_SPELLINGS}),
    "draft_sample_method": (_check_choice, {"choices": DRAFT_SAMPLE_METHODS, "optional": True}),
    "synthetic_acceptance_rate": (check_float, {"low": 0.0, "high": 1.0, "optional": True}),
    "prompt_lookup_max": (check_int, {"minimum": 1, "optional": True}),
    "prompt_lookup_min": (check_int, {"minimum": 1, "optional": True}),
    "suffix_decoding_max_tree_depth": (check_int, {"minimum": 1}),
    "suffix_decoding_max_cached_requests": (check_int, {"minimum": 0}),  # 0: no global cache
    "suffix_decoding_max_spec_factor": (check_float, {"low": 0.0, "low_open": True}),
    "suffix_decoding_min_token_prob": (check_float, {"low": 0.0, "high": 1.0}),
    "draft_tree_siblings": (check_int, {"minimum": 0}),
    "draft_tree_max_batch": (check_int, {"minimum": 1}),
    "speculative_token_map": (_check_str, {"optional": True}),
    "use_heterogeneous_vocab": (_check_bool, {}),
    "enable_adaptive_verification": (_check_bool, {}),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, resolved and validated (see the module docstring).

    Frozen: change a field with `dataclasses.replace`, which validates again.
    """

    method: str | None = None  # inferred when omitted
    model: str | None = None  # draft checkpoint: local directory or hub id
    num_speculative_tokens: int | None = None  # k; defaulted from the draft's config.json
    draft_tensor_parallel_size: int | None = None  # 1 only: draftsmith's engine is TP=1
    max_model_len: int | None = None  # draft context; <= target's (`for_target`)
    revision: str | None = None  # draft checkpoint revision on the hub
    parallel_drafting: bool = False  # PARD = draft_model + parallel_drafting
    rejection_sample_method: str = "standard"  # resolved: strict / probabilistic / synthetic
    draft_sample_method: str | None = None  # greedy / probabilistic; None: the rejection's
    synthetic_acceptance_rate: float | None = None  # required with, and only with, synthetic
    prompt_lookup_max: int | None = None  # ngram; 5 / 5 when both omitted, else mirrored
    prompt_lookup_min: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draftsmith's own (vLLM has no trees since 0.21): greedy batches of eagle / eagle3 chains
    # verify each draft's next-best head tokens beside it (infer/draft_tree.py); 0 = a chain
    draft_tree_siblings: int = 0
    # a step with more running requests keeps the chain: the tree's larger verify forward pays
    # where verify tokens are nearly free (on the CPU: batch <= 2; docs/benchmarks-history.md)
    draft_tree_max_batch: int = 2
    # draftsmith's own (SGLang's key; vLLM has none): a JSON file {"token_ids": [...]}; an eagle3
    # head drafting greedily computes logits over those of its draft tokens only (FR-Spec)
    speculative_token_map: str | None = None
    # vLLM main (2026): [[start_bs, end_bs, k], ...], each step's k by its batch (k_schedule.py)
    num_speculative_tokens_per_batch_size: Schedule | None = None
    # vLLM main (2026): a draft_model with another tokenizer, greedy drafts over the two
    # vocabularies' intersection (infer/vocab_bridge.py)
    use_heterogeneous_vocab: bool = False
    # vLLM main (2026): each step verifies the prefix of each row's drafts that pays, from the
    # drafter's confidences and measured costs (infer/adaptive.py)
    enable_adaptive_verification: bool = False

    def __post_init__(self) -> None:
        if self.method in MTP_ALIASES:
            log.warning("method `%s` is deprecated and replaced with mtp.", self.method)
            self._set("method", "mtp")
        for key, (check, kwargs) in _FIELD_RULES.items():
            check(key, getattr(self, key), _WHERE, **kwargs)
            if check is check_float and getattr(self, key) is not None:
                self._set(key, float(getattr(self, key)))
        self._set(SCHEDULE_KEY, parse_schedule(getattr(self, SCHEDULE_KEY), _WHERE))
        self._resolve_prompt_lookup()
        path = draft_config_path(self.model) if self.model is not None else None
        draft = read_draft_config(path) if path else {}
        if self.method is None:
            self._set("method", _infer_method(self.model, draft, path))
        _check_method_fits(self.method, draft, path)
        variant = VARIANTS.get(checkpoint_type(draft))  # e.g. peagle: eagle3 + parallel
        if variant is not None:
            self._set("parallel_drafting", variant[1])
        self._check_model()
        if self.method == "mtp":
            self._resolve_mtp(draft, path)
        elif self.num_speculative_tokens is None:
            self._set("num_speculative_tokens", self._num_tokens_from_draft(draft, path))
        self._check_parallel_drafting()
        self._check_tree()
        self._resolve_sampling()
        self._resolve_token_map()
        self._check_rejection()
        self._check_heterogeneous_vocab()
        self._check_adaptive()
        if self.draft_tensor_parallel_size not in (None, 1):
            raise config_error("draft_tensor_parallel_size", self.draft_tensor_parallel_size,
                               "1 or None (draftsmith's engine runs target and drafter on one "
                               "device; vLLM also accepts the target's tensor_parallel_size)",
                               _WHERE)

    def k_for_batch(self, batch_size: int) -> int:
        """This step's k for ``batch_size`` running requests (the schedule, else k)."""
        return k_for_batch(self.num_speculative_tokens_per_batch_size, batch_size,
                           self.num_speculative_tokens or 0)

    @property
    def tree_columns(self) -> int:
        """Target cache columns a draft tree's siblings take past the verified tokens' (k * S:
        the tree verifies them all, then keeps at most k + 1 tokens)."""
        return (self.num_speculative_tokens or 0) * self.draft_tree_siblings

    def _set(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)  # frozen; only __post_init__ resolves fields

    def _resolve_prompt_lookup(self) -> None:
        """vLLM's rule: both omitted -> 5 / 5; one given -> the other mirrors it."""
        hi, lo = self.prompt_lookup_max, self.prompt_lookup_min
        if hi is None and lo is None:
            hi = lo = _PROMPT_LOOKUP_DEFAULT
        hi, lo = (lo if hi is None else hi), (hi if lo is None else lo)
        if lo > hi:
            raise config_error("prompt_lookup_min", lo,
                               f"an integer <= prompt_lookup_max ({hi})", _WHERE)
        self._set("prompt_lookup_max", hi)
        self._set("prompt_lookup_min", lo)

    def _check_model(self) -> None:
        if self.method in _NEEDS_MODEL and self.model is None:
            raise config_error("model", None, f"a draft model path or hub id; method "
                                              f"{self.method!r} needs one", _WHERE)
        if self.method in _NO_MODEL and self.model is not None:
            raise config_error("model", self.model, f"None; method {self.method!r} drafts from "
                                                    "the context and loads no model", _WHERE)

    def _num_tokens_from_draft(self, draft: dict[str, Any], path: Path | None) -> int:
        """k from the drafter's own config (docs/reference.md §1, §5); otherwise the user must
        give it."""
        spec = draft.get("speculators_config")
        if isinstance(spec, dict):
            proposals = spec.get("proposal_methods")
            first = proposals[0] if isinstance(proposals, list) and proposals else {}
            name = "speculators_config.proposal_methods[0].speculative_tokens"
            value = first.get("speculative_tokens") if isinstance(first, dict) else None
        elif draft.get("model_type") == "mlp_speculator":
            name, value = "n_predict", draft.get("n_predict")
        else:
            value = None
        if value is None:
            raise config_error("num_speculative_tokens", None, "an integer > 0; required for "
                               f"method {self.method!r} unless the draft's config.json gives it "
                               "(mlp_speculator n_predict, speculators speculative_tokens)", _WHERE)
        check_int(name, value, f"{_WHERE}: draft config {path}", minimum=1)
        return value

    def _resolve_mtp(self, draft: dict[str, Any], path: Path | None) -> None:
        """vLLM's rules for ``mtp``, whose draft is the target itself (``model``; None until the
        engine fills in its target): the target must declare MTP layers (vLLM fails late and
        obscurely without them); k defaults to their number ``n``; a larger k must be a
        multiple of ``n`` (the layers run again on their own outputs)."""
        if self.model is None:
            return  # LLM.__init__ resolves it against the loaded target
        if path is None:  # a hub id: the target's config.json from the local cache, if there
            path = cached_config_path(self.model)
            if path is None:
                raise ConfigError(f"{_WHERE}: method 'mtp' reads the target's {MTP_LAYERS_KEY} "
                                  f"from its config.json, but model={self.model!r} is neither "
                                  "a local model directory nor a hub id in the local Hugging "
                                  "Face cache")
            draft = read_draft_config(path)
        n = draft.get(MTP_LAYERS_KEY) or 0
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"{_WHERE}: method 'mtp' needs a target with native MTP layers, "
                              f"but {path} declares none ({MTP_LAYERS_KEY}: "
                              f"{draft.get(MTP_LAYERS_KEY)!r}); train a drafter for it instead "
                              "(eagle3, draft_model ...)")
        k = self.num_speculative_tokens
        if k is None:
            self._set("num_speculative_tokens", n)
        elif k > n and k % n:
            raise config_error("num_speculative_tokens", k, f"at most {n} or a multiple of {n} "
                               f"(the target's {MTP_LAYERS_KEY})", _WHERE)
        if self.num_speculative_tokens > 1:  # vLLM's warning
            log.warning("Enabling num_speculative_tokens > 1 will run multiple times of forward "
                        "on same MTP layer, which may result in lower acceptance rate")

    def _check_parallel_drafting(self) -> None:
        if self.parallel_drafting and self.method not in _PARALLEL_DRAFTING:
            raise config_error("parallel_drafting", True,
                               f"false for method {self.method!r}; parallel drafting needs one of "
                               f"{', '.join(_PARALLEL_DRAFTING)} (PARD is draft_model + "
                               "parallel_drafting)", _WHERE)

    def _check_tree(self) -> None:
        chain = self.method in _TREE_METHODS and not self.parallel_drafting
        if self.draft_tree_siblings and not chain:
            raise config_error("draft_tree_siblings", self.draft_tree_siblings,
                               f"0 for method {self.method!r}; sibling trees need a chain head: "
                               f"{', '.join(_TREE_METHODS)} without parallel_drafting", _WHERE)

    def _resolve_token_map(self) -> None:
        """``speculative_token_map``: an eagle3 head's (chain or parallel) only; a relative path
        that is not there is looked up in the draft's directory (where draftsmith's export
        writes ``speculative_token_map.json``). Sampled drafts ignore it: the p/q test needs
        the head's whole distribution, whose rare tokens are what a sampled target draws."""
        value = self.speculative_token_map
        if value is None:
            return
        if self.method != "eagle3":
            raise config_error("speculative_token_map", value, f"None for method "
                               f"{self.method!r}; a token map restricts an eagle3 head's draft "
                               "vocabulary", _WHERE)
        path = Path(value)
        local = Path(self.model) / value if self.model and not path.is_absolute() else None
        if not path.is_file() and local is not None and local.is_file():
            path = local
        if not path.is_file():
            raise MissingFileError(f"{_WHERE}: speculative_token_map {value!r} is not a file "
                                   "(JSON {\"token_ids\": [...]}; a relative path is also "
                                   f"looked up in the draft directory {self.model!r})")
        self._set("speculative_token_map", str(path))

    def _resolve_sampling(self) -> None:
        """vLLM's two spellings, one meaning. Drafts are sampled from the drafter (and the p/q test
        runs: ``probabilistic``) or taken greedily (accepted with probability p(x): ``strict``).
        ``standard`` + ``draft_sample_method`` is the newer spelling of the same two; without a
        draft method it is ``strict`` with greedy drafts, vLLM's default. Greedy drafts under
        ``probabilistic`` are ``strict`` (a one-hot draft distribution: the same law)."""
        rejection, drafts = self.rejection_sample_method, self.draft_sample_method
        if rejection == "strict" and drafts == "probabilistic":
            raise config_error("draft_sample_method", drafts, "'greedy' or None with "
                               "rejection_sample_method 'strict' (it accepts a draft with "
                               "probability p(x) and never reads the draft distribution); use "
                               "'probabilistic' or 'standard' for sampled drafts", _WHERE)
        if rejection in ("synthetic", "block"):  # block: q from sampled drafts, else one-hot
            drafts = drafts or "greedy"
        elif rejection in ("standard", "probabilistic") and drafts is None:
            drafts = "greedy" if rejection == "standard" else "probabilistic"
        elif drafts is None:
            drafts = "greedy"
        if rejection not in ("synthetic", "block"):
            rejection = "probabilistic" if drafts == "probabilistic" else "strict"
        self._set("rejection_sample_method", rejection)
        self._set("draft_sample_method", drafts)

    def _check_heterogeneous_vocab(self) -> None:
        """vLLM's rule: a sequential draft model drafting greedily (sampled drafts would need
        the draft's distribution over the target's vocabulary, which it does not have)."""
        if not self.use_heterogeneous_vocab:
            return
        if self.method != "draft_model" or self.parallel_drafting:
            raise config_error("use_heterogeneous_vocab", True, "false unless method is "
                               "'draft_model' without parallel_drafting", _WHERE)
        if self.draft_sample_method != "greedy":
            raise config_error("draft_sample_method", self.draft_sample_method, "'greedy' with "
                               "use_heterogeneous_vocab (drafts over another vocabulary are "
                               "greedy only)", _WHERE)

    def _check_adaptive(self) -> None:
        """Adaptive verification ranks drafts by a drafter's confidence: model drafters' chains
        and blocks, not lookups (no distribution) nor sibling trees (their own greedy step)."""
        if not self.enable_adaptive_verification:
            return
        if self.method not in _ADAPTIVE or self.draft_tree_siblings:
            raise config_error("enable_adaptive_verification", True, "false unless method is "
                               f"one of {', '.join(_ADAPTIVE)} without draft_tree_siblings",
                               _WHERE)

    def _check_rejection(self) -> None:
        synthetic = self.rejection_sample_method == "synthetic"
        rate = self.synthetic_acceptance_rate
        if synthetic and rate is None:
            raise config_error("synthetic_acceptance_rate", None, "a number in [0, 1]; required "
                               "when rejection_sample_method is 'synthetic'", _WHERE)
        if not synthetic and rate is not None:
            raise config_error("synthetic_acceptance_rate", rate, "None unless "
                               "rejection_sample_method is 'synthetic' (it is "
                               f"{self.rejection_sample_method!r})", _WHERE)

    # ---- construction and export ---------------------------------------------------------

    @classmethod
    def parse(cls, obj: Any) -> SpeculativeConfig | None:
        """Any accepted input form -> a resolved config, or None when speculation is off."""
        if obj is None or isinstance(obj, SpeculativeConfig):
            return obj
        if isinstance(obj, str):
            try:
                decoded = json.loads(obj)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{_WHERE}: not valid JSON ({e}): {obj[:200]!r}") from None
            if isinstance(decoded, str):
                raise ConfigError(f"{_WHERE}: the JSON string holds a string {decoded!r}; "
                                 "expected a JSON object")
            return cls.parse(decoded)
        if isinstance(obj, DictConfig):
            obj = OmegaConf.to_container(obj, resolve=True)
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{_WHERE}: invalid value {obj!r} of type {type(obj).__name__}; "
                             "expected a mapping, a JSON object string, a DictConfig or None")
        reject_unknown_keys(obj, [f.name for f in fields(cls)], _WHERE, _KEY_HINTS)
        return cls(**obj)

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        """Fields that differ from their defaults (what a user writes, portable to vLLM), or
        every field with `full=True`. Either way `parse(cfg.to_dict()) == cfg`."""
        implied_drafts = "probabilistic" if self.rejection_sample_method == "probabilistic" \
            else "greedy"  # what the rejection method gives when no draft method is written
        resolved_defaults = {"prompt_lookup_max": _PROMPT_LOOKUP_DEFAULT,
                             "prompt_lookup_min": _PROMPT_LOOKUP_DEFAULT,
                             "draft_sample_method": implied_drafts,
                             "rejection_sample_method": "strict"}
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if full or getattr(self, f.name) != resolved_defaults.get(f.name, f.default)}
        if "prompt_lookup_max" in out or "prompt_lookup_min" in out:  # one alone would mirror
            out["prompt_lookup_max"] = self.prompt_lookup_max
            out["prompt_lookup_min"] = self.prompt_lookup_min
        return out

    def to_json(self, full: bool = False) -> str:
        return json.dumps(self.to_dict(full=full))

    def for_target(self, target_path: str, target_max_model_len: int) -> SpeculativeConfig:
        """This config resolved against the loaded target, once, before an engine uses it: the
        draft of ``mtp`` is the target itself (vLLM), and the draft's context is checked
        against the target's and set (unset: the target's). Nothing downstream re-checks."""
        if self.max_model_len is not None and self.max_model_len > target_max_model_len:
            raise config_error("max_model_len", self.max_model_len, "an integer <= the target's "
                               f"max_model_len ({target_max_model_len})", _WHERE)
        model = target_path if self.method == "mtp" and self.model is None else self.model
        return dataclasses.replace(self, model=model,
                                   max_model_len=self.max_model_len or target_max_model_len)


def _check_method_fits(method: str, draft: dict[str, Any], path: Path | None) -> None:
    """A checkpoint served under another method fails later with a misleading shape or key
    error (an EAGLE-3 head read as EAGLE-1 blames the target's config), so say it here."""
    declared = checkpoint_method(draft)
    if declared is not None and declared != method:
        raise ConfigError(f"{_WHERE}: method {method!r} does not fit the checkpoint {path}: its "
                          f"config.json declares a {declared!r} drafter; use method "
                          f"{declared!r} (or omit method to infer it)")


def _infer_method(model: str | None, draft: dict[str, Any], path: Path | None) -> str:
    """vLLM's order: speculators type, then draft model_type, then the name, then draft_model."""
    if model is None:
        raise config_error("method", None, f"one of {', '.join(METHODS)}, or a 'model' to infer "
                                           "it from (both 'method' and 'model' are missing)",
                           _WHERE)
    kind = checkpoint_method(draft)
    if kind is not None:
        _check_choice("speculators_model_type", kind, f"{_WHERE}: draft config {path}",
                      choices=METHODS)
        return kind
    path_obj = Path(model)  # the checkpoint's own name, not the directories above it
    name = (path_obj.parent.name if path_obj.suffix == ".json" else path_obj.name).lower()
    if "eagle3" in name:
        return "eagle3"
    return "eagle" if "eagle" in name else "draft_model"
