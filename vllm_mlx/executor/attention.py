"""Paged attention for unmodified mlx-lm models.

mlx-lm model files talk to their KV cache through a tiny protocol: ``cache.offset`` (RoPE
positions), ``cache.update_and_fetch(keys, values)`` and ``cache.make_mask(...)``. The
``PagedLayerCache`` below implements that protocol over a shared block pool, so mlx-lm
architectures with full-attention and sliding-window layers run batched, with each row of the
batch a different request at its own position:

* ``offset`` is an array of shape ``(B,)``: ``mx.fast.rope`` gives every row its own positions.
* ``update_and_fetch`` scatters the new keys/values into the pool at the slots the block tables
  give, then gathers each row's keys back through its block table: the whole context for a
  full-attention layer, only the keys some query of the call still sees for a sliding-window
  layer (at most ``window - 1 + T`` per row).
* ``make_mask`` returns a boolean ``(B, 1, T, L)`` mask over the keys that *this* cache gathers:
  causal, blind to padding, and limited to the last ``window_size`` keys (the argument, else the
  layer's own window), exactly mlx-lm's ``create_causal_mask`` rule: a query at position ``p``
  sees keys ``p - window + 1 .. p``.

A request holds one block table per block group (``kv_spec.plan_block_groups``): a sliding-window
group's table has the null block where its blocks fell out of the window. The layers of one
group and window gather the same slots, and models ask for one mask per kind, so both are built
once per forward call (``BatchLayout`` caches them), not per layer.
The mask is a plain boolean array, which ``mx.fast.scaled_dot_product_attention`` takes together
with attention sinks (gpt-oss passes ``sinks=``: they only add a per-head term to the softmax).

Recurrent layers (hybrid models) get a ``RecurrentLayerCache`` over the state pool instead
(``state_pool.py``); which architectures, and whether their rows may be padded, is
``RECURRENT_ARCHITECTURES``.

Rows are right-padded to the longest row of the call. Padding tokens write into the null block
(slot 0..block_size-1 of block 0, never allocated to a request); a query that would see no key
(a padded one) sees the row's first gathered key, so no softmax row is empty (no NaN), and padded
outputs are simply ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_mlx.core.kv.spec import (
    BlockGroups,
    FullAttentionSpec,
    HeldCacheSpec,
    LayerSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    is_recurrent,
)
from vllm_mlx.executor.cache_list import flat_caches
from vllm_mlx.executor.held_caches import HELD_REFUSED
from vllm_mlx.executor.state_pool import RecurrentLayerCache, StateBatch, StatePool
from vllm_mlx.platform.errors import VllmMlxError

NULL_SLOT = 0

# Architectures whose recurrent layers (mlx-lm ``ArraysCache``) we have checked against mlx-lm,
# and whether their code honours right padding (masks padded tokens, reads ``cache.lengths``).
# Those that do not (nemotron_h does not pass ``lengths`` to its SSM; Mamba, RWKV-7, Jamba never
# read them) would corrupt a padded row's state: the runner never pads them. Pure recurrent
# models (no attention layer: Mamba, Mamba-2, RWKV-7) hold the state pool alone. Each is checked
# by an oracle test (docs/models.md names it); other ``ArraysCache`` users are refused until then.
RECURRENT_ARCHITECTURES: dict[str, bool] = {
    "lfm2": True,
    "lfm2_moe": True,
    "qwen3_5": True,
    "qwen3_5_moe": True,  # qwen3_5's layers with MoE MLPs (mlx-lm's text model and mlx-vlm's VLM)
    "qwen3_next": True,
    "prism_hadamard_qwen35": True,  # qwen3_5's layers, some 2-bit with a Hadamard rotation (mlx-lm and mlx-vlm)
    "granitemoehybrid": True,
    "nemotron_h": False,
    "mamba": False,
    "mamba2": True,
    "rwkv7": False,
    "jamba": False,
    "plamo2": True,
    "olmo_hybrid": False,
    "bailing_hybrid": True,
    "bailing_moe_linear": False,
    "bailing_moe_v3": True,
    "falcon_h1": True,  # a CacheList layer: the Mamba-2 state beside the attention's KV
    "baichuan_m1": False,  # a CacheList layer: the last key and value (a short convolution) beside the KV
    "lfm2-vl": True,  # LFM2-VL's text model, loaded by mlx-lm as text alone: lfm2's layers
    "lfm2_vl": True,  # LFM2-VL through mlx-vlm: the same layers
    "nemotron_h_nano_omni": False,  # Nemotron 3 Nano Omni through mlx-vlm: nemotron_h's layers, never padded
    "d1": True,  # d1 through mlx-vlm: LFM2-VL's model (typed-decision readouts added), the same layers
    "kimi_linear": False,  # Kimi Delta Attention layers beside MLA ones
    "kimi_k3": False,
    # mlx-vlm's Inkling: a CacheList layer, short-convolution states (keys, values, both residual
    # branches) beside the KV; never padded: its attention takes one row a call (ONE_ROW_PER_CALL).
    "inkling": False,
    "recurrent_gemma": False,
    "clef": True,  # mlx-vlm's CLEF: Qwen3.5's model whole (a subclass), a decision head beside it
    "indic_ocr": True,  # mlx-vlm's IndicOCR (OCR stage): Qwen3.5's model whole (a subclass)
    "minicpmv4_6": True,  # MiniCPM-V 4.6 through mlx-vlm: Qwen3.5's text model (its layers)
    "minicpmv4_7": True,  # MiniCPM-V 4.7 through mlx-vlm: Qwen3.5's (or Qwen3.5-MoE's) text model
    # PLaMo 2 VL through mlx-vlm: its own copy of plamo2's Mamba layers; never padded (no test pads them yet).
    "plamo2vl": False,
}


# Recurrent architectures whose code starts a sequence differently when its state is None (what
# mlx-lm's fresh ArraysCache holds, and what the state pool gives a call whose rows all start)
# than when it is zeros (what a starting row reads in a call with continuing rows): the runner
# never puts rows that start a sequence in a call with rows that continue one.
FRESH_ROWS_APART: dict[str, str] = {
    "recurrent_gemma": "its RG-LRU leaves a sequence's first input unscaled when its state is None",
}


# Architectures whose code takes one position for the whole batch, so rows at different
# positions cannot share a forward call: each row gets a call of its own (the paged cache,
# prefix caching and the rest are unchanged). The breadth sweep finds them: a step that fails
# batched and succeeds row by row (the engine's re-run) fails its "no failed step" check.
ONE_ROW_PER_CALL: dict[str, str] = {
    "gpt_bigcode": "its positions are np.arange(cache[0].offset, ...), one start for every row",
    "phi3small": "its block-sparse attention builds one block mask for every row, from one offset",
    # mlx-vlm's Jina VLM ("jvlm" in its checkpoints' config, "jina_vlm" its package).
    **dict.fromkeys(("jvlm", "jina_vlm"), "its rotary positions start at offset.max().item(), one start for every row"),
    "inkling": "its queries' positions are S - L from the S keys its cache returns (relative-bias mask, log "
    "scaling): one start for every row, right only where the row's keys are exactly its own",
}


# Architectures refused whatever their caches: their mlx-lm code fails in mlx-lm's own generation,
# so there is nothing to match (found by the breadth sweep).
BROKEN_IN_MLX_LM: dict[str, str] = {
    "olmo": (
        "mlx-lm's OLMo (1) attention adds the mask it is given to its scores, where mlx-lm passes the "
        "string 'causal' for a prompt of more than one token: it fails in mlx-lm itself (OLMo 2 and 3 "
        "checkpoints are the olmo2 and olmo3 architectures, which run)"
    ),
}


class UnsupportedModelError(VllmMlxError):
    """The model needs a cache we do not support (chunked attention, unchecked recurrent
    architectures, ...)."""


def layer_specs(model, model_type: str | None = None, recurrent: bool = True) -> list[LayerSpec]:
    """One spec per cache the model asks for (``model.make_cache()``, each member of a
    ``CacheList`` a cache of its own: ``CacheNesting``; without it, one full-attention layer per
    ``model.layers``). ``model_type`` defaults to the model's own.

    A model with a cache of another class (not a plain ``KVCache``, a ``RotatingKVCache``
    without kept tokens, nor the ``ArraysCache`` of an architecture in ``RECURRENT_ARCHITECTURES``)
    is one ``HeldCacheSpec``: the runner keeps its own caches per request (``held_caches.py``).

    Raises:
        UnsupportedModelError: Such a model with ``recurrent=False`` (which refuses recurrent
            layers too: the vLLM plugin), or one in ``HELD_REFUSED``; the message names the kinds.
    """
    model_type = model_type or model_type_of(model)
    if model_type in BROKEN_IN_MLX_LM:
        raise UnsupportedModelError(f"architecture {model_type!r} is refused: {BROKEN_IN_MLX_LM[model_type]}")
    if getattr(model, "holds_request_inputs", False) or getattr(model, "request_state", ()):
        # Per-request inputs beside the embeddings (mllama's cross-attention states: a vision adapter's
        # request_inputs) go with one row's calls, and state the model keeps per request between calls (its
        # ``request_state``) with the request's own caches, swapped onto the model for its row's call: the
        # caches are held per request, one row a call (held_caches.py).
        return [HeldCacheSpec()]
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return [FullAttentionSpec()] * len(model.layers)
    specs, refused = [], set()
    for cache in flat_caches(make_cache()):
        spec = _spec_of(cache, model_type if recurrent else None)
        if spec is None:
            refused.add(_describe(cache))
        specs.append(spec)
    if refused and recurrent and model_type not in HELD_REFUSED:
        return [HeldCacheSpec()]  # the model keeps its own caches, one set per request (held_caches.py)
    if refused:
        raise UnsupportedModelError(
            f"architecture {model_type!r} needs {', '.join(sorted(refused))} caches, which the paged "
            "engine does not support yet (it pages KVCache, RotatingKVCache and ChunkedKVCache layers "
            "and each member of a CacheList, and keeps the recurrent ArraysCache state of "
            + ("the architectures checked against mlx-lm, which `vllm-mlx models --supported` lists"
               if recurrent else "no architecture here") + ")"
            + "".join(f". {_WHY_NOT[kind]}" for kind in [*sorted(refused), model_type] if kind in _WHY_NOT)
            + (f". It {HELD_REFUSED[model_type]}" if model_type in HELD_REFUSED else "")
            + ("" if recurrent else _THROUGH_VLLM)
        )
    return specs


def chunk_sizes(model) -> dict[int, int]:
    """Per layer (spec index) with chunked attention (``ChunkedKVCache``: Llama 4), its chunk
    size; such a model runs one row per forward call (``ChunkedLayerCache``)."""
    make_cache = getattr(model, "make_cache", None)
    caches = flat_caches(make_cache()) if make_cache is not None else []
    return {i: c.chunk_size for i, c in enumerate(caches) if type(c) in _chunked_cache_types()}


def _chunked_cache_types() -> tuple[type, ...]:
    """mlx-lm's ``ChunkedKVCache``, and mlx-vlm's (its Llama 4 builds its own class) where installed."""
    from mlx_lm.models.cache import ChunkedKVCache

    try:
        from mlx_vlm.models.cache import ChunkedKVCache as VlmChunkedKVCache
    except ImportError:
        return (ChunkedKVCache,)
    return (ChunkedKVCache, VlmChunkedKVCache)


# What a cache kind (or an architecture's use of one) would need beyond the paged protocol, where
# it is more than a missing branch.
_WHY_NOT = {
    "LayerCache": (
        "DeepSeek-V4.1's LayerCache keeps, per layer, a sliding window, compressed groups of closed "
        "blocks and their index keys: a layout of its own, not pages (the engine's own path keeps it per "
        "request inside the batch, without prefix caching)"
    ),
    "longcat_flash_ngram": (
        "Its n-gram embedding keeps the last few token ids as a recurrent state that grows over "
        "the first tokens of a sequence (and treats a shorter history differently from one of "
        "zeros), which a fixed-size state slot cannot hold"
    ),
}


_THROUGH_VLLM = (
    ". Through vLLM (the MLX platform plugin) recurrent layers are not served yet; vllm-mlx's own "
    "engine serves them: `vllm-mlx serve MODEL` or `vllm_mlx.LLM(MODEL)`"
)


def check_supported(model, model_type: str | None = None, recurrent: bool = True) -> list[LayerSpec]:
    """Refuse architectures with a layer we cannot serve; return the layer specs."""
    return layer_specs(model, model_type, recurrent)


def model_type_of(model) -> str:
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "?")


def _spec_of(cache, recurrent_model_type: str | None) -> LayerSpec | None:
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
    from mlx_lm.utils import MODEL_REMAPPING

    if type(cache) is KVCache or type(cache) in _chunked_cache_types():  # chunked: stored as full
        return FullAttentionSpec()
    if type(cache) is RotatingKVCache and cache.keep == 0:
        return SlidingWindowSpec(cache.max_size)
    module = MODEL_REMAPPING.get(recurrent_model_type, recurrent_model_type)  # falcon_mamba: mamba's code
    if type(cache) is ArraysCache and module in RECURRENT_ARCHITECTURES:
        return RecurrentStateSpec(len(cache.cache), pads=RECURRENT_ARCHITECTURES[module])
    return None


def _describe(cache) -> str:
    keep = getattr(cache, "keep", 0)
    return f"{type(cache).__name__}(keep={keep})" if keep else type(cache).__name__


@dataclass
class RowSpec:
    """One row of a forward call: ``tokens`` are new, ``num_computed`` tokens precede them, and
    ``block_ids`` (the request's block table) covers all of them; with several block groups,
    ``block_tables`` holds one table per group (``block_ids`` is then the first)."""

    tokens: list[int]
    num_computed: int
    block_ids: list[int]
    state_slot: int = 0  # recurrent-state slot (models with recurrent layers)
    state_read_slot: int | None = None  # where the state is read from, when not state_slot
    checkpoint_slot: int | None = None  # a checkpoint slot the final state is also written to
    block_tables: list[list[int]] | None = None
    both_ways: list[tuple[int, int]] = field(default_factory=list)
    """Spans ``[start, end)`` of positions whose tokens attend to each other both ways
    (``MultiModalInput.both_ways``): a query in one also sees the span's later keys."""

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.tokens)

    def table(self, group: int) -> list[int]:
        return self.block_ids if self.block_tables is None else self.block_tables[group]

    def slots(self, block_size: int, group: int = 0) -> np.ndarray:
        """Physical slots of positions ``0 .. context_len - 1`` in ``group``'s table (positions
        in null entries map to the null block: never read, see ``BatchLayout.keys``)."""
        blocks = np.asarray(self.table(group), dtype=np.int32)[:, None] * block_size
        return (blocks + np.arange(block_size, dtype=np.int32)).ravel()[: self.context_len]


