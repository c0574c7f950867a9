"""What every method's settings share, and the registry that makes them a Hydra config group.

A recipe chooses a method the way it chooses anything else in Hydra, as a group option
(``defaults: [override /drafter: mtp]``; ``drafter=mtp`` on the command line), and the
``objective`` group follows the drafter's choice (conf/train.yaml). Each option is its method's
own dataclass, holding only the keys that method reads, so a key it does not have fails at
compose time with the key and the method named (``drafter.n_predict`` on an EAGLE-3 recipe),
instead of being accepted and ignored. Each field declares its rule and whether a resumed run
must match it (``setting(default, rule, resume=...)``) beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, ClassVar, List, Optional

from infer.foundation.errors import ConfigError
from infer.foundation.registry import Registry
from infer.foundation.validation import (check_choice, check_float, check_int, check_list,
                                         check_str, setting)
from train.choices import DistillLoss, PositionWeights

METHODS: Registry[type["DrafterConfig"]] = Registry(
    "train.methods", "drafter", "train config", "one of {names} (choose it with drafter=NAME)")

# rules the fields name, called as rule(key, value, where=...)
opt_str = partial(check_str, optional=True)
positive_int, opt_positive, opt_nonneg = (partial(check_int, minimum=1),
                                          partial(check_int, minimum=1, optional=True),
                                          partial(check_int, minimum=0, optional=True))
weight, share = partial(check_float, low=0.0), partial(check_float, low=0.0, high=1.0,
                                                        low_open=True)


def choice(choices: type) -> Any:
    return partial(check_choice, choices=choices)


def pinned(default: Any = None, check: Any = None, **kw: Any) -> Any:
    """A method setting: every one of them shapes the drafter or its loss, so a checkpoint
    resumes only under the same value (train/checkpoint.py)."""
    return setting(default, check, resume=True, **kw)


def method_field(name: str) -> Any:
    """``drafter.method`` of the method registered as ``name`` (what the saved config shows)."""
    return pinned(name, check_str)


@dataclass
class DrafterConfig:
    """The ``drafter`` section of every method."""

    method: str = pinned("", check_str)
    """The method (train/methods/, train/objectives/); chosen with drafter=NAME (a config
    group; recipes: defaults: [override /drafter: NAME]), not by setting this key."""
    init_from: Optional[str] = pinned(None, opt_str)
    """Start from an exported checkpoint of this method (mtp: a stitched target)."""

    name: ClassVar[str] = ""  # set by METHODS.register
    objective_config: ClassVar[type["ObjectiveConfig"]]

    def __post_init__(self) -> None:
        if self.name and self.method != self.name:
            raise ConfigError(
                f"drafter.method={self.method!r}: the drafter chosen is {self.name!r}; a method "
                f"is chosen with drafter={self.method} (a config group: recipes say "
                f"defaults: [override /drafter: {self.method}]), which also selects its "
                "objective section and its keys", "drafter.method")

    def draft_vocab(self, target_vocab: int) -> int:
        """Tokens of the draft vocabulary built from the data: the whole vocabulary for a
        method without an LM head of its own over part of it (counted, not used)."""
        return target_vocab

    def model_paths(self) -> dict[str, Optional[str]]:
        """``{key: path}`` of the models this drafter starts from, checked before any work."""
        return {"drafter.init_from": self.init_from}


@dataclass
class HeadDrafterConfig(DrafterConfig):
    """A head over target residual streams with its own LM head over a draft vocabulary
    (EAGLE-3, P-EAGLE, DFlash)."""

    draft_vocab_size: int = pinned(1024, positive_int)
    """LM head over the most frequent training-target tokens."""
    aux_layer_ids: Optional[List[int]] = pinned(None, partial(check_list, item=check_int,
                                                              optional=True))
    """Target residual streams fed to the head (k = the stream after k layers; negative ids
    count from the end: -1 = n, the last layer's output); None: the method's default (eagle3:
    [2, n // 2, n - 3] made valid; dflash: spread over the layers)."""
    num_layers: int = pinned(1, positive_int)
    """Draft decoder layers (dflash's reference uses 5, P-EAGLE 4)."""
    intermediate_size: Optional[int] = pinned(None, opt_positive)
    """The draft layers' MLP width; None: the target's."""

    def draft_vocab(self, target_vocab: int) -> int:
        return min(self.draft_vocab_size, target_vocab)


@dataclass
class ObjectiveConfig:
    """The ``objective`` section every method has (a method without loss settings keeps it
    empty)."""


@dataclass
class DistillConfig(ObjectiveConfig):
    """A loss toward the target's distribution."""

    loss: DistillLoss = pinned(DistillLoss.kl, choice(DistillLoss))
    """The distillation loss toward the target's distribution p (train/objectives/losses.py):
    kl = KL(p||q), rkl = KL(q||p), jsd, ce (p's argmax), tv = 1 - acceptance (sum min(p, q)),
    nla = -log acceptance, lk_hybrid = lambda KL + (1 - lambda) TV, lambda = exp(-3 acceptance)."""


@dataclass
class NoiseConfig(ObjectiveConfig):
    """Objectives over target features, which EAGLE trains with noise on."""

    feature_noise: float = pinned(0.0, weight)
    """Uniform noise amplitude on the target features (EAGLE: 0.1-0.2)."""


@dataclass
class UnrollConfig(NoiseConfig):
    """A training-time-test unroll (train/objectives/ttt.py: EAGLE, EAGLE-3, MTP)."""

    ttt_steps: int = pinned(7, positive_int)
    """Training-time-test unroll length."""
    step_weight: float = pinned(1.0, weight)
    """Step s of the unroll has weight step_weight ** s (EAGLE: 0.8, speculators: 1)."""
    position_weights: PositionWeights = pinned(PositionWeights.geometric,
                                               choice(PositionWeights))
    """geometric (step_weight ** s) or dpace: step s of an anchor weighs
    sum_{m >= s} prod_{j <= m} (0.5 exp(-loss_j) + 0.5) over its valid steps (no gradient)."""


@dataclass
class CodConfig(ObjectiveConfig):
    """Conditional drop-out of copies / depths (PARD, P-EAGLE)."""

    cod_ratio: float = pinned(0.7, share)
    """Copy (depth) i keeps max(cod_ratio ** i, cod_min) of the positions."""
    cod_min: float = pinned(0.2, share)
    """The floor of that fraction."""


def keys_of(cls: type) -> list[str]:
    """The settings of a method's section class, in declaration order."""
    return [f.name for f in fields(cls)]
