"""What each layer of a model needs from the KV cache (vLLM v1's ``KVCacheSpec`` idea).

Plain data, no MLX: the runner derives one spec per layer from the model
(``attention.layer_specs``), and the cache manager may one day size and free blocks per group.

Today every group keeps every block of every running request: a sliding-window layer attends
only to its window (the runner gathers and masks just those keys), but its out-of-window blocks
stay allocated, since all layers share one block table. Correct output, no memory saved yet.
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


LayerSpec = FullAttentionSpec | SlidingWindowSpec


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
