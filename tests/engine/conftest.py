"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
from repeating_models import ARCHS, LIKELY
from tiny_model import build_tiny_llama


@pytest.fixture(scope="module")
def repeating_dirs(tmp_path_factory, default_model_dir):
    """Per architecture of ``ARCHS``, a tiny model whose text repeats (built on first use)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"repeating-{name}")
            built[name] = build_tiny_llama(path, default_model_dir, likely_tokens=LIKELY, **ARCHS[name])
        return built[name]

    return get
