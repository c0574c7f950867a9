"""The frozen target of a training run: its heads, and the whole model, replicated or sharded.

``FrozenTarget`` loads the heads (embedding + LM head, all an objective borrows and all offline
training keeps) first, the whole model only when features must be computed: online capture
inside every step, or the offline cache build over the whole dataset. Both would need the whole
model on every rank, so a target larger than one device is sharded across the ranks
(``target.sharding``), by the engines users already run, never by our own collectives:

* ``fsdp``: PyTorch FSDP2 (``fully_shard``), each decoder layer one unit plus the root
  (embedding, final norm, LM head). A forward all-gathers one layer at a time and frees it after
  (``reshard_after_forward``; the root stays gathered, as FSDP2 keeps the root's parameters).
  The model is built on the meta device, sharded, then filled tensor by tensor from the
  safetensors files (each rank keeps its own slice): no rank ever materialises the whole model.
* ``zero3``: DeepSpeed ZeRO-3 in inference mode (``deepspeed.initialize`` without an optimizer,
  as TRL prepares frozen reference and teacher models). Parameters are partitioned as they are
  created (``deepspeed.zero.Init``) and filled one at a time through ``GatheredParameters``.

Both need every rank to run the same number of target forwards (each forward is a collective);
:func:`most_over_ranks` is how the offline cache build pads ranks with fewer rows to compute.
The numerics are the replicated model's: the same layers, in the same order, on gathered
weights (tests/train/test_frozen_target.py compares features bit for bit; docs/scale-out.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from torch import Tensor, nn

from infer.foundation.errors import FileFormatError
from infer.foundation.files import open_safetensors, read_json
from infer.models.llama import Llama
from infer.models.loader import (checkpoint_tensors, load_model,
                                 model_config_and_dtype, native_name, resolve_dtype,
                                 resolve_model_dir, weight_files)
from train.config import TargetSharding
from infer.models.foreign import engine_gap, target_config
from train.hf_target import TransformersTarget, load_transformers
from train.objectives.base import TargetHeads


def target_heads(target: Llama) -> TargetHeads:
    """The loaded target's embedding and LM head, shared (frozen) with the objective."""
    return TargetHeads(target.config, target.embed_tokens, target.lm_head)


def load_target_heads(target_dir: str | Path, dtype: str | torch.dtype = "auto",
                      device: str | torch.device = "cpu") -> TargetHeads:
    """Only the target's token embedding and LM head, frozen (tied checkpoints: one tensor).

    Offline training needs nothing else from the target, and reading just these two tensors
    from the safetensors headers keeps an 8B target (16 GB) down to its heads (~2 GB).
    ``dtype``: ``auto`` = the checkpoint's own dtype (as ``load_model``).
    """
    model_dir = resolve_model_dir(target_dir)
    config = target_config(model_dir)
    torch_dtype = resolve_dtype(dtype, read_json(model_dir / "config.json"))
    wanted = {"embed_tokens.weight"} | ({"lm_head.weight"} if not config.tie_word_embeddings
                                        else set())
    found: dict[str, Tensor] = {}
    for file in weight_files(model_dir):
        with open_safetensors(file) as f:
            for hf_name in f.keys():
                if native_name(hf_name) in wanted:
                    found[native_name(hf_name)] = f.get_tensor(hf_name).to(device, torch_dtype)
    if set(found) != wanted:
        raise FileFormatError(f"checkpoint {model_dir}: missing {sorted(wanted - set(found))} "
                              "(expected the embedding and, untied, the LM head)")
    embed = nn.Embedding.from_pretrained(found["embed_tokens.weight"], freeze=True)  # [V, H]
    with torch.device("meta"):
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm_head.weight = embed.weight if config.tie_word_embeddings else nn.Parameter(
        found["lm_head.weight"], requires_grad=False)  # [V, H]
    return TargetHeads(config, embed, lm_head)


class FrozenTarget:
    """A training run's frozen target, loaded once for all its stages.

    ``heads`` (embedding + LM head, ``load_target_heads``) is all an objective borrows and all
    offline training keeps in memory; ``model`` (the whole target, sharing those two tensors)
    loads on first use: online capture, or cache shards still to compute. ``dtype`` "auto" =
    bfloat16 on GPU, float32 on CPU. ``sharding`` (resolved ``target.sharding``): fsdp / zero3
    load ``model`` sharded across the ranks (below; it then keeps its own
    embedding and LM head, the heads stay whole); every rank must then use it in lockstep.
    ``release()`` drops the model (offline training, once the caches are complete).
    """

    def __init__(self, target_dir: str | Path, dtype: str | torch.dtype,
                 device: str | torch.device, sharding: TargetSharding = TargetSharding.none
                 ) -> None:
        self.dir, self.device = str(target_dir), torch.device(device)
        if str(dtype) == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = str(dtype).removeprefix("torch.")
        self.sharding = TargetSharding(sharding)
        self.gap = engine_gap(self.dir)  # why the engine cannot run it: through transformers
        self._model: Llama | TransformersTarget | None = None
        self._keep_alive = None  # the sharded model's engine (DeepSpeed)

    @cached_property
    def heads(self) -> TargetHeads:
        return load_target_heads(self.dir, self.dtype, self.device)

    @property
    def sharded(self) -> bool:
        return self.sharding != TargetSharding.none

    @property
    def backend(self) -> str:
        """Which implementation computes the features, and why (printed by the run)."""
        if self.gap is None:
            return "draftsmith's engine"
        return f"transformers (draftsmith's engine does not run it: {self.gap})"

    @property
    def model(self) -> Llama | TransformersTarget:
        if self._model is None and self.gap is not None:
            dtype = getattr(torch, self.dtype)
            self._model = load_transformers(
                resolve_model_dir(self.dir, key="target.path"), dtype, self.device,
                self.sharding.value, zero3_config(self.heads.config.hidden_size, dtype))
        elif self._model is None and self.sharded:
            loaded = load_sharded(self.dir, self.dtype, self.device, self.sharding)
            self._model, self._keep_alive = loaded.model, loaded.engine
        elif self._model is None:
            model = load_model(self.dir, dtype=self.dtype, device=self.device)
            model.embed_tokens, model.lm_head = self.heads.embed_tokens, self.heads.lm_head
            self._model = model  # one copy of the heads in memory
        return self._model

    @property
    def loaded(self) -> bool:
        """Whether the whole model is in memory."""
        return self._model is not None

    def release(self) -> None:
        self._model = self._keep_alive = None


