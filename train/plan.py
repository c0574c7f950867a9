"""``python train.py ... plan=true``: what a run will cost, printed before anything is spent.

A big run (an 8B target, 100k examples, an offline cache) costs hours and terabytes; most of its
cost follows from the config and the target's ``config.json`` alone, so the plan reads nothing
else: no weights, no dataset, no regeneration. Every number is a pure function of its inputs
(below), so each can be checked by hand.

What is exact and what is a bound:

- examples: ``data.num_examples`` (capped by ``regenerate.num_examples`` when regenerating) is the
  most the data step keeps; a smaller source, skipped rows and packing only lower it.
- packed rows <= examples: each example is cut to ``data.max_length`` and packing only merges
  (chat templates that split a conversation per turn make one example per assistant turn; the
  bound then counts conversations, not turns). tokens = rows x ``data.max_length``: every packed
  row has exactly that length (padding included), and the offline cache stores padding too.
  So tokens, steps and cache bytes are upper bounds; the real run prints the exact counts, and
  ``check_cache_fits`` re-checks the disk on the exact rows before the cache is filled.
- steps: the trainer's own ``Plan.of`` (train/schedule.py) on ``ceil(ceil(rows /
  micro_batch_size) / world_size)`` micro-batches per rank; world size from ``WORLD_SIZE``
  (set by ``accelerate launch`` / torchrun), else 1.
- offline cache bytes (train/features.py's layout, matched exactly): per packed row and token,
  ``aux`` holds ``len(aux_layer_ids) * H`` values and ``hidden`` ``H`` (when the objective's
  ``feature_spec`` asks for each), in ``features.dtype``; plus at most ``SHARD_HEADER_BYTES`` of
  safetensors header per shard of ``features.rows_per_shard`` rows.
- GPU memory per rank of the frozen target (online: every step with ``micro_batch_size`` rows;
  offline: while the cache fills, ``features.batch_size`` rows) = weights (sharded by
  ``target.sharding``: a rank's share plus the gathered layers) + captured features + forward
  transient, see ``target_memory``. The drafter, its optimizer state and activations are
  not included (they are small beside an 8B target, and depend on the method).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from infer.foundation.errors import NoSpaceError
from infer.models.llama import ModelConfig
from infer.models.output import FeatureSpec
from train.config import FeatureMode, TargetSharding, TrainConfig, TrainerConfig
from train.real.targets import local_target
from train.schedule import Plan
from train.frozen_target import resolve_sharding

log = logging.getLogger(__name__)

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARD_HEADER_BYTES = 64 * 1024  # safetensors JSON header of one shard (fingerprint: ~1-4 KB)
GIB = 1024 ** 3


@dataclass(frozen=True)
class TargetMemory:
    """GPU bytes of the frozen target on one rank (``target_memory``)."""

    weights: int  # parameters x bytes of target.dtype
    captured: int  # the feature streams of one batch
    forward: int  # the transient of one decoder layer's forward (no KV cache, no grad)
    batch: int  # rows per forward the estimate is for
    shards: int = 1  # ranks the target is sharded over (target.sharding); 1 = whole on each

    @property
    def total(self) -> int:
        return self.weights + self.captured + self.forward


@dataclass(frozen=True)
class RunPlan:
    """What a run will cost (module doc: which numbers are exact, which upper bounds)."""

    target: str  # the directory (or hub id) whose config.json was read
    parameters: int  # of the target
    examples: int  # at most this many examples
    rows: int  # packed rows (upper bound)
    seq_len: int  # tokens per packed row (data.max_length)
    world_size: int
    steps: Plan  # optimizer steps: total, per epoch, warmup
    rows_per_step: int  # micro_batch_size x grad_accum x world_size
    mode: FeatureMode
    spec: FeatureSpec | None  # None: the method cannot say before its drafter is built
    hidden_size: int
    features_dtype: str
    cache_dir: Path
    cache_bytes: int  # offline cache (0 online / no features)
    free_bytes: int  # on the filesystem that would hold cache_dir
    target_dtype: str
    memory: TargetMemory

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len

    @property
    def streams(self) -> int:
        return feature_streams(self.spec)


# ---- pure functions --------------------------------------------------------------------------

def count_parameters(c: ModelConfig) -> int:
    """The target's parameters from its config: embedding, per layer q / k / v / o (GQA: k and v
    have ``num_kv_heads * head_dim`` outputs) with their biases, q/k norms (Qwen3), the three
    MLP matrices (gate, up, down) and two RMSNorms; the final norm; the LM head unless tied."""
    h, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.intermediate_size
    attn = h * q + 2 * h * kv + q * h
    attn += (q + 2 * kv) * c.qkv_bias + h * c.o_bias + 2 * c.head_dim * c.qk_norm
    mlp = 3 * h * i + (2 * i + h) * c.mlp_bias
    layer = attn + mlp + 2 * h
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.vocab_size * h + c.num_layers * layer + h + head


def feature_streams(spec: FeatureSpec | None) -> int:
    """[T, H]-sized streams per row the spec captures: one per aux layer, one for hidden."""
    return 0 if spec is None else len(spec.aux_layer_ids) + int(spec.hidden)


def cache_bytes(rows: int, seq_len: int, spec: FeatureSpec | None, hidden_size: int,
                dtype: str, rows_per_shard: int) -> int:
    """Bytes of the offline cache (train/features.py): ``aux [n, T, len(ids) * H]`` and ``hidden
    [n, T, H]`` in ``dtype`` per shard, the greedy tokens ``[n, T]`` (int32) when the spec asks,
    plus each shard's header; 0 when nothing is captured."""
    streams = feature_streams(spec)
    if not streams or not rows:
        return 0
    shards = math.ceil(rows / rows_per_shard)
    greedy = rows * seq_len * 4 * int(bool(spec and spec.greedy))
    return (rows * seq_len * streams * hidden_size * BYTES[dtype] + greedy
            + shards * SHARD_HEADER_BYTES)


