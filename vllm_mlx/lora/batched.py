"""Many adapters in one forward: the base projection once for all rows, then each row's low-rank
update from the adapter slot its request uses (the "BGMV" idea of vLLM's LoRA kernels, in MLX
operations).

``LoRASlots.wrap(model, max_loras, max_lora_rank)`` puts a ``BatchedLoRALinear`` around every
linear layer of the model's transformer blocks, once, before the runner measures or swaps
anything (the CPU backend's kernels then find the base layer inside the wrapper). Each wrapper
keeps, per slot, the factors ``a`` ``[slots, in, R]`` and ``b`` ``[slots, R, out]`` and a scale,
``R = max_lora_rank``: an adapter of a smaller rank is zero-padded, and the padding adds exactly
zero. Slot 0 is the base model (all zeros); slots are written by ``load`` between steps.

During a forward, ``rows(slot_per_row)`` says which slot each batch row uses. A row's update is
``scale[s] * (x @ a[s]) @ b[s]`` gathered by the row's slot ``s``: two batched matmuls for the
whole batch, whatever the mix of adapters. With no adapter row in the batch the wrappers return
the base layer's output untouched (base-only steps cost one Python call per layer).

DoRA slots also rescale their rows: ``gain[s] = m / ||W + scale * (a @ b)^T||`` per output
feature depends only on the adapter and the base weight, so it is computed once when the slot
is written, not per forward as mlx-lm's training layer does. A layer keeps ``gain`` and ``dora``
only once a DoRA adapter names it; rows of other slots keep their output exactly (a select, not
a multiply by one, so a bias is not subtracted and re-added).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from vllm_mlx.lora.adapter import Adapter, AdapterError, LoRAWeights, linear_dims


class BatchedLoRALinear(nn.Module):
    """A linear layer plus per-row low-rank updates from the slots (``LoRASlots``)."""

    def __init__(self, base: nn.Module, slots: LoRASlots, in_features: int, out_features: int) -> None:
        super().__init__()
        self.base = base
        self._slots = slots  # underscored: not a parameter, not a child module
        self._shape = (in_features, out_features)
        self._a: mx.array | None = None  # [slots, in, R], made when an adapter first names this layer
        self._b: mx.array | None = None  # [slots, R, out]
        self._scale: mx.array | None = None  # [slots]
        self._gain: mx.array | None = None  # [slots, out], made when a DoRA adapter first names this layer
        self._dora: mx.array | None = None  # [slots] bool

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rows = self._slots.current
        if rows is None or self._a is None:
            return y
        z = (x @ self._a[rows]) @ self._b[rows]
        out = y + (self._scale[rows][:, None, None] * z).astype(x.dtype)
        if self._gain is None:
            return out
        bias = self.base.bias if "bias" in self.base else None
        unbiased = out if bias is None else out - bias
        rescaled = self._gain[rows][:, None, :].astype(x.dtype) * unbiased
        if bias is not None:
            rescaled = rescaled + bias
        return mx.where(self._dora[rows][:, None, None], rescaled, out)

    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Write slot ``slot``'s factors (None: zeros, the adapter does not change this layer)."""
        count, rank = self._slots.num_slots, self._slots.max_rank
        if self._a is None:
            if weights is None:
                return
            in_features, out_features = self._shape
            self._a = mx.zeros((count, in_features, rank), dtype=mx.float32)
            self._b = mx.zeros((count, rank, out_features), dtype=mx.float32)
            self._scale = mx.zeros((count,), dtype=mx.float32)
        if weights is None:
            self._a[slot], self._b[slot], self._scale[slot] = 0, 0, 0.0
        else:
            a, b = weights.a, weights.b
            padded_a = mx.zeros(self._a.shape[1:], dtype=self._a.dtype)
            padded_b = mx.zeros(self._b.shape[1:], dtype=self._b.dtype)
            padded_a[:, : a.shape[1]] = a.astype(self._a.dtype)
            padded_b[: b.shape[0]] = b.astype(self._b.dtype)
            self._a[slot], self._b[slot], self._scale[slot] = padded_a, padded_b, weights.scale
        self._set_gain(slot, weights)
        mx.eval(self._a, self._b, self._scale, *(() if self._gain is None else (self._gain, self._dora)))

    def _set_gain(self, slot: int, weights: LoRAWeights | None) -> None:
        """DoRA's per-feature rescaling for ``slot`` (ones and off for anything but DoRA)."""
        dora = weights is not None and weights.magnitude is not None
        if self._gain is None:
            if not dora:
                return
            self._gain = mx.ones((self._slots.num_slots, self._shape[1]), dtype=mx.float32)
            self._dora = mx.zeros((self._slots.num_slots,), dtype=mx.bool_)
        if not dora:
            self._gain[slot], self._dora[slot] = 1.0, False
            return
        adapted = base_weight(self.base).astype(mx.float32) + weights.scale * (weights.a @ weights.b).T.astype(mx.float32)
        self._gain[slot] = weights.magnitude.astype(mx.float32) / mx.linalg.norm(adapted, axis=1)
        self._dora[slot] = True


