"""A secret key kept in a file only its owner can read, for authenticating files in a folder.

Files that a process reads back from disk (the KV disk tier's blocks) are trusted only if they
carry a MAC under this key: whoever can write the folder but not read the key cannot make a file
the engine accepts. The key is made once (32 random bytes, mode ``0600``, published atomically so
that processes sharing the folder agree on it) and refused if anyone else owns it or may read or
write it. The folder itself must not be writable by others: they could not forge a file, but
they could delete or replace the key and every file.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32


class KeyFileError(OSError):
    """The key or its folder is not private to this user; the message says what to fix."""


def check_private_folder(folder: Path) -> None:
    """Raise ``KeyFileError`` if ``folder`` is writable by group or others, or owned by another user."""
    info = folder.stat()
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise KeyFileError(f"{folder} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(f"{folder} is writable by other users (chmod go-w {folder})")


def owner_key(path: Path) -> bytes:
    """The key at ``path``, made there first if it is missing.

    Raises:
        KeyFileError: It is not a regular file of ``KEY_BYTES`` bytes owned by this user and
            private to them (mode ``0600``).
        OSError: The folder cannot be written.
    """
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(secrets.token_bytes(KEY_BYTES))
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)  # fails if another process published one first: theirs wins
        except FileExistsError:
            pass
    finally:
        temporary.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != KEY_BYTES:
            raise KeyFileError(f"{path} is not a key file (a regular file of {KEY_BYTES} bytes)")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise KeyFileError(f"{path} belongs to another user")
        if info.st_mode & 0o077:
            raise KeyFileError(f"{path} may be read or written by other users (chmod 600 {path})")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{path} changed while it was read")
    return key
