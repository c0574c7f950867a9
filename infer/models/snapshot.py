"""A model's weight bundles (:mod:`infer.models.functional`), built once for its cached forwards.

A cached forward of the target or a draft head at decode sizes is mostly fixed cost on a CPU,
and reading every parameter through its module each time was a large part of it (the module
doc of :mod:`infer.models.functional`). So a model builds its bundles once and keeps them in a
:class:`WeightSnapshot`; each cached forward checks that the snapshot still describes the
model, and rebuilds it if not, so nothing a user does to the weights is ever missed:

- an in-place edit (``copy_``, an optimizer step, ``load_state_dict`` without ``assign``)
  reaches the bundles, which hold the parameters themselves or the fused tensors they are views
  of (a packed copy checks its weight's version on every call: :mod:`infer.models.layout`);
- a replaced tensor (``.to()``, ``param.data = ...``) moves its data pointer, and a replaced
  parameter or submodule (``load_state_dict(assign=True)``, ``model.layers[0] = ...``) changes
  what its owner holds: both are checked per forward, about 0.1 us an entry;
- a change of layout (fusing, packing) bumps :func:`infer.models.layout.layout_epoch`.

Only cached forwards (a step that writes a KV cache) with gradients off use a snapshot. Training
forwards run the modules: hooks on them must run (FSDP unshards a layer in one, DeepSpeed ZeRO-3
gathers a linear's weight in one), and a gradient needs the parameters as they are. The other
side of the same coin: a forward hook on a submodule (a layer, a linear) does not run in a cached
forward; one on the model itself does.
"""

from __future__ import annotations

import operator
from typing import Callable, Iterable, TypeVar

import torch
from torch import Tensor, nn

from infer.models.layout import layout_epoch

T = TypeVar("T")
_KEY = "_weight_snapshot"  # where a model keeps its snapshot (a plain attribute: never saved)


class WeightSnapshot:
    """``value`` (a bundle built from ``modules``) and what must stay true for it to hold."""

    def __init__(self, value: object, modules: Iterable[nn.Module]):
        self.value = value
        self.epoch = layout_epoch()
        self.checked_for: object = None  # the last step it was found to hold for
        subs = {id(s): s for m in modules for s in m.modules()}.values()
        # every parameter and child each module holds now: owner dicts, names, objects
        members = [(d, name, obj) for s in subs for d in (s._parameters, s._modules)
                   for name, obj in d.items()]
        self._dicts = [d for d, _, _ in members]
        self._names = [name for _, name, _ in members]
        self._objects = [obj for _, _, obj in members]
        self._params = [p for s in subs for p in s._parameters.values() if p is not None]
        self._pointers = [p.data_ptr() for p in self._params]

    def __reduce__(self):
        """Copies and pickles of a model drop its snapshot (the copy builds its own; this one
        names the original's tensors and may hold a step, and with it a KV cache)."""
        return _dropped, ()

    def holds(self) -> bool:
        """Whether the modules still hold the same parameters and children at the same
        addresses, in the same layout (map, not a generator: a third of the time)."""
        return (self.epoch == layout_epoch()
                and all(map(operator.is_, map(dict.get, self._dicts, self._names),
                            self._objects))
                and list(map(Tensor.data_ptr, self._params)) == self._pointers)


def _dropped() -> None:
    return None


def uses_snapshot(step: object) -> bool:
    """Whether a forward with ``step`` runs a snapshot's bundles: a cached forward (a step with
    a ``cache``: ``CacheStep``, ``GroupedStep``) recording no gradient."""
    return getattr(step, "cache", None) is not None and not torch.is_grad_enabled()


def snapshot_of(owner: nn.Module, build: Callable[[], T], step: object,
                shared: Iterable[nn.Module | None] = ()) -> T:
    """``owner``'s bundle from ``build()``, kept until it no longer holds (:class:`WeightSnapshot`;
    ``shared``: modules ``owner`` reads but does not register, e.g. a target's embedding).
    Checked once per cached ``step``: a head's forward asks for its bundles more than once."""
    snap = owner.__dict__.get(_KEY)
    if snap is not None and snap.checked_for is step:
        return snap.value
    if snap is None or not snap.holds():
        value = build()
        snap = WeightSnapshot(value, [owner, *(m for m in shared if m is not None)])
        object.__setattr__(owner, _KEY, snap)  # not a submodule or buffer: never saved or moved
    snap.checked_for = step
    return snap.value

