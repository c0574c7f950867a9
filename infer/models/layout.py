"""Inference layouts of frozen linear weights: fused projections, and oneDNN-packed weights on CPU.

Fusion (:class:`FusedLinear`): q/k/v (and gate/up) read the same input, so one matmul over their
concatenated weights replaces three (two). The parameters become views into the fused tensor, so
names, ``state_dict`` and in-place updates are unchanged.

Packing (:func:`pack_for_cpu_`): ``nn.Linear`` keeps ``weight [out, in]`` row-major and CPU
``F.linear`` hands it to MKL, whose kernels at the row counts of decoding (1 row per request per
step; k + 1 when verifying) reach a fraction of the memory bandwidth. oneDNN's
``_linear_pointwise`` with the weight reordered once into its blocked layout (what inductor's
CPU freezing does) is 2-4x faster there: on the tiny target's 17 projections (16 MB fp32,
2 threads), 3.0 -> 0.8 ms for 4 rows and 3.9 -> 0.8 ms for 8 (docs/benchmarks-history.md). But a
oneDNN call has a fixed cost of ~15-20 us, more than MKL needs for a whole small projection: on
the 8 x 128 target (q/k/v 256 x 128, gate/up 704 x 128, an EAGLE head's 1024-row LM head) the
packed call was 2-4x *slower* than ``F.linear`` at 1 row and no faster at 4-32 rows; it wins
from about 2^18 weight elements (docs/benchmarks-history.md, "Packed linears only where they pay"). So
only weights of at least :data:`PACK_MIN_ELEMENTS` are packed; every projection of a real
model is far above it. The packed copy is kept next to the weight (the weight stays what the
rest of the code reads: tied and shared embeddings, ``state_dict``), so packed linears take
twice their memory on CPU.

A packed or fused weight is used only while it still describes the parameters: a replaced
``.data`` (``.to()``, ``load_state_dict(assign=True)``) or an in-place edit (``copy_``, which
bumps the tensor's version) falls back to the plain ``F.linear`` of the parameters, as does a
forward that records gradients for them; :func:`pack_for_cpu_` packs such a linear again. One
edit is invisible: writing through ``weight.data`` (``weight.data.copy_(...)``) bypasses the
version counter, as it bypasses autograd; call ``pack_for_cpu_(..., repack=True)`` after it.
CUDA weights are never packed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_PACKABLE = (torch.float32, torch.bfloat16)
#: weights with fewer elements stay on ``F.linear``: oneDNN's fixed per-call cost outweighs its
#: faster kernel below this size (module doc)
PACK_MIN_ELEMENTS = 1 << 18

_epoch = [0]  # bumped by every fusing and packing (layout_epoch)


def layout_epoch() -> int:
    """A counter that every change of layout (a :class:`FusedLinear` made, a weight packed)
    increments: what a model's weight snapshot (:mod:`infer.models.snapshot`) checks, since a
    packing changes no parameter."""
    return _epoch[0]


class PackedWeight:
    """oneDNN's blocked copy of a CPU weight ``[out, in]``, valid while the weight is unchanged."""

    def __init__(self, weight: Tensor, packed: Tensor) -> None:
        self.tensor: Tensor | None = packed
        # an alias of the packed weight (no copy) keeps its memory from being reused, so a new
        # weight can never show up at the same address; released once it no longer matches
        self._source: Tensor | None = weight.detach()
        self._ptr, self._version = weight.data_ptr(), weight._version

    @classmethod
    def of(cls, weight: Tensor) -> "PackedWeight | None":
        """The packed copy, or None where oneDNN cannot take it (device, dtype, build, CPU)."""
        if (weight.device.type != "cpu" or weight.dim() != 2
                or not _packing_works(weight.dtype)):
            return None
        try:
            return cls(weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        except (AttributeError, RuntimeError):  # a torch without the op, or a shape it refuses
            return None

    def describes(self, weight: Tensor) -> bool:
        """Whether ``weight`` is still what was packed. A mismatch is final: the packed copy and
        the old weight's memory are released."""
        if self._source is None:
            return False
        if weight.data_ptr() == self._ptr and weight._version == self._version:
            return True
        self.tensor = self._source = None
        return False

    def __reduce__(self):
        """Copies and pickles drop the packing (oneDNN's opaque tensor has no storage to copy):
        a deep-copied model runs its plain parameters."""
        return _dropped, ()


def _dropped() -> None:
    return None


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in ``dtype`` (bf16 needs CPU
    support that oneDNN checks only when the op runs): one tiny probe per dtype."""
    if dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            w = torch.linspace(-1, 1, 128).view(8, 16).to(dtype)  # no RNG: the global stream
            x = torch.linspace(-2, 1, 32).view(2, 16).to(dtype)  # stays the caller's
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            got = torch.ops.mkldnn._linear_pointwise.default(x, packed, None, "none", [], "")
            return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2))
    except (AttributeError, RuntimeError):  # a torch without the ops, or a CPU oneDNN refuses
        return False


def linear(x: Tensor, weight: Tensor, bias: Tensor | None,
           packed: PackedWeight | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` when it is still valid and no gradient
    is needed (oneDNN's op has no autograd)."""
    if (packed is not None and x.dtype == weight.dtype and packed.describes(weight)
            and not _records_grad(x, weight, bias)):
        return torch.ops.mkldnn._linear_pointwise.default(x, packed.tensor, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _records_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs through its packed weight (see :func:`pack_for_cpu_`,
    which turns linears into this class in place; parameters and names are untouched)."""

    _packed: PackedWeight | None = None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self._packed)


class FusedLinear:
    """Linears that read the same input, run as one: their weights (and biases) concatenated
    along the output dim, each parameter re-pointed at its row block (views: no extra memory,
    in-place updates stay shared). ``__call__`` returns the concatenated outputs."""

    @staticmethod
    def can_fuse(linears: list[nn.Linear]) -> bool:
        """One input width, one dtype and device, and biases on all or none of them."""
        return (len({(lin.in_features, lin.weight.dtype, lin.weight.device)
                     for lin in linears}) == 1
                and len({lin.bias is None for lin in linears}) == 1)

    def __init__(self, linears: list[nn.Linear]) -> None:
        if not self.can_fuse(linears):
            raise ValueError("FusedLinear: the linears need one input width, dtype and device, "
                             "and biases on all or none of them")
        self.linears = linears
        self.weight = _fuse([lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else _fuse(biases)
        for lin, w, b in zip(linears, self._split(self.weight), self._split(self.bias)):
            lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
            if b is not None:
                lin.bias = nn.Parameter(b, requires_grad=lin.bias.requires_grad)
        self._ptrs = [p.data_ptr() for p in self._params()]  # where the row blocks live
        self.packed: PackedWeight | None = None
        _epoch[0] += 1

    def _params(self) -> list[Tensor]:
        weights = [lin.weight for lin in self.linears]
        return weights if self.bias is None else weights + [lin.bias for lin in self.linears]

    def active(self) -> bool:
        """Whether the parameters are still the fused tensors' row blocks (nothing replaced
        them or their ``.data``) and no gradient is recorded for them: else run the separate
        linears. Called per forward, so it only compares addresses."""
        params = self._params()
        return not _records_grad(*params) and all(
            p.data_ptr() == ptr for p, ptr in zip(params, self._ptrs))

    def __call__(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def _split(self, fused: Tensor | None) -> list[Tensor | None]:
        if fused is None:
            return [None] * len(self.linears)
        return list(fused.split([lin.out_features for lin in self.linears]))


def _fuse(params: list[Tensor]) -> Tensor:
    return torch.cat([p.detach() for p in params], dim=0)


def pack_for_cpu_(module: nn.Module, repack: bool = False,
                  min_elements: int = PACK_MIN_ELEMENTS) -> nn.Module:
    """Pack every CPU linear of ``module`` whose weight has at least ``min_elements`` elements
    for inference, in place; returns it (smaller ones run ``F.linear``: see the module doc).

    Fused projections (:class:`FusedLinear` attributes of submodules, e.g. after
    :meth:`~infer.models.llama.Llama.fuse_projections`) are packed as one; their separate parts
    are not (they only run when the fused path cannot). Other ``nn.Linear`` modules become
    :class:`PackedLinear`. A packing that still describes its weight is kept (an EAGLE head
    sharing the target's LM head) unless ``repack``. A no-op on CUDA and wherever oneDNN cannot
    pack.
    """
    def needs_packing(packed: PackedWeight | None, weight: Tensor) -> bool:
        """Big enough to gain, and not already packed as it is now (or ``repack``)."""
        if weight.numel() < min_elements:
            return False
        return repack or packed is None or not packed.describes(weight)

    _epoch[0] += 1
    fused = [v for sub in module.modules() for v in vars(sub).values()
             if isinstance(v, FusedLinear)]
    parts = {id(lin) for f in fused for lin in f.linears}
    for f in fused:
        if needs_packing(f.packed, f.weight):
            f.packed = PackedWeight.of(f.weight)
    for sub in module.modules():
        if (type(sub) in (nn.Linear, PackedLinear) and id(sub) not in parts
                and needs_packing(getattr(sub, "_packed", None), sub.weight)):
            packed = PackedWeight.of(sub.weight)
            if packed is not None:
                sub.__class__ = PackedLinear
                sub._packed = packed
    return module
