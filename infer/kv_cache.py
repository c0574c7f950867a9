"""Static preallocated KV cache with per-row lengths (gpt-fast / nanochat style).

The cache owns two tensors ``k`` and ``v`` of shape
``[num_layers, max_batch, num_kv_heads, max_len + 1, head_dim]`` and a length per row,
``lens [max_batch]`` (int64): row ``r`` holds ``lens[r]`` valid positions ``0 .. lens[r]-1``.
A sequence lives in one row ("slot") for its whole life; keys are stored at the index equal to
their position, so a query at position ``p`` may attend exactly the keys ``0 .. p``.

Who advances ``lens``: the model's cached forward does, by ``num_tokens`` per row, after all
layers ran (see :meth:`KVCache.advance`). Rollback of rejected draft tokens is only
``cache.truncate(slots, new_lens)`` (``lens[slots] = new_lens``): stale keys beyond a row's length
are masked out and overwritten by the next write, so no data moves.

Padding: in a ragged batch (``num_tokens[b] < T``) the padding tokens of row ``b`` are written to
the extra scratch column ``max_len`` (never visible to a valid query, whose position is always
``< max_len``), so they can never clobber real keys and never index out of bounds.

Host syncs: :meth:`KVCache.plan` reads ``max(lens + num_tokens)`` on the host once per forward to
slice attention to the used length and to check for overflow, unless the caller passes a fixed
``kv_len`` (e.g. ``cache.capacity``), which keeps a decode step free of syncs and graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def cache_rows(slots: list[int], index: Tensor) -> Tensor | None:
    """A cached forward's ``slots`` argument for a batch in cache rows ``slots`` (``index``: the
    same on the device): None when they are rows ``0 .. B-1`` in order (the forward then reads
    views of the cache instead of gathering every layer's keys), else ``index``."""
    return None if all(s == i for i, s in enumerate(slots)) else index


@dataclass
class CacheStep:
    """Where one cached forward writes and what it reads; shared by all layers of that forward."""

    cache: "KVCache"
    slots: Tensor | None  # [B] cache rows of the batch; None = rows 0 .. B-1 (no gather needed)
    positions: Tensor  # [B, T] absolute position of every new token (padding included)
    write_pos: Tensor  # [B, T] cache index each new key goes to (padding -> scratch column)
    num_tokens: Tensor  # [B] valid new tokens per row
    kv_len: int  # keys attended: cache indices 0 .. kv_len-1
    flat_index: Tensor  # [B * T * kv_heads] where each new (token, head) goes in a layer's rows
    exact: bool  # kv_len is max(lens + num_tokens) (read on the host), not a caller's fixed size
    start: int | None = None  # one row's first position, known on the host (KVCache.plan)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys/values of ``layer`` and return every key/value it attends to.

        ``k, v``: ``[B, kv_heads, T, head_dim]``; returns two ``[B, kv_heads, kv_len, head_dim]``.
        """
        self.cache.write(layer, self.flat_index, k, v)
        return self.cache.read(layer, self.slots, self.kv_len, k.shape[0])


class KVCache:
    """Preallocated keys/values for ``max_batch`` sequences of up to ``max_len`` tokens each."""

    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        if min(num_layers, max_batch, num_kv_heads, max_len, head_dim) < 1:
            raise ValueError("KVCache: every dimension must be >= 1, got "
                             f"layers={num_layers} batch={max_batch} kv_heads={num_kv_heads} "
                             f"max_len={max_len} head_dim={head_dim}")
        self.max_len = max_len
        # one extra column (index max_len) takes the writes of padding tokens
        shape = (num_layers, max_batch, num_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, kv_heads, S+1, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, kv_heads, S+1, hd]
        self.lens = torch.zeros(max_batch, dtype=torch.long, device=device)  # [rows]
        # the same storage as one vector per (row, head, position): what write() indexes
        self._k_rows = self.k.view(num_layers, -1, head_dim)  # [L, rows * kv_heads * (S+1), hd]
        self._v_rows = self.v.view(num_layers, -1, head_dim)
        # where position 0 of each (row, head) sits in those vectors
        self._row_head_base = ((torch.arange(max_batch, device=device)[:, None] * num_kv_heads
                                + torch.arange(num_kv_heads, device=device))
                               * (max_len + 1))  # [rows, kv_heads]
        self._small: dict[tuple[str, int], Tensor] = {}  # per-length tensors made once (_made)

    @classmethod
    def for_model(cls, config, max_batch: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> "KVCache":
        """A cache shaped for a model config (``num_layers``, ``num_kv_heads``, ``head_dim``)."""
        return cls(config.num_layers, max_batch, config.num_kv_heads, max_len, config.head_dim,
                   dtype=dtype or torch.float32, device=device)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        """Cache columns including the scratch one: the fixed ``kv_len`` for sync-free steps."""
        return self.max_len + 1

    # ---- bookkeeping ---------------------------------------------------------------------------

    def plan(self, batch: int, seq: int, slots: Tensor | None = None,
             num_tokens: Tensor | None = None, kv_len: int | None = None,
             depths: Tensor | None = None) -> CacheStep:
        """Positions and write indices for ``seq`` new tokens in each of ``batch`` rows.

        Row ``b``'s new tokens get positions ``lens[b] .. lens[b] + seq - 1``; tokens at or beyond
        ``num_tokens[b]`` are padding. ``kv_len=None`` costs one host read (see module doc).
        ``depths [T]`` (a draft tree, infer/draft_tree.py): positions ``lens[b] + depths``
        instead; the tokens are still written to consecutive cache columns.
        """
        one_row = batch == 1 and slots is None and num_tokens is None
        if one_row and kv_len is None and depths is None:
            return self._plan_row(seq)
        device = self.lens.device
        start = self.lens[:batch] if slots is None else self.lens[slots]  # [B]
        offsets = self._offsets(seq)  # [T]
        positions = start[:, None] + offsets  # [B, T] cache columns
        exact = kv_len is None
        if exact:  # host sync, once per forward
            kv_len = self._check_fits(int(start.max()) + seq if num_tokens is None
                                      else int((start + num_tokens).max()))
        if num_tokens is None:
            num_tokens = torch.full((batch,), seq, dtype=torch.long, device=device)
            # no padding, and with an exact kv_len every position is < max_len (checked above):
            # the common decode step skips the three ops of the general case
            write_pos = positions if exact else self._clip(positions)  # [B, T]
        else:
            write_pos = self._clip(positions, offsets[None, :] < num_tokens[:, None])
        if depths is not None:
            positions = start[:, None] + depths  # [B, T] a tree's nodes sit at their depth
        base = self._row_head_base[:batch] if slots is None else self._row_head_base[slots]
        flat_index = (base[:, None, :] + write_pos[:, :, None]).flatten()  # [B * T * kv_heads]
        return CacheStep(self, slots, positions, write_pos, num_tokens, kv_len, flat_index,
                         exact)

    def _plan_row(self, seq: int) -> CacheStep:
        """:meth:`plan` of ``seq`` tokens in row 0 alone, exact and unpadded (a batch-1 decode or
        draft step): the one host read gives the row's start, so positions and write indices
        are views and one add, not the general case's dozen tiny ops (with the RoPE rows sliced
        from the start too, 15 % off a one-layer draft head's step on a CPU)."""
        start = int(self.lens[0])  # the host read an exact kv_len needs anyway
        kv_len = self._check_fits(start + seq)
        positions = self._offsets(self.max_len + 1)[start:start + seq][None]  # [1, T] a view
        flat_index = (self._row_base_by_token(seq) + start).flatten()  # [T * kv_heads]
        return CacheStep(self, None, positions, positions, self._counts(seq), kv_len, flat_index,
                         exact=True, start=start)

    def _check_fits(self, kv_len: int) -> int:
        """``kv_len`` (at least 1), or a clear error when a row would outgrow the cache."""
        if kv_len > self.max_len:
            raise ValueError(f"KVCache overflow: a row needs {kv_len} positions but the cache "
                             f"holds max_len={self.max_len}")
        return max(kv_len, 1)

    def _row_base_by_token(self, seq: int) -> Tensor:
        """``[T, kv_heads]``: where token ``t`` of row 0 goes in a layer's vectors, less the
        row's start."""
        return self._made(("row base", seq),
                          lambda: self._offsets(seq)[:, None] + self._row_head_base[0])

    def _counts(self, seq: int) -> Tensor:
        """``[1]`` holding ``seq``: a one-row step's ``num_tokens``."""
        return self._made(("count", seq), lambda: torch.full((1,), seq, dtype=torch.long,
                                                             device=self.lens.device))

    def _made(self, key: tuple[str, int], make) -> Tensor:
        """A small tensor made once per ``key`` and reused (never written to): a decode step's
        planning is a dozen tiny ops, and each one saved is a few microseconds of a draft
        head's step."""
        made = self._small.get(key)
        if made is None:
            made = self._small[key] = make()
        return made

    def _clip(self, positions: Tensor, real: Tensor | None = None) -> Tensor:
        """Cache columns ``[B, T]``: padding (``real`` False) and positions past ``max_len``
        (only reachable with a caller's fixed kv_len, which skips the overflow check) go to the
        scratch column, never into another row's keys."""
        valid = positions < self.max_len  # [B, T]
        if real is not None:
            valid &= real
        return positions.masked_fill(~valid, self.max_len)

    def _offsets(self, seq: int) -> Tensor:
        """``arange(seq)`` on the cache's device."""
        return self._made(("arange", seq), lambda: torch.arange(seq, device=self.lens.device))

    def advance(self, step: CacheStep) -> None:
        """``lens[row] += num_tokens`` for the rows of ``step`` (in place, no sync)."""
        if step.slots is None:
            self.lens[: step.num_tokens.shape[0]] += step.num_tokens
        else:
            self.lens.index_add_(0, step.slots, step.num_tokens)

    def move(self, slots: Tensor, src: Tensor, dst: Tensor) -> None:
        """Row ``slots[i]``'s keys/values at column ``src[i]`` are copied to ``dst[i]``, in
        every layer (an accepted tree node moved to the column of its depth)."""
        self.k[:, slots, :, dst] = self.k[:, slots, :, src]  # [n, L, kv_heads, hd] both sides
        self.v[:, slots, :, dst] = self.v[:, slots, :, src]

    def truncate(self, slots: Tensor, new_lens: Tensor | int) -> None:
        """Rollback: row ``slots[i]`` keeps its first ``new_lens[i]`` positions. No data moves."""
        self.lens[slots] = torch.as_tensor(new_lens, dtype=torch.long, device=self.lens.device)

    def reset(self, slots: Tensor | None = None) -> None:
        """Free rows (all when ``slots`` is None) for new sequences."""
        if slots is None:
            self.lens.zero_()
        else:
            self.lens[slots] = 0

    # ---- storage -------------------------------------------------------------------------------

    def write(self, layer: int, flat_index: Tensor, k: Tensor, v: Tensor) -> None:
        """Scatter new ``k, v [B, kv_heads, T, hd]`` to their (row, head, position) vectors,
        ``flat_index [B * T * kv_heads]`` from :meth:`plan` (one index for every layer, and one
        ``index_copy_`` per tensor instead of an advanced-index assignment)."""
        hd = k.shape[-1]
        self._k_rows[layer].index_copy_(0, flat_index, k.transpose(1, 2).reshape(-1, hd))
        self._v_rows[layer].index_copy_(0, flat_index, v.transpose(1, 2).reshape(-1, hd))

    def read(self, layer: int, slots: Tensor | None, kv_len: int,
             batch: int) -> tuple[Tensor, Tensor]:
        """Keys/values ``[B, kv_heads, kv_len, hd]`` of the batch's rows.

        ``slots=None`` is a view of rows ``0 .. B-1``; explicit slots gather (a copy).
        """
        if slots is None:
            return self.k[layer, :batch, :, :kv_len], self.v[layer, :batch, :, :kv_len]
        return (self.k[layer, :, :, :kv_len].index_select(0, slots),
                self.v[layer, :, :, :kv_len].index_select(0, slots))
