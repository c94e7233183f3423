"""What each layer of a model needs from the KV cache (vLLM v1's ``KVCacheSpec`` idea).

Plain data, no MLX: the runner derives one spec per layer from the model
(``attention.layer_specs``), and ``plan_block_groups`` decides which layers share a block table.

Block groups (vLLM v1's hybrid KV cache groups): a request holds one block table per group, all
over one pool of block ids. The KV pool's arrays are shared across groups: array ``j`` holds
layer ``j`` of *every* group, so a block id costs ``num_arrays`` layers' worth of memory, whichever
group holds it. A sliding-window group needs only the blocks its window still reaches; the
others go back to the pool as the sequence grows, which is where the memory is saved. This needs
every attention layer to store the same KV shape and dtype; otherwise (and for models whose
attention layers are all of one kind) all attention layers form one group that keeps every block,
and a sliding-window layer only reads its window.

A recurrent layer (``RecurrentStateSpec``) holds no blocks at all: its state is a fixed-size slot
per running request in the state pool (``state_pool.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_mlx.core.fields import known_fields


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """The layer attends to every earlier key of the sequence (mlx-lm's ``KVCache``)."""

    kind: ClassVar[str] = "full_attention"

    @property
    def window(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """The layer attends to the last ``window`` keys, its own included: a query at position
    ``p`` sees keys at positions ``p - window + 1 .. p`` (mlx-lm's ``RotatingKVCache(max_size=
    window)`` and ``create_causal_mask(..., window_size=window)``)."""

    kind: ClassVar[str] = "sliding_window"
    window: int

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window holds at least one key, got {self.window}")


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """The layer keeps a fixed-size state per request (mlx-lm's ``ArraysCache(num_arrays)``:
    a convolution window, an SSM or delta-net state), whatever the sequence length.

    ``pads``: the model's code for this layer honours right padding (it masks padded tokens
    and reads ``cache.lengths`` to take the state at each row's last real token), so rows of
    different lengths may share a forward call. Otherwise the runner never pads such a model.
    """

    kind: ClassVar[str] = "recurrent_state"
    num_arrays: int
    pads: bool

    @property
    def window(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class HeldCacheSpec:
    """The whole model keeps its own cache objects, one set per request, held by the runner
    (``executor/held_caches.py``): its ``make_cache`` returns a class the engine does not page.
    The model is then this one spec; its blocks hold no arrays, they count tokens, so the block
    budget bounds the tokens in flight (``bytes_per_token`` measured from the held caches)."""

    kind: ClassVar[str] = "held_per_request"

    @property
    def window(self) -> None:
        return None


LayerSpec = FullAttentionSpec | SlidingWindowSpec | RecurrentStateSpec | HeldCacheSpec


def is_recurrent(spec: LayerSpec) -> bool:
    return isinstance(spec, RecurrentStateSpec)


def is_held(specs: list[LayerSpec]) -> bool:
    """Whether ``specs`` are a held-cache model's (``HeldCacheSpec``: its caches are its own)."""
    return any(isinstance(spec, HeldCacheSpec) for spec in specs)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that need the same kind of cache, in model order (the unit that will get its own
    block tables once sliding-window blocks are freed)."""

    spec: LayerSpec
    layers: tuple[int, ...]


def group_layers(specs: list[LayerSpec]) -> list[LayerGroup]:
    """Group layer indices by spec, groups in order of their first layer."""
    groups: dict[LayerSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        groups.setdefault(spec, []).append(layer)
    return [LayerGroup(spec, tuple(layers)) for spec, layers in groups.items()]


@dataclass(frozen=True, slots=True)
class BlockGroup:
    """Attention layers that share one block table per request. ``window``: the group's
    sliding window (blocks wholly before it are freed); None keeps every block."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class BlockGroups:
    """Which attention layer uses which block group and which KV array. Group 0 keeps every
    block (full attention): its table is the request's primary one (prefix hits are counted on
    it)."""

    groups: tuple[BlockGroup, ...]
    array_of_layer: dict[int, int]
    num_arrays: int

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def group_of_layer(self, layer: int) -> int:
        return next(i for i, g in enumerate(self.groups) if layer in g.layers)

    @classmethod
    def single(cls, specs: list[LayerSpec]) -> BlockGroups:
        """Every attention layer in one group that keeps every block, each with its own array."""
        layers = tuple(i for i, spec in enumerate(specs) if not is_recurrent(spec))
        return cls((BlockGroup(None, layers),), {layer: layer for layer in layers}, len(specs))


def plan_block_groups(specs: list[LayerSpec], uniform_layers: bool) -> BlockGroups:
    """Split the attention layers into block groups of equal size (the smallest kind's layer
    count), full-attention groups first, when that saves memory: the model mixes sliding-window
    and full layers and ``uniform_layers`` (every attention layer stores the same KV shape and
    dtype, so they can share arrays). Otherwise ``BlockGroups.single``."""
    kinds = [kind for kind in group_layers(specs) if not is_recurrent(kind.spec)]
    has_full = any(k.spec.window is None for k in kinds)
    if len(kinds) < 2 or not has_full or not uniform_layers:
        return BlockGroups.single(specs)
    size = min(len(k.layers) for k in kinds)
    groups, array_of_layer = [], {}
    for kind in sorted(kinds, key=lambda k: k.spec.window is not None):  # full attention first
        for start in range(0, len(kind.layers), size):
            chunk = kind.layers[start : start + size]
            groups.append(BlockGroup(kind.spec.window, chunk))
            array_of_layer.update((layer, j) for j, layer in enumerate(chunk))
    return BlockGroups(tuple(groups), array_of_layer, size)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """A layer group's memory: ``bytes_per_token`` is the keys and values one token takes in
    all of the group's layers, as the model writes them (dtype, KV heads, key and value sizes);
    ``bytes_per_request`` the fixed state a running request holds in them (recurrent groups)."""

    spec: LayerSpec
    layers: tuple[int, ...]
    bytes_per_token: int
    bytes_per_request: int = 0

    def view(self, dtype: str, num_blocks: int, num_state_slots: int = 0, num_checkpoints: int = 0) -> KVGroupView:
        """What snapshots show of the group: a paged group draws on the pool's ``num_blocks``
        blocks (shared by every block group, see the module docstring); a state group has
        ``num_state_slots`` slots of ``bytes_per_request`` for running requests and
        ``num_checkpoints`` more for states kept at block boundaries."""
        kind = getattr(self.spec, "kind", type(self.spec).__name__)
        view = KVGroupView(kind, getattr(self.spec, "window", None), list(self.layers), self.bytes_per_token, dtype)
        if self.bytes_per_request:
            view.bytes_per_request, view.state_slots, view.state_checkpoints = (
                self.bytes_per_request, num_state_slots, num_checkpoints)  # fmt: skip
        else:
            view.num_blocks = num_blocks
        return view


@dataclass
class KVGroupView:
    """A layer group as snapshots show it (``cache_snapshot()["kv_groups"]``), fixed for the
    engine's life. A paged group has ``num_blocks``; a recurrent-state group has
    ``bytes_per_request``, ``state_slots`` and ``state_checkpoints`` instead (the others are
    None and left out of ``to_dict``)."""

    kind: str
    """``"full_attention"``, ``"sliding_window"``, ``"recurrent_state"``, ..."""
    window: int | None
    """Sliding window in tokens; None for full attention and state groups."""
    layers: list[int]
    bytes_per_token: int
    """Keys and values one token takes in all the group's layers."""
    dtype: str
    """The KV dtype's name, e.g. ``"bfloat16"``."""
    num_blocks: int | None = None
    """Blocks of the shared pool (including the null block)."""
    bytes_per_request: int | None = None
    state_slots: int | None = None
    """Slots for running requests' states."""
    state_checkpoints: int | None = None
    """Slots for states kept at block boundaries."""

    def to_dict(self) -> dict:
        data = {"kind": self.kind, "window": self.window, "layers": list(self.layers),
                "bytes_per_token": self.bytes_per_token}  # fmt: skip
        if self.bytes_per_request is not None:
            data |= {"bytes_per_request": self.bytes_per_request, "state_slots": self.state_slots,
                     "state_checkpoints": self.state_checkpoints}  # fmt: skip
        else:
            data["num_blocks"] = self.num_blocks
        return data | {"dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict) -> KVGroupView:
        """The inverse of ``to_dict``; a server's view may leave out ``bytes_per_token`` (0) and
        ``dtype`` ("")."""
        return cls(**{"bytes_per_token": 0, "dtype": "", **known_fields(cls, data)})


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the KV pool holds per token, group by group, measured from the model (``dtype`` is
    the name of the dtype its keys and values have, e.g. "bfloat16")."""

    groups: tuple[GroupLayout, ...]
    dtype: str
    uniform_layers: bool = False
    """Every attention layer stores keys and values of one shape and dtype."""

    def block_groups(self, specs: list[LayerSpec]) -> BlockGroups:
        return plan_block_groups(specs, self.uniform_layers)

    def bytes_per_block_token(self, block_groups: BlockGroups) -> int:
        """What one token of one block id costs: every layer's keys and values with one group,
        else ``num_arrays`` layers' (the arrays are shared across groups)."""
        if len(block_groups.groups) == 1:
            return self.bytes_per_token
        attention = [g for g in self.groups if g.bytes_per_request == 0]
        per_layer = attention[0].bytes_per_token // len(attention[0].layers)
        return per_layer * block_groups.num_arrays

    @property
    def bytes_per_token(self) -> int:
        return sum(group.bytes_per_token for group in self.groups)

    def blocks_for_budget(self, budget_bytes: int, block_size: int, block_groups: BlockGroups | None = None) -> int:
        """How many blocks (plus the null block) ``budget_bytes`` holds (``blocks_for_bytes``)."""
        per_token = self.bytes_per_token if block_groups is None else self.bytes_per_block_token(block_groups)
        return blocks_for_bytes(budget_bytes, block_size, per_token)

    def views(self, num_blocks: int, num_state_slots: int = 0, num_checkpoints: int = 0) -> list[KVGroupView]:
        """Each group as snapshots show it (``GroupLayout.view``)."""
        return [group.view(self.dtype, num_blocks, num_state_slots, num_checkpoints) for group in self.groups]


STATE_ONLY_BLOCKS = 1 << 15
"""The blocks of a model that writes no keys or values (pure recurrent: Mamba, RWKV-7). They
hold no arrays, only what the scheduler counts tokens by and the prefix cache hashes (its hits
resume from state checkpoints), so they cost no memory: this many bound only the tokens in
flight (half a million at 16 tokens a block); the state slots bound the requests."""


def blocks_for_bytes(budget_bytes: int, block_size: int, bytes_per_block_token: int) -> int:
    """How many blocks (plus the null block) ``budget_bytes`` holds, one token of a block id
    costing ``bytes_per_block_token`` (``KVLayout.bytes_per_block_token``); ``STATE_ONLY_BLOCKS``
    when blocks cost nothing.

    Raises:
        ValueError: The budget holds no block.
    """
    per_block = bytes_per_block_token * block_size
    if per_block == 0:
        return STATE_ONLY_BLOCKS
    num_blocks = budget_bytes // per_block + 1
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory={budget_bytes} bytes holds no block ({per_block} bytes each)")
    return int(num_blocks)
