"""The KV disk tier's storage: one file per KV block in a folder, content-addressed by the block's
hash, within a size budget and a write budget (issue #29).

What goes in and comes out is plain bytes (``BlockBytes``: numpy, no MLX), so that the files are
written by one background thread and read by a small pool of them while the engine thread steps;
``disk_offload.py`` moves blocks between the pool and these bytes on the engine thread.

Layout: ``<kv_disk_path>/<identity>/<block hash, hex>.safetensors``, where ``identity`` digests
the model (its content digest), the weight format and the block size: blocks of different models
never meet, and several processes may share one root. A file, version 2, holds one tensor per KV
array (``keys.{i}``, ``values.{i}``: the block's slots as raw bytes, ``uint8``
``[n_kv_heads, block_size, head_dim * itemsize]``) and metadata: format, version, the key, the
identity's parts, the block's token ids, each array's dtype, a SHA-256 over names, shapes and
bytes, and a MAC (HMAC-SHA256 over all of that) under the root's key, ``<root>/.kv-key``
(``platform/owner_key.py``: 32 random bytes, mode ``0600``, made by the first process). A file
of kind ``"state"`` (metadata ``kind``; absent: ``"kv"``) holds instead a hybrid model's
recurrent state after the block (``state.{layer}.{i}``: one state array's row as raw
bytes, last axis times the itemsize), keyed apart from the block's KV (``disk_offload.py``).

Never wrong: a file is used only if everything in it agrees (format, version, key, model digest,
weight format, block size, dtypes, shapes, checksum, MAC, and the tokens the engine expects
there); a damaged, foreign or forged file is deleted and counted, never served. Whoever can write
the folder but not read the key cannot make a block the engine serves; a folder (or key) that
other users may write turns the tier off. A file is read whole, off the engine thread, only if
it is a regular file no larger than a block can be (``max_file_bytes``), and its safetensors
header is checked against its length before anything is taken from it
(``platform/outside_files.py``). Files are written atomically
(``platform/atomic_file.py``): a reader never sees half a file, and two processes writing the
same block write the same bytes. A folder that cannot be created or written, or that
disappears, turns the tier off with one warning; serving goes on without it. A write that fails
(a full disk, a directory planted under a block's name) skips that block and pauses writing for
a while (``WRITE_RETRY_S``, doubling while failures repeat): the tier stays on, reads go on.

Budgets: ``budget_bytes`` on disk (least recently used files go first: a read refreshes a file's
time), and ``write_bytes_per_hour`` over any sliding hour, so that a busy server does not wear
out an SSD; a block over the write budget is skipped (counted), not queued.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import logging
import os
import queue
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from vllm_mlx.platform.atomic_file import is_temporary, write_atomically
from vllm_mlx.platform.outside_files import OutsideFileError, read_regular_file, safetensors_header
from vllm_mlx.platform.owner_key import check_private_folder, owner_key

logger = logging.getLogger(__name__)

FORMAT = "vllm-mlx-kv-block"
VERSION = 2
KEY_FILE = ".kv-key"
DEFAULT_MAX_FILE_BYTES = 1 << 30
"""Without a model to size it by (``DiskOffload`` sets the real bound): no block file is larger."""
WRITE_RETRY_S = 5.0
MAX_WRITE_RETRY_S = 600.0
SUFFIX = ".safetensors"
_NAME = re.compile(r"^[0-9a-f]{64}\.safetensors$")
STALE_TEMPORARY_S = 3600.0
"""A temporary file older than this was left by a killed writer: removed when the tier opens."""
EVICT_TO = 0.9
"""Over budget, the least recently used files go until the folder holds this share of it."""
EXIT_FLUSH_S = 10.0
"""At a normal exit (a kernel restart), how long queued blocks may take to reach the disk."""
_OPEN_TIERS: weakref.WeakSet[DiskTier] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Atexit runs before the interpreter stops its daemon threads: the writers finish the queue
    (a process that is killed loses what was queued: the last few seconds' blocks)."""
    for tier in list(_OPEN_TIERS):
        tier.flush(EXIT_FLUSH_S)


