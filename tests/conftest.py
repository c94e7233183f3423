"""Shared fixtures: the default model directory and a tiny random-weight llama."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    from vllm_mlx.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)
