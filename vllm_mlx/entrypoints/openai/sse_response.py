"""Server-sent event responses, and what ends one whose client stopped reading.

A streamed response goes at its client's pace: uvicorn pauses ``send`` while the socket and its
transport buffer are full, the event generator waits on that ``send``, and meanwhile each engine
request's stream keeps only its latest output (``RequestStream``), so a slow client costs memory
bounded by one output per request. A client that reads nothing at all would still hold its
requests' KV blocks for as long as its connection lasts: a ``send`` that waits more than
``stall_timeout`` seconds is given up, the event generator is closed (which aborts the engine
requests and frees their blocks) and the response ends unfinished (uvicorn closes the connection;
what is left in its transport buffer is bounded by its high-water mark).

A ``send`` blocks only once the kernel's buffers are full, and they absorb minutes of a slow
stream (4 MiB of send buffer on Linux). So each ``send`` also asks the kernel whether the client
takes what was written (``delivery.py``): bytes waiting and none taken for ``stall_timeout``
seconds is a stall too. The socket comes from the server (``TRANSPORT_SCOPE_KEY``, which
``server.py`` puts in the scope under uvicorn); without one, only a blocked ``send`` counts.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.responses import StreamingResponse

from vllm_mlx.entrypoints.openai import DEFAULT_STREAM_STALL_TIMEOUT_S
from vllm_mlx.entrypoints.openai.delivery import StallClock, read_delivery

TRANSPORT_SCOPE_KEY = "vllm_mlx.transport"
"""The scope key of the request's asyncio transport, where the server put it."""

logger = logging.getLogger(__name__)


class StreamStalled(Exception):
    """The client read nothing for ``stall_timeout`` seconds (not an ``OSError``: Starlette
    turns those into a disconnect)."""


class SSEResponse(StreamingResponse):
    """Server-sent events; the generator is always closed, so a disconnect or a stall aborts its
    requests.

    Args:
        content: The async iterator of events (``str``).
        stall_timeout: Seconds one ``send`` may wait for the client to read; None or 0 = no limit.
        **kwargs: ``StreamingResponse``'s (``headers``, ...).
    """

    media_type = "text/event-stream"

    def __init__(self, content, *, stall_timeout: float | None = DEFAULT_STREAM_STALL_TIMEOUT_S, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout = stall_timeout or None

    async def __call__(self, scope, receive, send) -> None:
        transport = scope.get(TRANSPORT_SCOPE_KEY)
        sock = transport.get_extra_info("socket") if transport is not None else None
        try:
            await super().__call__(scope, receive, self._within_stall_timeout(send, sock))
        except StreamStalled as exc:
            logger.warning("%s %s: %s; its requests are aborted", scope.get("method"), scope.get("path"), exc)
        finally:
            await self.body_iterator.aclose()

    def _within_stall_timeout(self, send, sock):
        if self.stall_timeout is None:
            return send
        clock = StallClock(self.stall_timeout)

        async def send_or_give_up(message) -> None:
            delivery = read_delivery(sock) if sock is not None else None
            if delivery is not None and clock.observe(delivery, time.monotonic()):
                raise StreamStalled(f"the client read nothing for {self.stall_timeout:g} s")
            try:
                async with asyncio.timeout(self.stall_timeout):
                    await send(message)
            except TimeoutError:
                raise StreamStalled(f"the client read nothing for {self.stall_timeout:g} s") from None

        return send_or_give_up
