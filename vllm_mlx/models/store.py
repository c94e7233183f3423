"""The user cache where prepared models live, and atomic writes into it.

Invariant: a directory under ``models_dir()`` whose name does not start with ``.`` is complete.
Every model is written into a hidden temporary sibling and renamed into place only once all its
files are on disk, so an interrupted or failed conversion (a full disk, a crash, Ctrl-C) never
leaves a half-written directory that a later run would take for a good one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm_mlx.platform.errors import ModelSourceError

#: Name of the file we write last into every prepared model directory.
MANIFEST = "vllm_mlx_model.json"


def cache_root() -> Path:
    """``$VLLM_MLX_CACHE``, or ``~/.cache/vllm_mlx``."""
    env = os.environ.get("VLLM_MLX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_mlx"


def models_dir() -> Path:
    return cache_root() / "models"


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``target`` only if the block succeeds.

    On any exception the temporary directory is removed and the exception propagates; an
    ``OSError`` (disk full, file too large, permissions) is turned into a ``ModelSourceError``.
    If another process finished ``target`` first, its result is kept and ours discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is ordinary data
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MANIFEST).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelSourceError(f"could not write the model to {target}: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(model_dir: Path, **info: object) -> None:
    """Record where a prepared model came from; written last, so its presence marks completion."""
    (model_dir / MANIFEST).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    source: str
    size_bytes: int


def list_cached_models() -> list[CachedModel]:
    """The complete models in the cache, sorted by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        manifest = path / MANIFEST
        if path.name.startswith(".") or not manifest.is_file():
            continue
        info = json.loads(manifest.read_text())
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        found.append(CachedModel(path.name, path, str(info.get("source", "?")), size))
    return found
