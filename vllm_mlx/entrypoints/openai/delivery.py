"""Whether a client takes what the server writes to it, from what the kernel says of its socket.

A client that stops reading a stream is not seen by a ``send`` that blocks: the kernel's send
buffer (autotuned up to 4 MiB on Linux) and the client's receive buffer absorb minutes of a
slow stream, so the sends go on returning while the client has read nothing. What does show it
is the connection itself: once the client's receive buffer is full its window closes, the bytes
the server writes wait in the send queue, and the count of bytes the client acknowledged stops.
``read_delivery`` reads those two numbers (Linux ``TCP_INFO``: ``tcpi_bytes_acked`` and
``tcpi_notsent_bytes``; macOS ``TCP_CONNECTION_INFO``: ``tcpi_txbytes`` and
``tcpi_snd_sbbytes``); ``StallClock`` times how long bytes have waited with none taken.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass

__all__ = ["Delivery", "StallClock", "read_delivery"]

_LINUX_TCP_INFO = 11  # socket.TCP_INFO
_LINUX_BYTES_ACKED = 120  # u64 tcpi_bytes_acked (Linux 4.1)
_LINUX_NOTSENT_BYTES = 144  # u32 tcpi_notsent_bytes (Linux 4.6)
_MACOS_TCP_CONNECTION_INFO = 0x106
_MACOS_SND_SBBYTES = 32  # u32 tcpi_snd_sbbytes: bytes in the send buffer, in flight or not sent
_MACOS_TXBYTES = 64  # u64 tcpi_txbytes


@dataclass(frozen=True)
class Delivery:
    """A connection's count of bytes the peer has taken and of bytes waiting for it."""

    taken: int
    """Bytes the peer acknowledged (Linux) or that were transmitted to it (macOS), ever."""
    waiting: int
    """Bytes written to the socket that the peer has not taken yet."""


def read_delivery(sock) -> Delivery | None:
    """``sock``'s delivery counts; None where the platform or the socket has none (not TCP)."""
    try:
        if sys.platform == "linux":
            info = sock.getsockopt(socket.IPPROTO_TCP, _LINUX_TCP_INFO, 256)
            if len(info) < _LINUX_NOTSENT_BYTES + 4:
                return None
            (taken,) = struct.unpack_from("=Q", info, _LINUX_BYTES_ACKED)
            (waiting,) = struct.unpack_from("=I", info, _LINUX_NOTSENT_BYTES)
            return Delivery(taken, waiting)
        if sys.platform == "darwin":
            info = sock.getsockopt(socket.IPPROTO_TCP, _MACOS_TCP_CONNECTION_INFO, 256)
            if len(info) < _MACOS_TXBYTES + 8:
                return None
            (waiting,) = struct.unpack_from("=I", info, _MACOS_SND_SBBYTES)
            (taken,) = struct.unpack_from("=Q", info, _MACOS_TXBYTES)
            return Delivery(taken, waiting)
    except (OSError, AttributeError, TypeError):  # closed, not TCP, or no socket behind the transport
        return None
    return None


class StallClock:
    """Times a client that takes none of the bytes waiting for it.

    ``observe`` is called at each write: the client counts as stalled since the first of a run
    of observations in which bytes were waiting and the count taken had not moved from the
    observation before; anything taken, or nothing waiting, ends the run.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._taken: int | None = None
        self._since: float | None = None

    def observe(self, delivery: Delivery, now: float) -> bool:
        """Whether the client has now been stalled for ``timeout_s`` or more."""
        if delivery.waiting > 0 and delivery.taken == self._taken:
            self._since = now if self._since is None else self._since
        else:
            self._since = None
        self._taken = delivery.taken
        return self._since is not None and now - self._since >= self.timeout_s
