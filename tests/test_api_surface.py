"""The public API contract: the seed's __all__, __version__ and lazy loading."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_mlx
import vllm_mlx.request

REPO_ROOT = Path(__file__).resolve().parents[1]

SEED_ALL = [
    "MLXPlatform", "MLXWorker", "MLXModelRunner", "MLXAttentionBackend",
    "Request", "RequestOutput", "RequestStatus", "SamplingParams",
    "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "EngineCore", "AsyncEngineCore", "EngineConfig",
    "get_registry", "ModelOwnershipError",
    "PrefixCacheManager", "PrefixCacheStats", "BlockAwarePrefixCache",
    "PagedCacheManager", "CacheBlock", "BlockTable", "CacheStats",
    "MLLMCacheManager", "MLLMCacheStats", "VLMCacheManager", "VLMCacheStats",
    "__version__",
]  # fmt: skip

LAZY_NAMES = [n for n in SEED_ALL if n != "__version__"] + ["LLM"]
HEAVY_MODULES = ["mlx", "mlx_lm", "torch", "vllm", "numpy", "transformers"]


def test_all_matches_seed_exactly():
    assert vllm_mlx.__all__ == SEED_ALL


def test_version():
    assert vllm_mlx.__version__ == "0.4.1"


def test_import_is_light():
    code = (
        "import sys, vllm_mlx\n"
        f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("name", LAZY_NAMES)
def test_every_name_resolves_or_raises_import_error(name):
    try:
        value = getattr(vllm_mlx, name)
    except ImportError:
        return  # its module is not written yet, or a dependency (torch) is missing
    assert value is not None


@pytest.mark.parametrize("name", ["Request", "RequestOutput", "RequestStatus", "SamplingParams"])
def test_request_names_resolve(name):
    assert getattr(vllm_mlx, name) is getattr(vllm_mlx.request, name)
    namespace = {}
    exec(f"from vllm_mlx import {name}", namespace)
    assert namespace[name] is getattr(vllm_mlx.request, name)


@pytest.mark.parametrize(
    "legacy, current",
    [("VLMCacheManager", "MLLMCacheManager"), ("VLMCacheStats", "MLLMCacheStats")],
)
def test_vlm_aliases_map_to_mllm(legacy, current):
    assert vllm_mlx._EXPORTS[legacy] == ("multimodal.cache", current)  # its real module (issue #26)
    try:
        value = getattr(vllm_mlx, legacy)
    except ImportError as exc:
        assert "multimodal.cache" in str(exc)
    else:
        assert value is getattr(vllm_mlx, current)


def test_missing_submodule_gives_clear_import_error(monkeypatch):
    monkeypatch.setitem(vllm_mlx._EXPORTS, "Phantom", ("no_such_module", "Phantom"))
    with pytest.raises(ImportError) as info:
        vllm_mlx.Phantom
    message = str(info.value)
    assert "vllm_mlx.Phantom is not available yet" in message
    assert "vllm_mlx.no_such_module" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_dependency_propagates_unchanged(monkeypatch, tmp_path):
    # A real submodule whose own import fails on a third-party package.
    (tmp_path / "_needs_dep.py").write_text("import vllm_mlx_test_missing_dependency\n")
    monkeypatch.setattr(vllm_mlx, "__path__", [*vllm_mlx.__path__, str(tmp_path)])
    monkeypatch.setitem(vllm_mlx._EXPORTS, "NeedsDep", ("_needs_dep", "NeedsDep"))
    with pytest.raises(ModuleNotFoundError) as info:
        vllm_mlx.NeedsDep
    assert info.value.name == "vllm_mlx_test_missing_dependency"
    assert "not available yet" not in str(info.value)


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="module 'vllm_mlx' has no attribute 'NoSuchThing'"):
        vllm_mlx.NoSuchThing
    assert not hasattr(vllm_mlx, "NoSuchThing")


def test_dir_lists_public_names():
    names = dir(vllm_mlx)
    assert names == sorted(names)
    assert set(SEED_ALL) | {"LLM"} <= set(names)


def test_what_vllm_mlx_distributed_offered_as_one_module_still_imports():
    """Before the re-layout ``vllm_mlx.distributed`` was one module and its docs showed
    ``from vllm_mlx.distributed import init_group, worker_loop``: the package keeps those names
    (and ``step_traffic``) without importing the engine until they are asked for."""
    import subprocess
    import sys

    code = (
        "import sys, vllm_mlx.distributed as d\n"
        "assert 'vllm_mlx.engine.rank_worker' not in sys.modules\n"
        "from vllm_mlx.distributed import init_group, step_traffic, worker_loop\n"
        "print(worker_loop.__module__, init_group.__module__, step_traffic.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["vllm_mlx.engine.rank_worker", "vllm_mlx.distributed.group", "vllm_mlx.distributed.traffic"]
    with pytest.raises(AttributeError):
        import vllm_mlx.distributed

        vllm_mlx.distributed.no_such_name  # noqa: B018