def resolve_sharding(choice: TargetSharding | str, world_size: int,
                     env: Mapping[str, str] = os.environ) -> TargetSharding:
    """``target.sharding`` for this run: ``auto`` follows the accelerate launch (its
    ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED`` + ``ACCELERATE_DEEPSPEED_ZERO_STAGE``
    environment); one process never shards."""
    choice = TargetSharding(choice)
    if world_size <= 1:
        return TargetSharding.none
    if choice != TargetSharding.auto:
        return choice
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return TargetSharding.fsdp
    if (env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
            and env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"):
        return TargetSharding.zero3
    return TargetSharding.none


@dataclass
class ShardedModel:
    """A target sharded across the ranks; ``engine`` is what must stay alive beside it (the
    DeepSpeed engine whose hooks gather the parameters; None under FSDP)."""

    model: Llama
    engine: Any = None


def load_sharded(path: str | Path, dtype: str | torch.dtype, device: torch.device,
                 sharding: TargetSharding) -> ShardedModel:
    """The frozen target at ``path``, sharded by ``sharding`` (fsdp or zero3) over the default
    process group (every rank must call this, in the same order as its other collectives)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"target.sharding={sharding.value} needs a process group: launch "
                           "with accelerate launch / torchrun (docs/scale-out.md)")
    loaders = {TargetSharding.fsdp: _load_fsdp, TargetSharding.zero3: _load_zero3}
    if sharding not in loaders:
        raise ValueError(f"load_sharded: no sharded load for target.sharding={sharding.value}")
    return loaders[sharding](resolve_model_dir(path, key="target.path"), dtype,
                             torch.device(device))


def _load_fsdp(model_dir: Path, dtype, device: torch.device) -> ShardedModel:
    """Meta build -> ``fully_shard`` (layers, then root) -> empty local shards on ``device`` ->
    each tensor's own slice copied in (``distribute_tensor`` of the rank's full CPU copy, no
    communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import distribute_tensor

    config, torch_dtype = model_config_and_dtype(model_dir, dtype)
    with torch.device("meta"):
        model = Llama(config).to(torch_dtype)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "forward_train")  # FSDP hooks only wrap forward()
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in checkpoint_tensors(model_dir, config, params.items()):
            p = params[name]
            mine = distribute_tensor(full.to(torch_dtype), mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(mine.to_local())
    model.init_buffers()  # RoPE frequencies: buffers are not sharded, recomputed on device
    return ShardedModel(model.requires_grad_(False).eval())


def zero3_config(hidden_size: int, dtype: torch.dtype) -> dict:
    """DeepSpeed config of the frozen target's ZeRO-3 inference engine: its own, not the
    drafter's (whose "auto" values belong to accelerate). Bucket sizes follow TRL's for frozen
    models; parameters under ``10 * hidden`` elements (norms) stay whole on every rank."""
    h = int(hidden_size)
    return {"train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "fp16": {"enabled": dtype == torch.float16},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10 * h,
                                  "stage3_prefetch_bucket_size": int(0.9 * h * h),
                                  "reduce_bucket_size": h * h}}


def _load_zero3(model_dir: Path, dtype, device: torch.device) -> ShardedModel:
    """Partitioned at construction (``zero.Init``); each parameter gathered once, filled by rank
    0 and re-partitioned (``GatheredParameters(modifier_rank=0)``); then the ZeRO-3 engine,
    whose module hooks gather each submodule's parameters for its forward."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError("target.sharding=zero3 needs deepspeed (pip install deepspeed)") from err

    config, torch_dtype = model_config_and_dtype(model_dir, dtype)
    ds_config = zero3_config(config.hidden_size, torch_dtype)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):  # dtype from its bf16 / fp16
        model = Llama(config)  # (an explicit dtype= lost every rank 0 write below: DS 0.19.8)
    if model.embed_tokens.weight.dtype != torch_dtype:
        raise RuntimeError(f"ZeRO-3 built the target in {model.embed_tokens.weight.dtype}, "
                           f"expected {torch_dtype} (target.dtype)")
    params = dict(model.named_parameters())
    filler = dist.get_rank() == 0
    with torch.no_grad():
        for name, full in checkpoint_tensors(model_dir, config, params.items()):
            with deepspeed.zero.GatheredParameters([params[name]], modifier_rank=0):
                if filler:
                    params[name].data.copy_(full)
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    model.init_buffers()
    return ShardedModel(model.eval(), engine)


def most_over_ranks(n: int, device: torch.device) -> int:
    """The largest ``n`` any rank holds (the number of target forwards every rank must run);
    ``n`` itself without a process group."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
