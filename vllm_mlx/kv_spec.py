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


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """The layer attends to every earlier key of the sequence (mlx-lm's ``KVCache``)."""

    @property
    def window(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """The layer attends to the last ``window`` keys, its own included: a query at position
    ``p`` sees keys at positions ``p - window + 1 .. p`` (mlx-lm's ``RotatingKVCache(max_size=
    window)`` and ``create_causal_mask(..., window_size=window)``)."""

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