@dataclass
class KeyView:
    """The keys the layers of one window read in a forward call.

    Row ``i``'s gathered key ``j`` is the key at position ``start[i] + j``; gathered keys past
    the row's context are padding (null slot) and never visible.
    """

    start: np.ndarray  # (B,) position of each row's first gathered key
    gather_slots: mx.array  # (B, L) pool slots of the gathered keys


@dataclass
class KeyRanges:
    """Which gathered keys each query index can see at all, over every row of a call: query
    ``i`` of any row sees only keys ``first[i] <= j < stop[i]``. Attention kernels may skip the
    rest (the causal triangle of a prefill chunk, keys out of a sliding window)."""

    first: np.ndarray  # (T,)
    stop: np.ndarray  # (T,)

    @classmethod
    def of(cls, visible: np.ndarray) -> KeyRanges:
        """From a ``(B, T, L)`` visibility array (every query sees at least one key)."""
        width = visible.shape[-1]
        first = visible.argmax(axis=-1).min(axis=0)
        stop = width - visible[..., ::-1].argmax(axis=-1).min(axis=0)
        return cls(first.astype(np.int64), stop.astype(np.int64))


@dataclass
class GroupSlots:
    """One block group's slots in a forward call: where each row's positions live."""

    row_slots: list[np.ndarray]  # per row: the slots of positions 0 .. context_len - 1
    write_slots: mx.array  # (B*T,) destination slot of each new token (padding -> null block)