def sharded_weights(c: ModelConfig, shards: int) -> int:
    """Parameters one rank holds of a target sharded over ``shards`` ranks (``target.sharding``):
    its ``1/shards`` of every tensor, plus what is gathered while it runs: the root unit
    (embedding and LM head; FSDP keeps it gathered for the whole forward) and two decoder layers
    (the running one and the prefetched next)."""
    total = count_parameters(c)
    root = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    layer = (total - root - c.hidden_size) // c.num_layers
    return math.ceil(total / shards) + root + 2 * layer


def target_memory(c: ModelConfig, spec: FeatureSpec | None, batch: int, seq_len: int,
                  dtype: str, shards: int = 1) -> TargetMemory:
    """GPU bytes of the frozen target capturing features of ``batch`` rows of ``seq_len``.

    weights = ``count_parameters`` x bytes (sharded over ``shards`` > 1 ranks:
    ``sharded_weights`` x bytes). captured = B x T x H x (2 x aux + hidden) x bytes
    (``capture`` concatenates the aux streams: list and result coexist). forward = the largest
    transient of one decoder layer without KV cache or autograd: B x T x (2H residual + normed,
    (heads + 2 kv_heads) x head_dim q/k/v, heads x head_dim attention output, 3I gate / up /
    product) x bytes, plus the attention scores B x heads x T^2 x bytes (an upper bound: the
    math kernel materialises them, fused kernels do not), plus the boolean document masks
    B x T^2 x (1 + heads / kv_heads) (the mask and its grouped-query copy), plus the logits at
    one position B x vocab x bytes."""
    item, b, t, h = BYTES[dtype], batch, seq_len, c.hidden_size
    aux = len(spec.aux_layer_ids) if spec else 0
    captured = b * t * h * (2 * aux + int(bool(spec and spec.hidden))) * item
    acts = 2 * h + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim \
        + 3 * c.intermediate_size
    forward = (b * t * acts * item + b * c.num_heads * t * t * item
               + b * t * t * (1 + c.num_heads // c.num_kv_heads) + b * c.vocab_size * item)
    weights = count_parameters(c) if shards <= 1 else sharded_weights(c, shards)
    return TargetMemory(weights * item, captured, forward, batch, shards)


def optimizer_steps(rows: int, tcfg: TrainerConfig, world_size: int) -> Plan:
    """The trainer's budget (train/trainer.py ``_prepare``): micro-batches of ``micro_batch_size``
    rows split over ``world_size`` ranks, ``grad_accum`` per step; max_steps overrides epochs."""
    batches = math.ceil(rows / tcfg.micro_batch_size)
    return Plan.of(tcfg, math.ceil(batches / world_size))


def world_size(env=None) -> int:
    """Processes of the run: ``WORLD_SIZE`` (accelerate launch / torchrun), else 1."""
    value = (os.environ if env is None else env).get("WORLD_SIZE", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else 1


def example_bound(cfg: TrainConfig) -> int:
    """The most examples the data step keeps (regeneration keeps only its first N)."""
    n = cfg.data.num_examples
    if cfg.regenerate.enabled and cfg.regenerate.num_examples is not None:
        n = min(n, cfg.regenerate.num_examples)
    return n


def feature_cache_dir(cfg: TrainConfig) -> Path:
    """``features.cache_dir`` or the run's default (train/pipeline.py ``feature_source``)."""
    return Path(cfg.features.cache_dir or cfg.run_dir / "features")


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes of the filesystem that holds ``path`` (its nearest existing parent)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check_cache_fits(cache_dir: str | os.PathLike, needed: int, free: int, dtype: str,
                     note: str = "") -> None:
    """Refuse an offline cache the disk cannot hold, before hours of target forwards fill it."""
    if needed > free:
        half = ", features.dtype=bfloat16" if BYTES[str(dtype)] > 2 else ""
        raise NoSpaceError(
            f"features.cache_dir={str(cache_dir)!r}: the offline feature cache needs "
            f"{needed / GIB:.2f} GiB ({needed} bytes{note}) but only {free / GIB:.2f} GiB "
            f"({free} bytes) are free there; set features.cache_dir on a larger disk, or lower "
            f"data.num_examples / data.max_length{half}, or use features.mode=online")


def cached_shard_bytes(cache_dir: str | os.PathLike) -> int:
    """Bytes of the shards already in ``cache_dir`` (a resumed cache keeps them)."""
    return sum(p.stat().st_size for p in Path(cache_dir).glob("shard_*.safetensors"))


def target_dtype(cfg: TrainConfig) -> str:
    """``target.dtype``; auto as ``FrozenTarget`` resolves it: float32 on CPU, else bfloat16."""
    dtype = str(cfg.target.dtype)
    if dtype == "auto":
        return "float32" if str(cfg.trainer.device) == "cpu" else "bfloat16"
    return dtype


# ---- the plan of a config --------------------------------------------------------------------

def read_target_config(cfg: TrainConfig) -> tuple[str, ModelConfig]:
    """The target's ``ModelConfig`` from its config.json alone: a local directory, a hub id in
    the local cache, else that one file downloaded; the embedded default is built if missing
    (it is small, and its shape exists only once built)."""
    from infer.foundation.errors import MissingFileError
    from infer.foundation.files import read_json
    from infer.models.loader import resolve_model_dir
    from infer.models.foreign import sizes_from_hf, target_config

    path = local_target(cfg.target.path)
    if path is None:
        from train.tiny.build import ensure_tiny_target

        path = str(ensure_tiny_target())
    try:
        return path, target_config(resolve_model_dir(path, key="target.path"))
    except MissingFileError:
        if Path(path).is_absolute() or path.startswith(".") or Path(path).exists():
            raise
    from huggingface_hub import hf_hub_download

    try:
        file = hf_hub_download(path, "config.json")
    except Exception as err:  # offline and not cached, gated, typo ...
        raise MissingFileError(f"target.path={path!r}: not a local directory and its config.json "
                               f"could not be downloaded ({type(err).__name__}: {err})") from None
    return path, sizes_from_hf(read_json(Path(file)), file)


def _sharded_note(m: TargetMemory) -> str:
    return "" if m.shards == 1 else f"; 1/{m.shards} each + gathered layers, target.sharding"


def make_plan(cfg: TrainConfig, env=None) -> RunPlan:
    """The plan of ``cfg`` (module doc); ``env``: the environment holding ``WORLD_SIZE``."""
    from train.objectives.base import OBJECTIVES

    target, config = read_target_config(cfg)
    spec = OBJECTIVES.get(cfg.drafter.method).planned_feature_spec(cfg, config)
    f, rows, seq_len, world = cfg.features, example_bound(cfg), cfg.data.max_length, world_size(env)
    offline = f.mode == FeatureMode.offline
    sharded = resolve_sharding(cfg.target.sharding, world, os.environ if env is None else env)
    shards = world if sharded != TargetSharding.none else 1
    cache = feature_cache_dir(cfg)
    nbytes = cache_bytes(rows, seq_len, spec, config.hidden_size, f.dtype,
                         f.rows_per_shard) if offline else 0
    t = cfg.trainer
    return RunPlan(
        target=target, parameters=count_parameters(config), examples=rows, rows=rows,
        seq_len=seq_len, world_size=world, steps=optimizer_steps(rows, t, world),
        rows_per_step=t.micro_batch_size * t.grad_accum * world, mode=f.mode, spec=spec,
        hidden_size=config.hidden_size, features_dtype=str(f.dtype), cache_dir=cache,
        cache_bytes=nbytes, free_bytes=free_bytes(cache), target_dtype=target_dtype(cfg),
        memory=target_memory(config, spec, f.batch_size if offline else t.micro_batch_size,
                             seq_len, target_dtype(cfg), shards))


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _features_line(plan: RunPlan, method: str) -> str:
    spec = plan.spec
    if spec is None:
        return f"{method}: not known before its drafter is built (sizes below omit them)"
    if not spec.needs_target:
        return f"{method}: none (the objective needs no target features)"
    parts = ([f"aux {list(spec.aux_layer_ids)}"] if spec.aux_layer_ids else []) + (
        ["hidden"] if spec.hidden else [])
    return (f"{method}: {' + '.join(parts)} = {plan.streams} stream(s) x {plan.hidden_size} "
            f"per token, {plan.mode}")


def format_plan(plan: RunPlan, cfg: TrainConfig) -> str:
    """The plan as a short table with units ("<=": an upper bound, module doc)."""
    s, m, t = plan.steps, plan.memory, cfg.trainer
    budget = (f"trainer.max_steps={t.max_steps}" if t.max_steps
              else f"{t.epochs:g} epoch(s) x {s.per_epoch}/epoch")
    if plan.mode != FeatureMode.offline:
        cache = "- (features.mode=online: computed in every step)"
    else:
        have = cached_shard_bytes(plan.cache_dir)
        cache = (f"<= {_gib(plan.cache_bytes)} {plan.features_dtype} in {plan.cache_dir} "
                 f"({_gib(plan.free_bytes)} free" + (f", {_gib(have)} already cached)"
                                                      if have else ")"))
    when = "per step" if plan.mode != FeatureMode.offline else "while the cache fills"
    rows = [
        ("target", f"{plan.target} ({plan.parameters / 1e9:.2f} B parameters)"),
        ("data", f"<= {plan.examples:,} examples -> <= {plan.rows:,} rows x {plan.seq_len} "
                 f"= <= {plan.tokens / 1e6:.2f} M tokens"),
        ("steps", f"{'' if t.max_steps else '<= '}{s.total:,} optimizer steps ({budget}; {t.micro_batch_size} rows x "
                  f"{t.grad_accum} accum x {plan.world_size} rank(s) = {plan.rows_per_step} "
                  f"rows/step; warmup {s.warmup})"),
        ("features", _features_line(plan, cfg.drafter.method)),
        ("offline cache", cache),
        ("target GPU/rank", f"{_gib(m.total)} = {_gib(m.weights)} weights "
                            f"({plan.target_dtype}{_sharded_note(m)}) + {_gib(m.captured)} features + "
                            f"{_gib(m.forward)} forward ({m.batch} x {plan.seq_len} rows {when}; "
                            "drafter and optimizer not included)"),
    ]
    width = max(len(k) for k, _ in rows)
    head = (f"run plan of {cfg.name} (<=: upper bounds from data.num_examples x data.max_length;"
            " the run prints exact counts)")
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def run_plan(cfg: TrainConfig, env=None) -> RunPlan:
    """``plan=true``: print (and log) the plan, then refuse an offline cache that cannot fit.
    Under Hydra the root logger writes the console and ``train.log``; without handlers (a
    library call) the table is printed instead, so it shows exactly once either way."""
    plan = make_plan(cfg, env)
    text = format_plan(plan, cfg)
    if logging.getLogger().hasHandlers():
        log.info("%s", text)
    else:
        print(text, flush=True)
    if plan.mode == FeatureMode.offline and plan.cache_bytes:
        check_cache_fits(plan.cache_dir, plan.cache_bytes - cached_shard_bytes(plan.cache_dir),
                         plan.free_bytes, plan.features_dtype, note=", an upper bound: data.num_examples x "
                         "data.max_length, minus shards already cached")
    return plan


def check_offline_cache(cache_dir: str | os.PathLike, rows: int, seq_len: int,
                        spec: FeatureSpec, hidden_size: int, dtype: str,
                        rows_per_shard: int) -> None:
    """A real run, before the cache fills: the exact rows' cache (less the shards already
    written) must fit on the disk holding ``cache_dir``."""
    needed = cache_bytes(rows, seq_len, spec, hidden_size, str(dtype), rows_per_shard)
    check_cache_fits(cache_dir, needed - cached_shard_bytes(cache_dir), free_bytes(cache_dir),
                     dtype, note=f", {rows} rows x {seq_len} tokens, less shards already cached")
