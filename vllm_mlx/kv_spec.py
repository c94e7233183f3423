"""What each layer of a model needs from the KV cache (vLLM v1's ``KVCacheSpec`` idea).

Plain data, no MLX: the runner derives one spec per layer from the model
(``attention.layer_specs``), and the cache manager may one day size and free blocks per group.

Today every group keeps every block of every running request: a sliding-window layer attends
only to its window (the runner gathers and masks just those keys), but its out-of-window blocks
stay allocated, since all layers share one block table. Correct output, no memory saved yet.

A recurrent layer (``RecurrentStateSpec``) holds no blocks at all: its state is a fixed-size slot
per running request in the state pool (``state_pool.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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


LayerSpec = FullAttentionSpec | SlidingWindowSpec | RecurrentStateSpec


def is_recurrent(spec: LayerSpec) -> bool:
    return isinstance(spec, RecurrentStateSpec)


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
class GroupLayout:
    """A layer group's memory: ``bytes_per_token`` is the keys and values one token takes in
    all of the group's layers, as the model writes them (dtype, KV heads, key and value sizes);
    ``bytes_per_request`` the fixed state a running request holds in them (recurrent groups)."""

    spec: LayerSpec
    layers: tuple[int, ...]
    bytes_per_token: int
    bytes_per_request: int = 0

    def to_dict(self, num_blocks: int, num_state_slots: int = 0, num_checkpoints: int = 0) -> dict:
        """Plain data for snapshots: a paged group has all ``num_blocks`` blocks today (the
        groups share one block table, see the module docstring); a state group has
        ``num_state_slots`` slots of ``bytes_per_request`` for running requests and
        ``num_checkpoints`` more for states kept at block boundaries."""
        kind = getattr(self.spec, "kind", type(self.spec).__name__)
        info = {"kind": kind, "window": getattr(self.spec, "window", None), "layers": list(self.layers),
                "bytes_per_token": self.bytes_per_token}  # fmt: skip
        if self.bytes_per_request:
            return info | {"bytes_per_request": self.bytes_per_request, "state_slots": num_state_slots,
                           "state_checkpoints": num_checkpoints}  # fmt: skip
        return info | {"num_blocks": num_blocks}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the KV pool holds per token, group by group, measured from the model (``dtype`` is
    the name of the dtype its keys and values have, e.g. "bfloat16")."""

    groups: tuple[GroupLayout, ...]
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        return sum(group.bytes_per_token for group in self.groups)

    def blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """How many blocks (plus the null block) ``budget_bytes`` holds.

        Raises:
            ValueError: The budget holds no block.
        """
        per_block = self.bytes_per_token * block_size
        if per_block == 0:
            raise ValueError("the model writes no keys or values: nothing to size the KV pool by")
        num_blocks = budget_bytes // per_block + 1
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={budget_bytes} bytes holds no block ({per_block} bytes each)")
        return int(num_blocks)

    def to_dicts(self, num_blocks: int, num_state_slots: int = 0, num_checkpoints: int = 0) -> list[dict]:
        return [group.to_dict(num_blocks, num_state_slots, num_checkpoints) | {"dtype": self.dtype}
                for group in self.groups]  # fmt: skip
