"""Paged attention for unmodified mlx-lm models.

mlx-lm model files talk to their KV cache through a tiny protocol: ``cache.offset`` (RoPE
positions), ``cache.update_and_fetch(keys, values)`` and ``cache.make_mask(...)``. The
``PagedLayerCache`` below implements that protocol over a shared block pool, so every mlx-lm
architecture with plain full attention runs batched, with each row of the batch a different
request at its own position:

* ``offset`` is an array of shape ``(B,)``: ``mx.fast.rope`` gives every row its own positions.
* ``update_and_fetch`` scatters the new keys/values into the pool at the slots the block tables
  give, then gathers each row's whole context back through its block table.
* ``make_mask`` returns a boolean ``(B, 1, T, L)`` mask: causal within the row's own context,
  blind to padding.

Rows are right-padded to the longest row of the call. Padding tokens write into the null block
(slot 0..block_size-1 of block 0, never allocated to a request) and every padded query still sees
key 0, so no softmax row is empty (no NaN), and padded outputs are simply ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_mlx.errors import VllmMlxError

NULL_SLOT = 0


class UnsupportedModelError(VllmMlxError):
    """The model needs a cache we do not page (sliding window, recurrent state, ...)."""


def check_supported(model, model_type: str = "?") -> None:
    """Refuse architectures whose layers need anything but a plain full-attention KV cache."""
    from mlx_lm.models.cache import KVCache

    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return
    kinds = {type(c).__name__ for c in make_cache() if type(c) is not KVCache}
    if kinds:
        raise UnsupportedModelError(
            f"architecture {model_type!r} needs {', '.join(sorted(kinds))} caches "
            "(sliding-window or recurrent layers), which the paged engine does not support yet"
        )


@dataclass
class RowSpec:
    """One row of a forward call: ``tokens`` are new, ``num_computed`` tokens precede them, and
    ``block_ids`` (the request's block table) covers all of them."""

    tokens: list[int]
    num_computed: int
    block_ids: list[int]

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.tokens)

    def slots(self, block_size: int) -> np.ndarray:
        """Physical slots of positions ``0 .. context_len - 1``."""
        blocks = np.asarray(self.block_ids, dtype=np.int32)[:, None] * block_size
        return (blocks + np.arange(block_size, dtype=np.int32)).ravel()[: self.context_len]


@dataclass
class BatchLayout:
    """Index arrays shared by every layer during one forward call."""

    offsets: mx.array  # (B,) tokens already in the cache per row: RoPE offsets
    write_slots: mx.array  # (B*T,) destination slot of each new token (padding -> null block)
    gather_slots: mx.array  # (B, L) slots of each row's context (padding -> null block)
    mask: mx.array  # (B, 1, T, L) bool

    @classmethod
    def build(cls, rows: list[RowSpec], block_size: int) -> BatchLayout:
        num_new = max(len(r.tokens) for r in rows)
        context = max(r.context_len for r in rows)
        write = np.full((len(rows), num_new), NULL_SLOT, dtype=np.int32)
        gather = np.full((len(rows), context), NULL_SLOT, dtype=np.int32)
        for i, row in enumerate(rows):
            slots = row.slots(block_size)
            gather[i, : row.context_len] = slots
            write[i, : len(row.tokens)] = slots[row.num_computed :]
        computed = np.array([r.num_computed for r in rows], dtype=np.int32)
        query_pos = computed[:, None] + np.arange(num_new, dtype=np.int32)  # (B, T)
        key_pos = np.arange(context, dtype=np.int32)
        context_len = np.array([r.context_len for r in rows], dtype=np.int32)
        visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos < context_len[:, None, None])
        visible[:, :, 0] = True  # padded queries see key 0: no empty softmax row
        return cls(
            offsets=mx.array(computed),
            write_slots=mx.array(write.ravel()),
            gather_slots=mx.array(gather),
            mask=mx.array(visible[:, None, :, :]),
        )


class KVPool:
    """Keys and values of every layer, ``[n_kv_heads, num_slots, head_dim]`` per layer.

    Head-major, so that a gather through the block tables yields, per head and row, the context's
    keys as contiguous ``[L, head_dim]`` rows: attention reads them without another copy.

    Slot ``s`` belongs to block ``s // block_size``. Arrays are allocated on the first write, with
    the dtype and head shape the model produces, so the pool never guesses the activation dtype.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int) -> None:
        self.num_slots = num_blocks * block_size
        self.block_size = block_size
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store ``keys``/``values`` (``[n_kv_heads, len(slots), head_dim]``) at ``slots``."""
        if self.keys[layer] is None:
            self.keys[layer] = mx.zeros((keys.shape[0], self.num_slots, keys.shape[2]), dtype=keys.dtype)
            self.values[layer] = mx.zeros((values.shape[0], self.num_slots, values.shape[2]), dtype=values.dtype)
        self.keys[layer][:, slots] = keys
        self.values[layer][:, slots] = values

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values at ``slots`` (``[B, L]``), as ``[B, n_kv_heads, L, head_dim]``."""
        keys = self.keys[layer][:, slots].transpose(1, 0, 2, 3)
        values = self.values[layer][:, slots].transpose(1, 0, 2, 3)
        return keys, values

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class PagedLayerCache:
    """The mlx-lm cache protocol for one layer, over the shared pool and one batch layout."""

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout) -> None:
        self.pool = pool
        self.layer = layer
        self.layout = layout

    @property
    def offset(self) -> mx.array:
        return self.layout.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, heads, num_new, _ = keys.shape
        # [B, H, T, D] -> [H, B*T, D]: one row per new token, in write_slots order.
        flat_k = keys.transpose(1, 0, 2, 3).reshape(heads, batch * num_new, keys.shape[-1])
        flat_v = values.transpose(1, 0, 2, 3).reshape(heads, batch * num_new, values.shape[-1])
        self.pool.write(self.layer, self.layout.write_slots, flat_k, flat_v)
        return self.pool.gather(self.layer, self.layout.gather_slots)

    def make_mask(self, num_tokens: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise UnsupportedModelError("sliding-window attention is not supported by the paged cache")
        return self.layout.mask


class MLXAttentionBackend:
    """Builds the per-layer paged caches that a forward call hands to the model."""

    def __init__(self, pool: KVPool, num_layers: int) -> None:
        self.pool = pool
        self.num_layers = num_layers

    def make_caches(self, rows: list[RowSpec]) -> list[PagedLayerCache]:
        layout = BatchLayout.build(rows, self.pool.block_size)
        return [PagedLayerCache(self.pool, layer, layout) for layer in range(self.num_layers)]
