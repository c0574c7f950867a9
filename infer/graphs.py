"""Static-shape cached forwards, captured as CUDA graphs (the gpt-fast / vLLM decode recipe).

A decode or verify step of a served model is a few dozen small kernels per layer; at the batch
sizes that serve at low latency, launching them costs more than running them. A CUDA graph records
one step's kernels once and replays them with a single launch. A graph replays fixed shapes at
fixed addresses, so :class:`StaticForward` runs every step in a fixed layout:

- rows: the step covers cache rows ``0 .. R-1`` as they are (views, no gather), ``R`` the smallest
  capture size ``>= max slot + 1``. Rows with no request in this step get ``num_tokens = 0``:
  their keys go to the cache's scratch column, their lengths do not move, their outputs are
  dropped. The engine admits requests into the lowest free slots, so ``R`` stays close to the
  number of running requests.
- keys: attention reads ``kv_len`` = the smallest power of two (at least ``MIN_KV_BUCKET``,
  at most the cache's ``max_len``, so the scratch column is never read) covering the longest row
  after the step: a short batch does not read the whole cache, and a model needs few graphs
  (row sizes x token counts x key buckets).
- buffers: input ids and ``num_tokens`` live in static tensors written before each replay;
  the graphs of one token count write one shared set of output tensors (so graph memory does
  not grow with the number of shapes), which are gathered back into the caller's row order, a
  copy, so nothing the caller holds is overwritten by the next replay.

Each shape is captured on first use, after one warm-up run (cuBLAS handles, allocator, Triton
autotuning). The warm-up writes the step's keys exactly where the replay writes them again and its
advance of the cache lengths is undone, so capture leaves the cache as one step would. On other
devices the same buffers and warm-up are used and the "graph" is an eager call: that is how the
CPU tests check this bookkeeping against the plain forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

from infer.kv_cache import KVCache

MIN_KV_BUCKET = 256


def row_sizes(max_rows: int) -> tuple[int, ...]:
    """Capture sizes: 1, 2, 4, 8, then multiples of 8, and ``max_rows`` itself (vLLM's list)."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return tuple(sorted(set(sizes)))


def kv_bucket(need: int, capacity: int) -> int:
    """Smallest power of two ``>= need`` (at least ``MIN_KV_BUCKET``), capped at ``capacity``."""
    bucket = MIN_KV_BUCKET
    while bucket < need:
        bucket *= 2
    return min(bucket, capacity)


class _Graph:
    """One static-shape call: a CUDA graph when ``capture``, else the function itself.

    Capture runs on ``stream`` (on the cache's device, under a device guard: a capture on
    another device's stream would record nothing and replay stale outputs).
    """

    def __init__(self, fn: Callable[[], Any], cache: KVCache, stream=None, pool=None) -> None:
        self.fn, self.graph = fn, None
        saved = cache.lens.clone()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm-up: lazy initialisations must not happen inside the capture
            torch.cuda.current_stream().wait_stream(stream)
            cache.lens.copy_(saved)  # the warm-up advanced the lengths; the replay will
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.out = fn()  # recorded, not run: the cache is untouched
        else:
            fn()  # the same warm-up and undo, so CPU tests exercise them
            cache.lens.copy_(saved)

    def __call__(self) -> Any:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class StaticForward:
    """A cached forward over ``cache`` in fixed shapes, captured per shape on CUDA.

    ``module`` is a cached forward with the contract of :meth:`Llama.forward` (the target, a
    draft LM) or :meth:`~infer.drafters.common.PairDrafter.forward` (EAGLE heads, which take a
    ``[B, T, H]`` hidden-state input after the ids): it is called as ``module(ids, *row_inputs,
    cache, None, num_tokens=..., kv_len=..., **kwargs)``. ``capture=None``: capture on CUDA, run
    eagerly elsewhere (see the module doc).

    Graphs bake in the module's weight addresses: replacing them afterwards (``.to()``,
    ``load_state_dict(assign=True)``) needs a new StaticForward.
    """

    def __init__(self, module: Callable[..., Any], cache: KVCache, capture: bool | None = None,
                 **kwargs: Any) -> None:
        self.module, self.cache, self.kwargs = module, cache, kwargs
        self.device = cache.lens.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.sizes = row_sizes(cache.max_batch)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self._buffers: dict[int, list[Tensor]] = {}  # T -> [ids, num_tokens, *row_inputs]
        self._outputs: dict[int, Any] = {}  # T -> outputs [max_batch, ...] shared by its graphs
        self._stream = torch.cuda.Stream(self.device) if self.capture else None
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def __call__(self, input_ids: Tensor, *row_inputs: Tensor, slots: list[int], index: Tensor,
                 max_len: int, num_tokens: Tensor | None = None,
                 row_kwargs: dict[str, Tensor] | None = None) -> Any:
        """Forward ``input_ids [B, T]`` (and ``row_inputs``, each ``[B, T, ...]``) for cache rows
        ``slots`` (any order) with ``num_tokens [B]`` real tokens each (default all ``T``), as
        the plain module would; every output tensor comes back in the order of ``slots`` (a copy,
        so the next replay cannot overwrite what the caller holds). ``row_kwargs``: per-row
        keyword inputs ``[B, ...]`` of fixed trailing shape per ``T`` (P-EAGLE's ``logits_at
        [B, K]``), buffered like ``row_inputs`` (zeros in rows without a request).

        ``index``: ``slots`` on the device, made by the caller before it queued this step's GPU
        work (made here, the copy would wait for that work). ``max_len``: a host-side bound on
        ``lens[slot] + num_tokens`` over the batch (the engine knows its requests' lengths), which
        picks the key bucket without reading the device.
        """
        guard = torch.cuda.device(self.device) if self.capture else contextlib.nullcontext()
        with guard:
            t = input_ids.shape[1]
            rows = next(s for s in self.sizes if s > max(slots))
            # real keys never pass max_len: the scratch column (padding writes) is never read
            kv_len = kv_bucket(max_len, self.cache.max_len)
            named = row_kwargs or {}
            ids, num, *extra = self._inputs(t, (*row_inputs, *named.values()))
            num.zero_()  # rows without a request this step: no tokens
            if num_tokens is None:
                num.index_fill_(0, index, t)
            else:
                num.index_copy_(0, index, num_tokens.to(num.dtype))
            for buf, x in zip([ids, *extra], [input_ids, *row_inputs, *named.values()]):
                buf.index_copy_(0, index, x.to(buf.dtype))
            key = (rows, t, kv_len)
            if key not in self.graphs:
                self.graphs[key] = _Graph(self._step_fn(rows, t, kv_len, tuple(named)),
                                          self.cache, self._stream, self._pool)
            out = self.graphs[key]()  # rows [R] in cache order
            return _map_tensors(lambda x: x.index_select(0, index), out)

    def _inputs(self, t: int, row_inputs: tuple[Tensor, ...]) -> list[Tensor]:
        if t not in self._buffers:
            rows = self.cache.max_batch
            self._buffers[t] = [torch.zeros(rows, t, dtype=torch.long, device=self.device),
                                torch.zeros(rows, dtype=torch.long, device=self.device)]
            self._buffers[t] += [x.new_zeros(rows, *x.shape[1:]) for x in row_inputs]
        return self._buffers[t]

    def _step_fn(self, rows: int, t: int, kv_len: int, names: tuple[str, ...] = ()
                 ) -> Callable[[], Any]:
        ids, num, *extra = (b[:rows] for b in self._buffers[t])  # views: what __call__ writes
        split = len(extra) - len(names)  # row inputs, then the row keyword inputs
        positional, named = extra[:split], dict(zip(names, extra[split:]))

        def step() -> Any:
            out = self.module(ids, *positional, self.cache, None, num_tokens=num, kv_len=kv_len,
                              **named, **self.kwargs)
            if t not in self._outputs:  # the first warm-up runs outside capture: allocate
                self._outputs[t] = _map_tensors(
                    lambda x: x.new_empty(self.cache.max_batch, *x.shape[1:]), out)
            # every graph of this T writes the same output tensors, so graphs hold only their
            # temporaries (in the shared pool), not one output set each
            return _map_tensors(lambda buf, x: buf[:rows].copy_(x), self._outputs[t], out)
        return step


def _map_tensors(fn: Callable[..., Tensor], first: Any, *rest: Any) -> Any:
    """``fn(leaf, *same_leaves_of_rest)`` over the tensors of a forward's output (a tensor, or a
    tuple or dataclass of them); ``rest`` have the same structure as ``first``."""
    if isinstance(first, Tensor):
        return fn(first, *rest)
    if isinstance(first, tuple):
        return tuple(_map_tensors(fn, f, *(r[i] for r in rest)) for i, f in enumerate(first))
    if is_dataclass(first):
        return replace(first, **{f.name: _map_tensors(fn, getattr(first, f.name),
                                                      *(getattr(r, f.name) for r in rest))
                                 for f in fields(first)})
    return first
