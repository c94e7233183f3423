"""Which engine owns which loaded model.

A model's weights and KV pool belong to the engine thread that loaded them (MLX streams are
thread-local), so one model directory is owned by one live engine at a time. A second engine
claiming it gets ``ModelOwnershipError`` unless it forces the takeover; a stopped (or garbage
collected) engine releases its claim.
"""

from __future__ import annotations

import threading
import weakref

from vllm_mlx.platform.errors import VllmMlxError


class ModelOwnershipError(VllmMlxError):
    """The model is already owned by another live engine."""


class ModelRegistry:
    def __init__(self) -> None:
        self._owners: dict[str, weakref.ref] = {}
        self._lock = threading.Lock()

    def claim(self, model_key: str, owner: object, *, force: bool = False) -> None:
        with self._lock:
            current = self.owner(model_key)
            if current is not None and current is not owner and not force:
                raise ModelOwnershipError(
                    f"model {model_key} is owned by another running engine ({type(current).__name__}); "
                    "stop that engine first, or take it over with force_model_takeover=True"
                )
            self._owners[model_key] = weakref.ref(owner)

    def release(self, model_key: str, owner: object) -> None:
        with self._lock:
            if self.owner(model_key) is owner:
                del self._owners[model_key]

    def owner(self, model_key: str) -> object | None:
        ref = self._owners.get(model_key)
        return ref() if ref is not None else None

    def owned_models(self) -> list[str]:
        return [key for key in list(self._owners) if self.owner(key) is not None]


_REGISTRY = ModelRegistry()


def get_registry() -> ModelRegistry:
    """The process-wide registry."""
    return _REGISTRY