@dataclass(frozen=True)
class DiskIdentity:
    """What a block's KV depends on besides its tokens (which its hash covers)."""

    model_digest: str
    weight_format: str
    block_size: int

    @property
    def folder_name(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class BlockBytes:
    """One block's KV as bytes: each array's slots (``uint8``, last axis ``head_dim * itemsize``)
    and its dtype's name (``"float32"``, ``"bfloat16"``)."""

    key: bytes
    token_ids: tuple[int, ...]
    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    kind: str = "kv"
    """``"kv"`` (the block's keys and values) or ``"state"`` (recurrent state after it)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def checksum(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.arrays):
            array = np.ascontiguousarray(self.arrays[name])
            digest.update(f"{name}\0{self.dtypes[name]}\0{array.shape}\0".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()


@dataclass
class DiskTierStats:
    """The tier's counters (this process's, except ``bytes_on_disk`` and ``num_files``, which
    are the folder's as of the last scan)."""

    enabled: bool
    path: str
    disabled_reason: str | None = None
    budget_bytes: int = 0
    write_bytes_per_hour: int | None = None
    write_budget_left: int | None = None
    bytes_on_disk: int = 0
    num_files: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_rejected: int = 0
    """Files found damaged, foreign or forged (deleted, never served)."""
    write_errors: int = 0
    """Writes that failed (each pauses writing for a while)."""
    writes_skipped: int = 0
    """Blocks not written because the write budget was spent."""
    files_evicted: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _WriteWindow:
    """Bytes written in the last hour, for the write budget."""

    per_hour: int | None
    clock: Callable[[], float] = time.monotonic
    writes: deque = field(default_factory=deque)  # (time, bytes)
    total: int = 0

    def left(self) -> int | None:
        if self.per_hour is None:
            return None
        now = self.clock()
        while self.writes and self.writes[0][0] <= now - 3600.0:
            self.total -= self.writes.popleft()[1]
        return max(self.per_hour - self.total, 0)

    def take(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit this hour's budget (counted if they do)."""
        left = self.left()
        if left is not None and nbytes > left:
            return False
        self.writes.append((self.clock(), nbytes))
        self.total += nbytes
        return True


class DiskTier:
    """The folder of one model's blocks; thread-safe (the engine thread asks, threads do I/O)."""

    def __init__(
        self,
        root: str | Path,
        identity: DiskIdentity,
        budget_bytes: int,
        write_bytes_per_hour: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.identity = identity
        root = Path(root).expanduser()
        self.folder = root / identity.folder_name
        self.budget_bytes = budget_bytes
        self.max_file_bytes = DEFAULT_MAX_FILE_BYTES
        """The largest file read (``DiskOffload`` sets it from the block's real size)."""
        self._clock = clock
        self._secret = b""
        self._write_failures = 0
        self._writes_paused_until = 0.0
        self._lock = threading.Lock()
        self._window = _WriteWindow(write_bytes_per_hour, clock)
        self._stats = DiskTierStats(
            True, str(self.folder), budget_bytes=budget_bytes, write_bytes_per_hour=write_bytes_per_hour
        )
        self._queued: set[bytes] = set()  # keys queued or written by this process
        self._writes: queue.Queue[BlockBytes | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-mlx-kv-disk-read")
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.folder.mkdir(mode=0o700, exist_ok=True)
            for folder in (root, self.folder):
                check_private_folder(folder)
            self._secret = owner_key(root / KEY_FILE)
            self._probe_writable()
            self._remove_stale_temporaries()
            self._scan()
        except OSError as exc:
            self.disable(f"cannot use {self.folder}: {exc}")
        _OPEN_TIERS.add(self)

    # ---- state -----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._stats.enabled

    def disable(self, reason: str) -> None:
        """Turn the tier off (once, with a warning); what was queued is dropped."""
        with self._lock:
            if not self._stats.enabled:
                return
            self._stats.enabled, self._stats.disabled_reason = False, reason
        logger.warning("the KV disk tier is off: %s (serving goes on without it)", reason)

    def stats(self) -> DiskTierStats:
        with self._lock:
            stats = DiskTierStats(**asdict(self._stats))
            stats.write_budget_left = self._window.left()
            return stats

    def path_of(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def has(self, key: bytes) -> bool:
        """Whether the block ``key`` is on disk (or on its way there)."""
        if not self.enabled:
            return False
        with self._lock:
            if key in self._queued:
                return True
        return self.path_of(key).is_file()

    # ---- writing -----------------------------------------------------------------------------

    def wants(self, key: bytes) -> bool:
        """Whether writing block ``key`` is worth a copy: the tier is on, writing is not paused
        after a failure, and it is not there."""
        return self.enabled and self._clock() >= self._writes_paused_until and not self.has(key)

    def admit_write(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits the write budget now (counted if it does)."""
        with self._lock:
            if self._window.take(nbytes):
                return True
            self._stats.writes_skipped += 1
            return False

    def write(self, block: BlockBytes) -> None:
        """Queue ``block`` for the writer thread (after ``admit_write``)."""
        if not self.enabled:
            return
        with self._lock:
            if block.key in self._queued or self._closed:
                return
            self._queued.add(block.key)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="vllm-mlx-kv-disk-write", daemon=True)
                self._writer.start()
        self._writes.put(block)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._writes.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the threads; idempotent."""
        self.flush(timeout)
        with self._lock:
            writer, self._writer = self._writer, None
            self._closed = True
        if writer is not None:
            self._writes.put(None)
        self._readers.shutdown(wait=False, cancel_futures=True)

    def _write_loop(self) -> None:
        while True:
            block = self._writes.get()
            if block is None:
                self._writes.task_done()
                return
            try:
                if self.enabled and self._clock() >= self._writes_paused_until:
                    self._write_file(block)
                    self._write_failures = 0
            except OSError as exc:  # a full disk, a folder gone or made read-only, a directory in the way
                self._pause_writes(f"writing {self.path_of(block.key).name} failed: {exc}")
            except Exception:  # never let the thread die with blocks queued behind it
                logger.exception("the KV disk tier could not write a block")
            finally:
                with self._lock:
                    self._queued.discard(block.key)  # on disk now (``has`` looks there), or not at all
                self._writes.task_done()

    def _pause_writes(self, reason: str) -> None:
        """Skip writing for a while after a failure (longer while failures repeat); the tier stays
        on. A folder that is gone turns it off: nothing comes back there."""
        if not self.folder.is_dir():
            self.disable(reason)
            return
        self._write_failures += 1
        pause = min(WRITE_RETRY_S * 2 ** (self._write_failures - 1), MAX_WRITE_RETRY_S)
        self._writes_paused_until = self._clock() + pause
        with self._lock:
            self._stats.write_errors += 1
        logger.warning("KV disk tier: %s; writing again in %.0f s", reason, pause)

    def _write_file(self, block: BlockBytes) -> None:
        from safetensors.numpy import save_file

        metadata = {
            "format": FORMAT, "version": str(VERSION), "key": block.key.hex(),
            "model_digest": self.identity.model_digest, "weight_format": self.identity.weight_format,
            "block_size": str(self.identity.block_size), "token_ids": json.dumps(list(block.token_ids)),
            "dtypes": json.dumps(block.dtypes, sort_keys=True), "checksum": block.checksum(), "kind": block.kind,
        }  # fmt: skip
        metadata["mac"] = _mac(self._secret, metadata)
        arrays = {name: np.ascontiguousarray(a) for name, a in block.arrays.items()}
        path = self.path_of(block.key)

        def save(temporary: Path) -> None:
            try:
                save_file(arrays, str(temporary), metadata=metadata)
            except Exception as exc:  # safetensors reports I/O errors as its own SafetensorError
                raise OSError(f"cannot write {temporary.name}: {exc}") from None

        write_atomically(path, save)
        size = path.stat().st_size
        with self._lock:
            self._stats.blocks_written += 1
            self._stats.bytes_written += size
            self._stats.bytes_on_disk += size
            self._stats.num_files += 1
            over = self._stats.bytes_on_disk > self.budget_bytes
        if over:
            self._evict()

    # ---- reading -----------------------------------------------------------------------------

    def read(self, keys: list[bytes], token_ids: list[tuple[int, ...]], kinds: list[str] | None = None) -> Future:
        """Read blocks ``keys`` (a chain's consecutive blocks, expected to hold ``token_ids``, of
        ``kinds``: all ``"kv"`` by default) on a reader thread. The future's result: the blocks
        read, in order, up to the first that is missing or unusable (the rest of a chain hangs
        from it)."""
        return self._readers.submit(self._read_chain, keys, token_ids, kinds or ["kv"] * len(keys))

    def _read_chain(self, keys: list[bytes], token_ids: list[tuple[int, ...]], kinds: list[str]) -> list[BlockBytes]:
        blocks = []
        for key, tokens, kind in zip(keys, token_ids, kinds):
            block = self._read_file(key, tokens, kind)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _read_file(self, key: bytes, tokens: tuple[int, ...], kind: str) -> BlockBytes | None:
        """Block ``key`` if its file is there and sound; a damaged one is deleted."""
        path = self.path_of(key)
        try:
            metadata, arrays = _read_block_file(path, self.max_file_bytes)
            block = self._checked(key, tokens, kind, metadata, arrays)
        except FileNotFoundError:
            return None
        except (OutsideFileError, OSError, ValueError) as exc:  # truncated, too large, not a file: never served
            block, problem = None, f"unreadable ({exc})"
        else:
            problem = None if block is not None else "does not match what this engine expects there"
        if block is None:
            with self._lock:
                self._stats.blocks_rejected += 1
            logger.warning("KV disk tier: %s %s; deleted", path.name, problem)
            _discard(path)
            return None
        try:
            os.utime(path)  # recently used: the budget evicts it last
        except OSError:  # another process evicted it just now: what was read is sound
            pass
        with self._lock:
            self._stats.blocks_read += 1
            self._stats.bytes_read += block.nbytes
        return block

    def _checked(self, key: bytes, tokens: tuple[int, ...], kind: str, metadata: dict, arrays: dict) -> BlockBytes | None:
        """The block in a file, or None if anything in it disagrees with what is expected (a
        state's shapes are the engine's to check: the tier does not know them)."""
        expected = {
            "format": FORMAT, "version": str(VERSION), "key": key.hex(),
            "model_digest": self.identity.model_digest, "weight_format": self.identity.weight_format,
            "block_size": str(self.identity.block_size), "token_ids": json.dumps(list(tokens)),
        }  # fmt: skip
        if any(metadata.get(name) != value for name, value in expected.items()) or metadata.get("kind", "kv") != kind:
            return None
        dtypes = json.loads(metadata.get("dtypes", "{}"))
        if kind == "kv":
            shapes_ok = all(a.ndim == 3 and a.shape[1] == self.identity.block_size for a in arrays.values())
        else:
            shapes_ok = all(a.ndim >= 1 for a in arrays.values())
        shapes_ok = shapes_ok and all(a.dtype == np.uint8 for a in arrays.values())
        if not arrays or set(dtypes) != set(arrays) or not shapes_ok:
            return None
        if not hmac.compare_digest(_mac(self._secret, metadata), metadata.get("mac", "")):
            return None  # forged (or written under another key): its arrays are not even hashed
        block = BlockBytes(key, tuple(tokens), arrays, dtypes, kind)
        return block if block.checksum() == metadata.get("checksum") else None

    # ---- the folder --------------------------------------------------------------------------

    def _probe_writable(self) -> None:
        write_atomically(self.folder / ".probe", lambda temporary: temporary.write_bytes(b""))
        (self.folder / ".probe").unlink(missing_ok=True)

    def _remove_stale_temporaries(self) -> None:
        now = time.time()
        for entry in os.scandir(self.folder):
            if is_temporary(entry.name) and now - entry.stat().st_mtime > STALE_TEMPORARY_S:
                Path(entry.path).unlink(missing_ok=True)

    def _files(self) -> list[tuple[float, int, Path]]:
        """The block files (mtime, size, path), least recently used first."""
        files = []
        for entry in os.scandir(self.folder):
            if _NAME.match(entry.name):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another process evicted it meanwhile
                    continue
                files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return sorted(files)

    def _scan(self) -> list[tuple[float, int, Path]]:
        files = self._files()
        with self._lock:
            self._stats.bytes_on_disk = sum(size for _, size, _ in files)
            self._stats.num_files = len(files)
        return files

    def _evict(self) -> None:
        """Delete the least recently used files until the folder is within ``EVICT_TO`` of its
        budget (the folder's real content: other processes' files count too), so that the next
        writes do not each scan the folder again."""
        files = self._scan()
        total = sum(size for _, size, _ in files)
        evicted = 0
        for _, size, path in files:
            if total <= self.budget_bytes * EVICT_TO:
                break
            path.unlink(missing_ok=True)
            total -= size
            evicted += 1
        with self._lock:
            self._stats.bytes_on_disk, self._stats.num_files = total, len(files) - evicted
            self._stats.files_evicted += evicted


def _mac(secret: bytes, metadata: dict[str, str]) -> str:
    """HMAC-SHA256 under ``secret`` of a file's metadata, its ``mac`` left out: what a file must
    carry to be served. The metadata holds the arrays' checksum, which the reader checks against
    the arrays, so the MAC binds them too."""
    signed = {name: value for name, value in metadata.items() if name != "mac"}
    return hmac.new(secret, json.dumps(signed, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _read_block_file(path: Path, max_bytes: int) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """A block file's metadata and ``uint8`` arrays, read whole and checked against its header
    before any array is taken (views of the bytes read: nothing is allocated from a declared size).

    Raises:
        FileNotFoundError: No file. OutsideFileError: Not a regular file, too large, not
            safetensors, a header that disagrees with the data, or an array that is not ``uint8``.
    """
    data = read_regular_file(path, max_bytes)
    header = safetensors_header(data, path.name)
    arrays = {}
    for name, entry in header.tensors.items():
        if entry.dtype != "U8":
            raise OutsideFileError(f"{path.name}: array {name!r} is {entry.dtype}, not U8")
        arrays[name] = np.frombuffer(data, np.uint8, entry.end - entry.start, entry.start).reshape(entry.shape)
    return header.metadata, arrays


def _discard(path: Path) -> None:
    """Delete a rejected file; a directory planted under its name, or a file another process
    removed or that cannot be deleted, is left (it is never served either way)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
