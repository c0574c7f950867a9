"""The closed sets of values the training config's keys take (``StrChoice``: a config value
and a string at once), apart from the schema so that it stays short."""

from __future__ import annotations

from infer.foundation.validation import StrChoice


class DataFormat(StrChoice):
    openai = "openai"
    sharegpt = "sharegpt"
    prompt_completion = "prompt_completion"
    text = "text"


class FeatureMode(StrChoice):
    online = "online"
    offline = "offline"


class TargetSharding(StrChoice):
    auto = "auto"
    none = "none"
    fsdp = "fsdp"
    zero3 = "zero3"


class StorageDtype(StrChoice):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Schedule(StrChoice):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Precision(StrChoice):
    auto = "auto"
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


class Device(StrChoice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class LmHeadInit(StrChoice):
    target_rows = "target_rows"
    random = "random"


class WandbMode(StrChoice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class DistillLoss(StrChoice):
    """``objective.loss``: how a draft distribution q is pulled toward the target's p
    (train/objectives/losses.py)."""

    kl = "kl"
    rkl = "rkl"
    jsd = "jsd"
    ce = "ce"
    tv = "tv"
    nla = "nla"
    lk_hybrid = "lk_hybrid"


class PositionWeights(StrChoice):
    """``objective.position_weights``: how the steps of a drafted chain weigh in the loss."""

    geometric = "geometric"  # step s: objective.step_weight ** s (exponential decay)
    dpace = "dpace"  # D-PACE: by how much acceptance still rides on the step (no gradient)


class Optimizer(StrChoice):
    adamw = "adamw"
    muon = "muon"

