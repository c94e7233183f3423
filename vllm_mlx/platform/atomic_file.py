"""Files written so that a reader sees the old file or the new one, never half of one.

The content goes to a temporary file beside the target (same folder, so the same file system),
is flushed to the disk, then renamed over the target (``os.replace`` is atomic on POSIX and
Windows). On any failure the temporary file is removed and the target left as it was. Temporary
names start with a dot and hold ``.tmp``, so folder scans can tell them from finished files.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

TEMPORARY_MARK = ".tmp"


def write_atomically(path: Path, write: Callable[[Path], None], suffix: str = "") -> None:
    """Call ``write(temporary_path)`` to produce the content, then put it at ``path``.
    ``suffix`` ends the temporary name (a writer that insists on an extension: MLX adds
    ``.safetensors`` to a name without it).

    Raises:
        OSError: the folder is missing or not writable, the disk is full, or ``path`` is a
            folder (``write``'s own ``OSError`` passes through).
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMPORARY_MARK}{suffix}")
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file ``write_atomically`` left (a killed writer's)."""
    return name.startswith(".") and TEMPORARY_MARK in name
