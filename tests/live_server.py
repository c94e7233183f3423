"""Servers in tests: uvicorn on a free 127.0.0.1 port in a thread, waiting for a server
subprocess to answer ``/health``, and a raw-socket client that reads at its own pace."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import pytest


def free_socket() -> tuple[socket.socket, str]:
    """A socket bound to a free port on 127.0.0.1, and its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago, for a server subprocess to bind."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """uvicorn serving ``app`` on a free loopback port, in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock, self.url = free_socket()
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_for_health(proc, port: int, log_path, timeout: float, what: str = "the server") -> None:
    """Poll ``http://127.0.0.1:PORT/health`` until it answers 200; fail the test (with the tail
    of ``log_path``) if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{what} did not answer /health in {timeout} s:\n{_tail(log_path)}")


def _tail(path, chars: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def raw_request(url: str, path: str, body: dict, receive_buffer: int | None = None) -> socket.socket:
    """POST ``body`` as JSON from a raw socket and return it unread (``Connection: close``): the
    caller decides when (and whether) to read, e.g. never, to stall the server's sends.
    ``receive_buffer``: ``SO_RCVBUF`` in bytes, set before connecting (it bounds the TCP window)."""
    address = urlsplit(url)
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((address.hostname, address.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def read_response(sock: socket.socket, timeout: float = 60.0, already: bytes = b"") -> tuple[int, bytes, bool]:
    """Read a ``raw_request`` response to the end of the connection: (status, body with the
    chunked framing removed, whether the body was complete). ``already``: what the caller read
    from ``sock`` before. h11 parses it."""
    import h11

    sock.settimeout(timeout)
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    parser.send(h11.EndOfMessage())
    status, body, complete = 0, bytearray(), False
    while True:
        data, already = already or sock.recv(1 << 16), b""
        parser.receive_data(data)
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError:  # the connection ended mid-body
                return status, bytes(body), False
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
                break
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                complete = True
        if not data or complete:
            return status, bytes(body), complete