@dataclass
class BatchLayout:
    """Index arrays shared by every layer during one forward call.

    Key views and masks are built on first use and kept for the call: one per block group and
    distinct window (masks depend on positions only: one per window). Each mask comes with its
    ``KeyRanges``, for kernels that skip keys no query sees (``key_ranges``).
    """

    num_computed: np.ndarray  # (B,) tokens already in the cache per row
    context_len: np.ndarray  # (B,) num_computed + the row's new tokens
    num_new: int  # T: new tokens of the longest row
    groups: list[GroupSlots]  # per block group
    offsets: mx.array | int  # (B,) num_computed as an MLX array: RoPE offsets (one row: maybe a host int)
    both_ways: list[list[tuple[int, int]]] = field(default_factory=list)  # per row: RowSpec.both_ways
    _views: dict = field(default_factory=dict, init=False, repr=False)
    _masks: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def build(cls, rows: list[RowSpec], block_size: int, num_groups: int = 1, host_offset: bool = False) -> BatchLayout:
        """``host_offset``: the one row's offset as a Python int (``MLXAttentionBackend``)."""
        num_new = max(len(r.tokens) for r in rows)
        computed = np.array([r.num_computed for r in rows], dtype=np.int32)
        if host_offset and len(rows) != 1:
            raise ValueError(f"a host offset is one row's, got {len(rows)} rows")
        return cls(
            num_computed=computed,
            context_len=np.array([r.context_len for r in rows], dtype=np.int32),
            num_new=num_new,
            groups=[_group_slots(rows, block_size, group, num_new) for group in range(num_groups)],
            offsets=int(computed[0]) if host_offset else mx.array(computed),
            both_ways=[r.both_ways for r in rows],
        )

    def key_start(self, window: int | None) -> np.ndarray:
        """Per row, the first position some new query of the row still sees (0 without a
        window): the first key a layer with this window reads."""
        if window is None:
            return np.zeros_like(self.num_computed)
        return np.maximum(0, self.num_computed - window + 1)

    def keys(self, window: int | None, group: int = 0) -> KeyView:
        """The keys a layer of ``group`` with this window (None: full attention) reads: from the
        first position the row's first new query still sees, to the end of its context."""
        view = self._views.get((group, window))
        if view is None:
            start = self.key_start(window)
            gather = np.full((len(start), int((self.context_len - start).max())), NULL_SLOT, dtype=np.int32)
            for i, slots in enumerate(self.groups[group].row_slots):
                gather[i, : len(slots) - start[i]] = slots[start[i] :]
            view = self._views[(group, window)] = KeyView(start, mx.array(gather))
        return view

    def mask(self, keys_window: int | None, window: int | None) -> mx.array:
        """``(B, 1, T, L)`` visibility over the keys a layer with ``keys_window`` reads: causal,
        not padding, and within the last ``window`` positions (None: no limit); a query inside
        a both-ways span also sees the span's keys (window or not, as mlx-vlm's overlay)."""
        return self._mask_and_ranges(keys_window, window)[0]

    def key_ranges(self, mask: mx.array) -> KeyRanges | None:
        """The key ranges of a mask this layout built (None for any other array)."""
        for built, ranges in self._masks.values():
            if built is mask:
                return ranges
        return None

    def _mask_and_ranges(self, keys_window: int | None, window: int | None) -> tuple[mx.array, KeyRanges]:
        built = self._masks.get((keys_window, window))
        if built is None:
            start = self.key_start(keys_window)
            width = int((self.context_len - start).max())
            query_pos = self.num_computed[:, None] + np.arange(self.num_new, dtype=np.int32)  # (B, T)
            key_pos = start[:, None] + np.arange(width, dtype=np.int32)  # (B, L)
            q, k = query_pos[:, :, None], key_pos[:, None, :]
            visible = (k <= q) & (k < self.context_len[:, None, None])
            if window is not None:
                visible &= k > q - window
            self._see_spans_whole(visible, query_pos, key_pos)
            visible[:, :, 0] |= ~visible.any(axis=-1)  # padded queries: no empty softmax row
            built = self._masks[(keys_window, window)] = (mx.array(visible[:, None, :, :]), KeyRanges.of(visible))
        return built

    def _see_spans_whole(self, visible: np.ndarray, query_pos: np.ndarray, key_pos: np.ndarray) -> None:
        """Let each query inside a both-ways span see every key of the span this call gathers
        (the scheduler keeps a span's tokens in one chunk, so its later keys are all here)."""
        for row, spans in enumerate(self.both_ways):
            for start, end in spans:
                in_query = (query_pos[row] >= start) & (query_pos[row] < end)
                in_key = (key_pos[row] >= start) & (key_pos[row] < min(end, self.context_len[row]))
                visible[row] |= in_query[:, None] & in_key[None, :]


