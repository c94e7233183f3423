"""Recurrent state for unmodified mlx-lm models: a slot pool and mlx-lm's ``ArraysCache`` protocol.

Hybrid models (Qwen3.5/Qwen3-Next gated delta-nets, LFM2 short convolutions, Mamba-2 hybrids)
keep, per recurrent layer, a few arrays of fixed size per sequence: ``cache[0]`` a convolution
window, ``cache[1]`` an SSM or delta-net state. Their code reads ``cache[i]`` (None: start from
zeros), assigns ``cache[i] = new``, calls ``cache.advance(T)``, and, for right-padded batches,
masks padded tokens with ``cache.make_mask(T)`` and takes the state at each row's last real
token through ``cache.lengths``.

* ``StatePool`` holds, per recurrent layer and array, one ``[num_slots, ...]`` array; a running
  request owns one slot (``state_slots.py``, on the scheduler's side). Shapes and dtypes come
  from a probe: one token through the model with mlx-lm's own caches (``probe_state_layout``).
* ``RecurrentLayerCache`` is one layer's cache in one forward call: ``cache[i]`` gathers the
  rows' slots (zeros for a request that has computed nothing yet, so slots never need clearing),
  ``cache[i] = v`` is *held*, not written.
* Held states are written to the pool only once the whole step succeeded (``StatePool.commit``).
  The engine re-runs each request of a failed step alone; a re-run must start from the state
  before the step, so a failed step leaves the pool untouched.
* A row may read from another slot than the one it writes (a prefix hit resumes from a state
  checkpoint, ``core/kv/checkpoints.py``) and may write its final state into a checkpoint slot too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from vllm_mlx.core.kv.spec import LayerSpec, is_recurrent
from vllm_mlx.executor.cache_list import flat_caches


@dataclass(frozen=True)
class StateArray:
    """One state array of one request: its shape (without the batch axis) and dtype."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.size


@dataclass(frozen=True)
class StateLayout:
    """Per recurrent layer (its cache index), its state arrays; None for an array the model
    never sets."""

    layers: dict[int, tuple[StateArray | None, ...]]

    @property
    def bytes_per_request(self) -> int:
        return sum(a.nbytes for arrays in self.layers.values() for a in arrays if a is not None)


def probe_state_layout(model, specs: list[LayerSpec]) -> StateLayout:
    """Run one token through ``model`` with mlx-lm's own caches and read the state arrays it
    leaves (shapes do not depend on the sequence length; dtypes are the model's own)."""
    caches = model.make_cache()
    mx.eval(model(mx.array([[0]]), cache=caches))
    caches = flat_caches(caches)  # one per spec
    layers = {}
    for index, spec in enumerate(specs):
        if is_recurrent(spec):
            arrays = [caches[index][i] for i in range(spec.num_arrays)]
            layers[index] = tuple(None if a is None else StateArray(tuple(a.shape[1:]), a.dtype) for a in arrays)
    return StateLayout(layers)


@dataclass
class StateBatch:
    """The rows of one forward call as the recurrent layers see them (shared by every layer)."""

    read_slots: mx.array  # (B,) where each row's state comes from (its slot, or a checkpoint)
    keep: mx.array | None  # (B,) False for rows starting from zeros; None when no row does
    all_fresh: bool  # every row starts from zeros: reads return None (the model makes zeros)
    lengths: mx.array | None  # (B,) real tokens per row when rows are padded, else None
    mask: mx.array | None  # (B, T) real (not padding) tokens when rows are padded, else None
    # (row, slot) pairs where the rows' new states go: each row's own slot, then the checkpoint
    # slots of rows that keep one. Host ints: the commit writes slot by slot (``StatePool.commit``).
    targets: tuple[tuple[int, int], ...] = ()

    @classmethod
    def build(
        cls,
        slots: list[int],
        num_computed: list[int],
        num_new: list[int],
        read_slots: list[int] | None = None,
        checkpoint_slots: list[int | None] | None = None,
    ) -> StateBatch:
        fresh = np.array(num_computed) == 0
        width = max(num_new)
        padded = any(n != width for n in num_new)
        lengths = np.array(num_new, dtype=np.int32)
        kept = [(row, slot) for row, slot in enumerate(checkpoint_slots or ()) if slot is not None]
        return cls(
            read_slots=mx.array(np.array(read_slots if read_slots is not None else slots, dtype=np.int32)),
            keep=mx.array(~fresh) if fresh.any() and not fresh.all() else None,
            all_fresh=bool(fresh.all()),
            lengths=mx.array(lengths) if padded else None,
            mask=mx.array(np.arange(width)[None, :] < lengths[:, None]) if padded else None,
            targets=tuple((row, int(slot)) for row, slot in enumerate(slots)) + tuple(kept),
        )


@dataclass
class StateWrite:
    """A state array computed in a step, to be written once the step succeeded: row ``r`` of
    ``value`` into slot ``s`` for each ``(r, s)`` of ``targets``."""

    layer: int
    index: int
    targets: tuple[tuple[int, int], ...]
    value: mx.array