class LoRASlots:
    """The adapter slots of one model: ``num_slots = max_loras + 1`` (slot 0: no adapter)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.num_slots = max_loras + 1
        self.max_rank = max_rank
        self.layers: dict[str, BatchedLoRALinear] = {}
        self.current: mx.array | None = None
        """The slot of each row of the forward running now (None: every row is the base model)."""

    @classmethod
    def wrap(cls, model: nn.Module, max_loras: int, max_rank: int) -> LoRASlots:
        """Wrap every linear layer inside the model's transformer blocks (paths with a
        ``layers.N.`` part); returns the slots, all empty."""
        slots = cls(max_loras, max_rank)
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.children().items()):
                path = f"{name}.{child_name}" if name else child_name
                dims = linear_dims(child) if isinstance(child, nn.Module) else None
                if dims is None or ".layers." not in f".{path}":
                    continue
                wrapper = BatchedLoRALinear(child, slots, *dims)
                setattr(module, child_name, wrapper)
                slots.layers[path] = wrapper
        if not slots.layers:
            raise ValueError("the model has no linear layers in transformer blocks to put adapters on")
        return slots

    @property
    def max_adapter_bytes(self) -> int:
        """The largest weights file an adapter that fits these slots can have: factors of
        ``max_rank`` and a magnitude on every wrapped layer, 8 bytes an element (float64, the
        widest), plus room for the header. A file over it is refused before it is read."""
        elements = sum((i + o) * self.max_rank + o for i, o in (layer._shape for layer in self.layers.values()))
        return elements * 8 + (1 << 20)

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put ``adapter`` in ``slot`` (1..max_loras), replacing what was there.

        Raises:
            AdapterError: Its rank exceeds ``max_lora_rank``, or it names a layer that takes no
                adapter (outside the transformer blocks).
        """
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not one of 1..{self.num_slots - 1}")
        self.check(adapter)
        for path, layer in self.layers.items():
            layer.set_slot(slot, adapter.modules.get(path))

    def check(self, adapter: Adapter) -> None:
        """Raise ``AdapterError`` unless ``adapter`` fits the slots (rank, layers)."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"the adapter in {adapter.path} has rank {adapter.rank}; max_lora_rank is {self.max_rank}")
        unknown = sorted(set(adapter.modules) - set(self.layers))
        if unknown:
            raise AdapterError(f"the adapter in {adapter.path} changes {unknown[0]!r}, which takes no adapter here")

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None)

    @contextmanager
    def rows(self, slot_per_row: Sequence[int]) -> Iterator[None]:
        """Run the forward inside with each batch row using its slot (0: the base model)."""
        self.current = mx.array(list(slot_per_row), dtype=mx.int32) if any(slot_per_row) else None
        try:
            yield
        finally:
            self.current = None


def base_weight(layer: nn.Module) -> mx.array:
    """A linear layer's ``[out, in]`` weight, dequantized if it is quantized."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits, layer.mode)
    return layer.weight