def _group_slots(rows: list[RowSpec], block_size: int, group: int, num_new: int) -> GroupSlots:
    row_slots = [r.slots(block_size, group) for r in rows]
    write = np.full((len(rows), num_new), NULL_SLOT, dtype=np.int32)
    for i, (row, slots) in enumerate(zip(rows, row_slots)):
        write[i, : len(row.tokens)] = slots[row.num_computed :]
    return GroupSlots(row_slots, mx.array(write.ravel()))


class KVPool:
    """Keys and values, ``[n_kv_heads, num_slots, head_dim]`` per array: one array per
    attention layer, or, with block groups, one per position in a group, shared by one layer of
    each group (``kv_spec.BlockGroups``).

    Head-major, so that a gather through the block tables yields, per head and row, the context's
    keys as contiguous ``[L, head_dim]`` rows: attention reads them without another copy.

    Slot ``s`` belongs to block ``s // block_size``. Arrays are allocated on the first write, with
    the dtype and head shape the model produces, so the pool never guesses the activation dtype.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, used: Iterable[int] | None = None) -> None:
        """``num_layers``: the number of arrays (layers, or positions in a block group);
        ``used``: the ones attention layers write (default: all; a hybrid model's recurrent
        layers have an index but no KV)."""
        self.num_slots = num_blocks * block_size
        self.block_size = block_size
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.used = list(range(num_layers)) if used is None else sorted(used)

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

    def block_slots(self, block_ids: list[int]) -> mx.array:
        """The slots of ``block_ids``, block after block."""
        size = self.block_size
        return mx.array([b * size + i for b in block_ids for i in range(size)])

    def read_blocks(self, block_ids: list[int]) -> dict[str, mx.array]:
        """The keys and values of ``block_ids`` in every written array, by name (``keys.{i}``,
        ``values.{i}``), each ``[n_kv_heads, len(block_ids) * block_size, head_dim]``."""
        slots = self.block_slots(block_ids)
        out = {}
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is not None:
                out[f"keys.{i}"], out[f"values.{i}"] = keys[:, slots], values[:, slots]
        return out

    def write_blocks(self, block_ids: list[int], arrays: dict[str, mx.array]) -> None:
        """Store what ``read_blocks`` gave (another pool's) into ``block_ids``.

        Raises:
            ValueError: the arrays do not fit this pool (names, head shapes, dtype, length).
        """
        expected = {f"{kind}.{i}" for i in self.used for kind in ("keys", "values")}
        if set(arrays) != expected:
            raise ValueError(f"the arrays are {sorted(arrays)[:4]}..., this model's pool has {len(self.used)} KV layers")
        slots = self.block_slots(block_ids)
        for i in self.used:
            keys, values = arrays[f"keys.{i}"], arrays[f"values.{i}"]
            for new, old in ((keys, self.keys[i]), (values, self.values[i])):
                if new.ndim != 3 or new.shape[1] != slots.size:
                    raise ValueError(f"layer {i}: shape {new.shape}, expected [heads, {slots.size}, head_dim]")
                if old is not None and (new.dtype != old.dtype or new.shape[::2] != old.shape[::2]):
                    raise ValueError(f"layer {i}: {new.dtype} {new.shape}, the pool holds {old.dtype} {old.shape}")
        for i in self.used:
            self.write(i, slots, arrays[f"keys.{i}"], arrays[f"values.{i}"])
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def layer_bytes_per_slot(self, layer: int) -> int:
        """Bytes one slot takes in ``layer`` (keys + values; 0 while the layer was never written)."""
        if self.keys[layer] is None:
            return 0
        return (self.keys[layer].nbytes + self.values[layer].nbytes) // self.num_slots

    @property
    def dtype(self) -> str | None:
        """The dtype name of the first written layer ("float32", "bfloat16", ...), None before."""
        written = self.arrays()
        return str(written[0].dtype).removeprefix("mlx.core.") if written else None


class PagedLayerCache:
    """The mlx-lm cache protocol for one layer, over the shared pool and one batch layout.

    ``window`` is the layer's sliding window (None: full attention); it decides which keys
    ``update_and_fetch`` returns, and ``make_mask`` always describes exactly those keys.
    """

    def __init__(
        self, pool: KVPool, layer: int, layout: BatchLayout, window: int | None = None, group: int = 0
    ) -> None:
        """``layer``: the pool array this layer uses; ``group``: its block group."""
        self.pool = pool
        self.layer = layer
        self.layout = layout
        self.window = window
        self.group = group
        self._fetched: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array | int:
        return self.layout.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, heads, num_new, _ = keys.shape
        # [B, H, T, D] -> [H, B*T, D]: one row per new token, in write_slots order.
        flat_k = keys.transpose(1, 0, 2, 3).reshape(heads, batch * num_new, keys.shape[-1])
        flat_v = values.transpose(1, 0, 2, 3).reshape(heads, batch * num_new, values.shape[-1])
        self.pool.write(self.layer, self.layout.groups[self.group].write_slots, flat_k, flat_v)
        fetched = self.pool.gather(self.layer, self.layout.keys(self._gather_window, self.group).gather_slots)
        # Start computing the layers built so far while Python builds the next ones: the model's
        # graph building (~10% of a decode step) then overlaps the computation.
        mx.async_eval(fetched)
        self._fetched = fetched
        return fetched

    @property
    def _gather_window(self) -> int | None:
        """The window whose keys ``update_and_fetch`` returns (the layer's own)."""
        return self.window

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last ``update_and_fetch`` of this forward call returned: the layers that
        share this layer's KV (Gemma 3n's last layers) read it here without writing."""
        if self._fetched is None:
            raise RuntimeError(f"layer {self.layer}'s keys are read before this forward call wrote them")
        return self._fetched

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """``keys_and_values()`` under the name mlx-vlm's KV-sharing layers read (Gemma 3n's ``cache.state``,
        where mlx-lm's call ``keys_and_values()``): read-only, so the shared layers never write the pool."""
        return self.keys_and_values()

    @property
    def keys(self) -> mx.array:
        """This layer's pool array of keys. Only mlx-lm's pipeline stages use it: a stage ties
        its ``send`` to its last layer's cache (``cache.keys = mx.depends(cache.keys, h)``), so
        that evaluating the cache sends the hidden states on; the runner evaluates the pool."""
        return self.pool.keys[self.layer]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self.pool.keys[self.layer] = value

    @property
    def values(self) -> mx.array:
        """This layer's pool array of values (read, as ``keys``, only to tie it into the graph:
        DeepSeek-V3.2's and MiniMax-M3's sparse-attention indexers)."""
        return self.pool.values[self.layer]

    @values.setter
    def values(self, value: mx.array) -> None:
        """Ignored: DeepSeek-V3.2's indexer, which never reads its values, assigns zeros the
        size of its cache here to drop them; the paged pool keeps what was written (zeros the
        size of the whole pool would be allocated in every step)."""

    def make_mask(self, num_tokens: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """The mask over this layer's keys; ``window_size`` (else the layer's own window) limits
        each query to its last ``window_size`` keys, as ``RotatingKVCache.make_mask`` does."""
        return self.layout.mask(self.window, window_size or self.window)


class ChunkedLayerCache(PagedLayerCache):
    """A chunked-attention layer (Llama 4: a query sees only the keys of its own ``chunk`` of
    positions) in a forward call of one row.

    mlx-lm's Llama 4 builds the chunk mask itself, from ``start_position`` and ``offset`` as host
    integers, over keys that begin at ``start_position``; rows at different positions cannot
    share that mask, so the runner gives such a model one row per call. Keys are stored as full
    attention's (every block kept: a chunk's blocks could return to the pool once passed, as a
    sliding window's do) and gathered from the start of the first query's chunk, the earliest key
    any query of the call sees: the sliding-window gather, with the window that reaches back
    exactly that far (masks stay full attention's: the model builds its chunk mask itself).
    """

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout, chunk: int, group: int = 0) -> None:
        if not isinstance(layout.offsets, int):
            raise ValueError("chunked attention runs one row per forward call, at a host offset")
        super().__init__(pool, layer, layout, None, group)
        self.chunk = chunk

    @property
    def start_position(self) -> int:
        return self.offset // self.chunk * self.chunk

    @property
    def _gather_window(self) -> int:
        return self.offset - self.start_position + 1

    def maybe_trim_front(self) -> None:
        """Nothing to trim: the gather starts at ``start_position`` (mlx-lm's cache trims here)."""


class MLXAttentionBackend:
    """Builds the per-layer caches that a forward call hands to the model: paged KV for
    attention layers, state-pool views for recurrent ones (``state_pool`` is then required)."""

    def __init__(
        self,
        pool: KVPool,
        specs: list[LayerSpec],
        state_pool: StatePool | None = None,
        block_groups: BlockGroups | None = None,
        chunks: dict[int, int] | None = None,
        host_offsets: bool = False,
    ) -> None:
        """``chunks``: the chunk size of each chunked-attention layer (``chunk_sizes``);
        ``host_offsets``: calls hold one row, whose caches give its offset as a Python int
        (for model code that computes positions on the host: ``ONE_ROW_PER_CALL``, Llama 4)."""
        self.pool = pool
        self.specs = list(specs)
        self.chunks = dict(chunks or {})
        self.host_offsets = host_offsets
        self.state_pool = state_pool
        self.block_groups = block_groups or BlockGroups.single(self.specs)
        self._group_of = {layer: self.block_groups.group_of_layer(layer) for layer in self.block_groups.array_of_layer}

    def make_caches(self, rows: list[RowSpec]) -> list[PagedLayerCache | RecurrentLayerCache]:
        layout = BatchLayout.build(rows, self.pool.block_size, len(self.block_groups.groups), self.host_offsets)
        states = None
        if self.state_pool is not None:
            states = StateBatch.build(
                [r.state_slot for r in rows],
                [r.num_computed for r in rows],
                [len(r.tokens) for r in rows],
                read_slots=[r.state_slot if r.state_read_slot is None else r.state_read_slot for r in rows],
                checkpoint_slots=[r.checkpoint_slot for r in rows],
            )
        return [
            RecurrentLayerCache(self.state_pool, layer, states) if is_recurrent(spec) else self._paged(layer, layout)
            for layer, spec in enumerate(self.specs)
        ]

    def _paged(self, layer: int, layout: BatchLayout) -> PagedLayerCache:
        array = self.block_groups.array_of_layer[layer]
        if layer in self.chunks:
            return ChunkedLayerCache(self.pool, array, layout, self.chunks[layer], self._group_of[layer])
        return PagedLayerCache(self.pool, array, layout, self.specs[layer].window, self._group_of[layer])