class StatePool:
    """The recurrent state of every request: per layer and array, ``[num_slots, ...]``.

    Slot 0 is the null slot (never a request's). Allocated up front from the probed layout, so
    its memory is counted before the KV pool is sized.
    """

    def __init__(self, layout: StateLayout, num_slots: int) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.arrays: dict[int, list[mx.array | None]] = {
            layer: [None if a is None else mx.zeros((num_slots, *a.shape), dtype=a.dtype) for a in arrays]
            for layer, arrays in layout.layers.items()
        }

    def read(self, layer: int, index: int, batch: StateBatch) -> mx.array | None:
        """Rows' state array ``index`` of ``layer`` (zeros for fresh rows), or None when every
        row is fresh or the model never sets this array."""
        pool = self.arrays[layer][index]
        if pool is None or batch.all_fresh:
            return None
        value = pool[batch.read_slots]
        if batch.keep is not None:
            value = mx.where(batch.keep.reshape(-1, *([1] * (value.ndim - 1))), value, mx.zeros_like(value))
        return value

    def commit(self, writes: list[StateWrite], skip_slots: set[int] | frozenset[int] = frozenset()) -> None:
        """Write a successful step's states into the pool, in place, except into ``skip_slots``
        (rows whose state must stay as it was before the step: a rejected proposed token).

        One slice update per (row, slot), not one scatter per array: MLX's CPU scatter goes
        element by element (~14x slower for 1 MB rows), while a slice update into a buffer
        nothing else references is a plain copy of the row into the pool's own buffer.
        """
        written = {}
        for w in writes:
            pool = self.arrays[w.layer][w.index]
            if pool is None:
                raise ValueError(f"layer {w.layer} set state array {w.index}, which the probe never saw")
            value = w.value.astype(pool.dtype)
            for row, slot in w.targets:
                if slot not in skip_slots:
                    pool[slot : slot + 1] = value[row : row + 1]
            written[w.layer, w.index] = pool
        mx.eval(list(written.values()))

    def read_slot(self, slot: int) -> dict[str, mx.array]:
        """Slot ``slot``'s state, by name (``state.{layer}.{index}``), each ``[1, ...]``."""
        return {
            f"state.{layer}.{index}": pool[slot : slot + 1]
            for layer, arrays in self.arrays.items()
            for index, pool in enumerate(arrays)
            if pool is not None
        }

    def write_slot(self, slot: int, state: dict[str, mx.array]) -> None:
        """Store what ``read_slot`` gave (another process's) into slot ``slot``.

        Raises:
            ValueError: the arrays do not fit this pool (names, shapes, dtypes).
        """
        pools = {f"state.{layer}.{i}": pool for layer, arrays in self.arrays.items() for i, pool in enumerate(arrays)}
        pools = {name: pool for name, pool in pools.items() if pool is not None}
        if set(state) != set(pools):
            raise ValueError(f"the state arrays are {sorted(state)[:4]}..., this model's are {sorted(pools)[:4]}...")
        for name, value in state.items():
            pool = pools[name]
            if value.shape != (1, *pool.shape[1:]) or value.dtype != pool.dtype:
                raise ValueError(f"{name}: {value.dtype} {value.shape}, the pool holds {pool.dtype} [1, {pool.shape[1:]}]")
        for name, value in state.items():
            pools[name][slot : slot + 1] = value
        mx.eval(list(pools.values()))

    def all_arrays(self) -> list[mx.array]:
        return [a for arrays in self.arrays.values() for a in arrays if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.all_arrays())


@dataclass
class RecurrentLayerCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` protocol for one recurrent layer during one forward call.

    A subclass of ``ArraysCache`` (none of whose state or methods it uses) because model code
    asks: Mamba stores its new state only ``if isinstance(cache, ArraysCache)``.
    ``lengths`` starts as the rows' real token counts (None when no row is padded) and, as in
    mlx-lm, ``advance(T)`` lowers it. ``make_mask(T)`` is True on real tokens (None: no padding).
    """

    left_padding = None  # rows are right-padded (``lengths``); mlx-vlm's LFM2 reads this too
    pool: StatePool
    layer: int
    batch: StateBatch
    lengths: mx.array | None = None
    held: dict[int, mx.array] = field(default_factory=dict)
    _read: dict[int, mx.array | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.lengths = self.batch.lengths

    def __getitem__(self, index: int) -> mx.array | None:
        if index in self.held:
            return self.held[index]
        if index not in self._read:
            self._read[index] = self.pool.read(self.layer, index, self.batch)
        return self._read[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.held[index] = value

    def __bool__(self) -> bool:  # models test ``if cache:``
        return True

    @property
    def keys(self) -> mx.array | None:
        """State array 0, under the name mlx-lm's pipeline stages use for a last layer that is
        not an ``ArraysCache`` (Qwen3-Next: ``cache.keys = mx.depends(cache.keys, h)``, so that
        evaluating the state sends the hidden states on; the runner evaluates held states)."""
        return self[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self[0] = value

    def advance(self, num_tokens: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - num_tokens

    def make_mask(self, num_tokens: int, **_) -> mx.array | None:
        return self.batch.mask

    def writes(self) -> list[StateWrite]:
        """What this call computed, for ``StatePool.commit`` once the step succeeded: each row's
        new state into its slot, and into its checkpoint slot for rows that keep one."""
        return [StateWrite(self.layer, i, self.batch.targets, v) for i, v in self.held.items()]
