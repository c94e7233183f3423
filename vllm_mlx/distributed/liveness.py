"""Noticing at once that a rank's process ended: a liveness connection from every rank to rank 0.

MLX's ring backend does not reliably report a dead peer. Each socket has a worker thread that
fails its pending transfers ("[ring] connection to a peer was lost") after repeated errors and
then *exits*; MLX's stream thread records the error and goes on with the graph's next tasks, so
the next collective of the same forward queues a transfer on a socket nobody serves and blocks
forever. Whether rank 0 sees the error or blocks depends on where in the graph the peer died;
only the watchdog's deadline (``distributed/watchdog.py``) would then end it, seconds later and named
as a hang.

So each rank > 0 holds one TCP connection to rank 0 for its whole life, over which nothing is
ever sent after a one-line hello. When its process ends for any reason (a crash, SIGKILL, the OOM
killer), its operating system closes the connection and rank 0's ``LivenessMonitor`` sees the end
of stream at once and reports ``RankLostError`` ("a tensor-parallel rank is gone"). A machine that
loses power or a link that silently drops packets closes nothing: the watchdog stays the guard
for those.

Where it listens: rank 0's address in the ring's hostfile (``MLX_HOSTFILE``), on a port of the
system's choosing; the address and a random token go to the workers in the start message (over
the ring, whose members were checked by ``ring_formation``). A connection whose hello does not
carry the token is dropped. Without a hostfile (another backend), there is no monitor.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm_mlx.distributed.ring_formation import ring_addresses
from vllm_mlx.distributed.watchdog import RankLostError

logger = logging.getLogger(__name__)

HELLO_LIMIT = 128  # bytes: "<rank> <token>\n"
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LivenessAddress:
    """Where rank 0 listens and the token a worker's hello must carry (sent in the start message)."""

    host: str
    port: int
    token: str

    def to_dict(self) -> dict:
        return {"host": self.host, "port": self.port, "token": self.token}

    @classmethod
    def from_dict(cls, data: dict | None) -> LivenessAddress | None:
        return cls(data["host"], int(data["port"]), data["token"]) if data else None


def rank_zero_host() -> str | None:
    """Rank 0's host in ``MLX_HOSTFILE`` (None without one)."""
    addresses = ring_addresses()
    if not addresses:
        return None
    first = addresses[0].split(",")[0].strip()
    return first.rpartition(":")[0].strip("[]") or None


class LivenessMonitor:
    """Rank 0's side: accepts one connection per other rank and calls ``on_gone`` (once, from its
    own thread) when any of them ends before ``close``."""

    def __init__(self, world_size: int, on_gone: Callable[[RankLostError], None], host: str) -> None:
        self.world_size = world_size
        self.on_gone = on_gone
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(world_size)
        self._listener.setblocking(False)
        self.address = LivenessAddress(host, self._listener.getsockname()[1], secrets.token_hex(16))
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._hellos: dict[socket.socket, bytes] = {}
        self._ranks: dict[socket.socket, int] = {}
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._watch, name="vllm-mlx-rank-liveness", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, world_size: int, on_gone: Callable[[RankLostError], None]) -> LivenessMonitor | None:
        """A monitor on rank 0's ring address; None where there is none (or it cannot listen)."""
        host = rank_zero_host()
        if host is None:
            return None
        try:
            return cls(world_size, on_gone, host)
        except OSError as exc:
            logger.warning("no liveness monitor on %s (%s): a dead rank is found by the watchdog", host, exc)
            return None

    @property
    def connected_ranks(self) -> set[int]:
        return set(self._ranks.values())

    def close(self) -> None:
        """Stop watching (before the workers are told to stop: their exits are then expected)."""
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)

    def _watch(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select():
                    if key.data == "wake":
                        continue
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj in self._ranks:
                        if peer_closed(key.fileobj):
                            self._rank_ended(key.fileobj)
                            return
                    else:
                        self._read_hello(key.fileobj)
        finally:
            for sock in [*self._hellos, *self._ranks, self._listener, self._wake_r, self._wake_w]:
                sock.close()
            self._selector.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._hellos[conn] = b""
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _read_hello(self, conn: socket.socket) -> None:
        """A worker's "<rank> <token>\\n"; anything else (a stray, a port scan) is dropped."""
        try:
            data = conn.recv(HELLO_LIMIT)
        except OSError:
            data = b""
        hello = self._hellos[conn] + data
        if data and b"\n" not in hello and len(hello) < HELLO_LIMIT:
            self._hellos[conn] = hello
            return
        del self._hellos[conn]
        rank = parse_hello(hello, self.address.token, self.world_size)
        if rank is None or rank in self._ranks.values():
            self._selector.unregister(conn)
            conn.close()
            return
        self._ranks[conn] = rank

    def _rank_ended(self, conn: socket.socket) -> None:
        if self._closed.is_set():
            return
        error = RankLostError(
            f"a tensor-parallel rank is gone: rank {self._ranks[conn]}'s process ended "
            f"(its connection to rank 0 closed) on {self.world_size} ranks"
        )
        logger.critical("%s", error)
        self.on_gone(error)


def peer_closed(conn: socket.socket) -> bool:
    """True at the end of the stream (or a reset); a worker sends nothing after its hello, so
    stray bytes are read and ignored."""
    try:
        return conn.recv(HELLO_LIMIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def parse_hello(hello: bytes, token: str, world_size: int) -> int | None:
    """The rank a hello names, when it carries ``token`` and names a rank > 0; else None."""
    try:
        rank_text, given = hello.decode().strip().split(" ")
        rank = int(rank_text)
    except ValueError:
        return None
    if not secrets.compare_digest(given, token) or not 0 < rank < world_size:
        return None
    return rank


def connect_to_rank_zero(address: LivenessAddress | None, rank: int) -> socket.socket | None:
    """A worker's side: connect and say hello; the caller keeps the socket open for its life.
    None when there is no monitor or it cannot be reached (the watchdog remains)."""
    if address is None:
        return None
    try:
        conn = socket.create_connection((address.host, address.port), timeout=CONNECT_TIMEOUT_S)
        conn.sendall(f"{rank} {address.token}\n".encode())
    except OSError as exc:
        logger.warning("rank %d could not reach rank 0's liveness monitor (%s)", rank, exc)
        return None
    return conn
