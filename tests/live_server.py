"""Servers in tests: uvicorn on a free 127.0.0.1 port in a thread, and waiting for a server
subprocess to answer ``/health``."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest


def free_socket() -> tuple[socket.socket, str]:
    """A socket bound to a free port on 127.0.0.1, and its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


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
