"""The frozen target through transformers, for architectures draftsmith's engine does not run.

Training needs three things from a target: its sizes (to shape the drafter), its embedding and
LM head (borrowed by the objective), and its residual streams over the training rows (the
features). The engine's own model (infer/models/llama.py) gives all three for the families it
knows; any other causal LM that transformers implements (Gemma 3, GPT-OSS, OLMo, StableLM ...)
goes through transformers' own implementation here, as speculators and SpecForge read
hidden states through the model code the serving stack already has. No remote code: an
architecture transformers does not ship is refused with the reason.

Layer indexing is vLLM's aux-layer ids, the same as the engine's: stream ``j`` is the residual
after ``j`` decoder layers (0 = the embeddings; ``n`` = the last layer's output, before the
final norm), which is ``output_hidden_states[j]`` for ``j < n``; transformers' last entry is
after the final norm, so stream ``n`` is read at the final norm's input. ``hidden`` is the final
norm's output, what the LM head reads.

Training rows are packed (several documents per row, positions restarting per document).
transformers drops its sliding windows when handed a custom 4-D mask, so instead every document
becomes its own right-padded sequence of one forward (a 2-D padding mask, which every
architecture masks correctly, sliding layers included), and the outputs are scattered back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.foundation.errors import ConfigError
from infer.models.llama import check_aux_ids


@dataclass
class TargetStreams:
    """One feature forward's output: the residual streams asked for (sorted id order) and the
    final norm's output, each ``[B, T, H]``."""

    aux: tuple[Tensor, ...]
    hidden: Tensor


class TransformersTarget:
    """A frozen transformers causal LM giving the engine's training features
    (``streams``); ``module`` is the transformers model (sharded or not)."""

    def __init__(self, module: nn.Module, keep_alive=None):
        self.module = module.requires_grad_(False).eval()
        self.keep_alive = keep_alive  # a ZeRO-3 model's engine and DeepSpeed config
        decoder = module.get_decoder()
        self.num_layers = len(decoder.layers)
        self._norm = decoder.norm

    @torch.no_grad()
    def streams(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                aux_layer_ids) -> TargetStreams:
        """Features of packed rows (``[B, T]`` each): one forward over every document of the
        batch, right-padded, scattered back to the rows."""
        ids = check_aux_ids(aux_layer_ids, self.num_layers)
        segments = doc_segments(doc_ids)  # (row, start, stop) per document
        longest = max(stop - start for _, start, stop in segments)
        tokens = input_ids.new_zeros(len(segments), longest)  # [S, L]
        positions, mask = torch.zeros_like(tokens), torch.zeros_like(tokens)
        for s, (row, start, stop) in enumerate(segments):
            tokens[s, :stop - start] = input_ids[row, start:stop]
            positions[s, :stop - start] = position_ids[row, start:stop]
            mask[s, :stop - start] = 1
        last: list[Tensor] = []
        hook = self._norm.register_forward_hook(lambda _m, args, _o: last.append(args[0]))
        try:
            out = self.module(input_ids=tokens, attention_mask=mask, position_ids=positions,
                              output_hidden_states=True, use_cache=False, logits_to_keep=1)
        finally:
            hook.remove()
        states = list(out.hidden_states[:self.num_layers]) + [last[-1]]  # n + 1 x [S, L, H]
        final = out.hidden_states[-1]  # [S, L, H] after the final norm
        return TargetStreams(tuple(_unpack(states[j], segments, input_ids.shape) for j in ids),
                             _unpack(final, segments, input_ids.shape))


def doc_segments(doc_ids: Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, stop)`` of each run of equal doc ids in ``doc_ids [B, T]`` (the packer
    writes each document contiguously; padding is a document of its own)."""
    out = []
    for row, docs in enumerate(doc_ids.tolist()):
        start = 0
        for t in range(1, len(docs) + 1):
            if t == len(docs) or docs[t] != docs[start]:
                out.append((row, start, t))
                start = t
    return out


def _unpack(states: Tensor, segments, shape) -> Tensor:
    """``states [S, L, H]`` of the documents back into rows ``[B, T, H]``."""
    out = states.new_zeros(*shape, states.shape[-1])
    for s, (row, start, stop) in enumerate(segments):
        out[row, start:stop] = states[s, :stop - start]
    return out


def load_transformers(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                      sharding: str = "none", zero3: dict | None = None) -> TransformersTarget:
    """The target through transformers' own implementation (no remote code): replicated, or
    sharded over the default process group as the engine's model is (``fsdp``: FSDP2 on each
    decoder layer and the root, built on the CPU then moved shard by shard; ``zero3``: DeepSpeed
    ZeRO-3 with the DeepSpeed config ``zero3``, transformers building the model partitioned
    under ``HfDeepSpeedConfig``)."""
    from transformers import AutoModelForCausalLM

    engine, keep = None, None
    if sharding == "zero3":
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(zero3)  # kept alive while the model is built
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                     trust_remote_code=False)
    except ValueError as err:  # an architecture transformers does not ship
        raise ConfigError(f"target.path: transformers cannot build {model_dir} without remote "
                          f"code ({str(err).splitlines()[0]}); draftsmith runs no remote code",
                          "target.path") from err
    if sharding == "fsdp":
        _fully_shard(model, device)
    if sharding == "zero3":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model.requires_grad_(False), config=keep.config)
    return TransformersTarget(model if sharding == "zero3" else model.to(device), (engine, keep))


def _fully_shard(model: nn.Module, device: torch.device) -> None:
    """FSDP2 over the ranks: each decoder layer one unit, then the root (embedding, norm, head)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
