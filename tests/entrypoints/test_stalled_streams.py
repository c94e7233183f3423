"""A client that stops reading its stream: the server holds a bounded number of outputs per
request whatever the number of steps, and gives the request up after ``--stream-stall-timeout``
(KV blocks freed, the engine serving others).

The client is a raw socket on 127.0.0.1 with a small receive buffer (and the server's send buffer
made small too) that sends a streamed ``n=16`` request and never reads: the server's sends block
after a few steps while the tiny random-weight model goes on generating. What the server holds is
counted directly: the ``RequestOutput`` objects alive in this process (the server runs in it).
"""

from __future__ import annotations

import gc
import socket
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from live_server import LiveServer, raw_request, read_response  # noqa: E402

from vllm_mlx.core.request import RequestOutput  # noqa: E402
from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402
from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402

N = 16
MAX_TOKENS = 1900  # far more steps than any check below waits for: the request is still running
SMALL_BUFFER = 4096  # bytes; the kernel rounds it up a little
HELD_BOUND = 8
"""Outputs of one stalled request the server may hold, whatever the number of steps: the stream's
unread one, one in the merge queue, one waiting for room, the one being sent, the first (kept by
the response generator) and the one the engine thread is building; 8 leaves room."""
STALLED = {"model": "tiny", "prompt": "Once upon a time", "n": N, "max_tokens": MAX_TOKENS,
           "temperature": 1.0, "seed": 7, "ignore_eos": True, "stream": True}  # fmt: skip
TIMEOUT = 120.0  # generous: the machine may be busy; every wait polls a condition


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncEngineCore(
        model=str(tiny_model_dir), num_kv_blocks=2200, max_model_len=2048, max_num_seqs=N, force_model_takeover=True
    ).start()
    yield eng
    eng.stop()


@contextmanager
def server(engine, stall_timeout: float | None, send_buffer: int | None = SMALL_BUFFER):
    """The app on 127.0.0.1 with ``--stream-stall-timeout stall_timeout``; its connections get a
    send buffer of ``send_buffer`` bytes (accepted sockets inherit the listening socket's; None:
    the kernel's, autotuned up to megabytes)."""
    options = ServingOptions(stream_stall_timeout=stall_timeout)
    live = LiveServer(build_app(engine, served_model_name="tiny", options=options))
    if send_buffer is not None:
        live.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    try:
        yield live.url
    finally:
        live.stop()


def scheduler(engine) -> dict:
    return engine.get_stats()["scheduler"]


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {TIMEOUT} s"
        time.sleep(0.05)


def held_outputs() -> int:
    """``RequestOutput``s of ``n=16`` requests alive in this process (the server's)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is RequestOutput and len(o.outputs) == N)


def idle(engine) -> bool:
    stats = engine.get_stats()
    requests = stats["scheduler"]["running"] + stats["scheduler"]["waiting"]
    return requests == 0 and stats["kv_cache"]["num_used_blocks"] == 0


def test_a_stalled_n16_stream_holds_a_bounded_number_of_outputs(engine):
    """The engine runs hundreds of steps for a client that reads nothing: the server holds at
    most ``HELD_BOUND`` outputs of it (unbounded queues held one per step: hundreds). Closing
    the connection then aborts the request and frees its blocks."""
    with server(engine, stall_timeout=0) as url:
        start = scheduler(engine)["steps"]
        client = raw_request(url, "/v1/completions", STALLED, SMALL_BUFFER)
        try:
            held = []
            for steps in (60, 250):
                wait_for(lambda: scheduler(engine)["steps"] >= start + steps, f"{steps} steps")
                held.append(held_outputs())
                assert scheduler(engine)["running"] == N, "the stalled request should still be running"
            assert max(held) <= HELD_BOUND, held
        finally:
            client.close()
        wait_for(lambda: idle(engine), "the abort of the closed stream")
        assert scheduler(engine)["steps"] - start < MAX_TOKENS  # aborted, not run to the end
        assert held_outputs() == 0


def test_the_stall_timeout_aborts_the_request_and_the_engine_serves_others(engine):
    """With ``--stream-stall-timeout 0.5`` a client that reads nothing has its request aborted
    (blocks back to zero long before ``max_tokens``) while its connection is still open; the
    response ends without ``[DONE]`` and the connection is closed; other clients are served."""
    with server(engine, stall_timeout=0.5) as url:
        start = scheduler(engine)["steps"]
        body = {k: v for k, v in STALLED.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "Hi"}]}
        client = raw_request(url, "/v1/chat/completions", body, SMALL_BUFFER)
        try:
            wait_for(lambda: scheduler(engine)["running"] == N, "the request running")
            wait_for(lambda: idle(engine), "the abort of the stalled request")
            assert scheduler(engine)["steps"] - start < MAX_TOKENS // 2
            assert held_outputs() == 0
            with httpx.Client(base_url=url, timeout=60) as http:
                response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
                assert response.status_code == 200, response.text
            status, received, complete = read_response(client, TIMEOUT)  # to the end: the server closed it
        finally:
            client.close()
    assert status == 200 and received.startswith(b"data: {")
    assert not complete and b"[DONE]" not in received
    assert idle(engine)


def test_a_stall_the_kernel_buffers_absorb_is_aborted_too(engine):
    """Default buffers on both sides: the server's send buffer absorbs megabytes, so its sends
    never block while the client reads nothing (before, the request ran to ``max_tokens``). The
    client's closed window (bytes waiting, none taken: ``delivery.py``) is the stall."""
    with server(engine, stall_timeout=0.5, send_buffer=None) as url:
        start = scheduler(engine)["steps"]
        client = raw_request(url, "/v1/completions", STALLED)
        try:
            wait_for(lambda: scheduler(engine)["running"] == N, "the request running")
            wait_for(lambda: idle(engine), "the abort of the stalled request")
            assert scheduler(engine)["steps"] - start < MAX_TOKENS // 2
        finally:
            client.close()


def test_the_kernel_says_whether_a_client_takes_what_is_written():
    """``read_delivery`` on a real loopback connection: bytes wait and none are taken while the
    peer reads nothing (its window closed); taken moves once it reads; ``StallClock`` counts the
    first and not the second."""
    from vllm_mlx.entrypoints.openai.delivery import StallClock, read_delivery

    with socket.create_server(("127.0.0.1", 0)) as listener:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        reader.connect(listener.getsockname())
        writer, _ = listener.accept()
        with reader, writer:
            writer.setblocking(False)
            assert read_delivery(writer).waiting == 0
            deadline = time.monotonic() + TIMEOUT
            while True:  # write until bytes wait and the count taken stays put: the window is closed
                try:
                    writer.send(b"x" * 4096)
                except BlockingIOError:
                    pass
                before = read_delivery(writer)
                time.sleep(0.05)
                closed = read_delivery(writer)
                if closed.waiting > 0 and closed.taken == before.taken:
                    break
                assert time.monotonic() < deadline, "the reader's window never closed"
            clock = StallClock(timeout_s=5.0)
            assert not clock.observe(closed, 0.0)  # nothing to compare with yet
            assert not clock.observe(read_delivery(writer), 1.0)  # stalled since 1.0
            assert clock.observe(read_delivery(writer), 6.0)
            reader.recv(1 << 20)
            wait_for(lambda: read_delivery(writer).taken > closed.taken, "the reader's bytes taken")
            assert not clock.observe(read_delivery(writer), 7.0)


def test_the_stall_timeout_flag(capsys):
    """``serve --stream-stall-timeout``: 60 s by default, 0 turns it off, a negative is refused."""
    from vllm_mlx.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).stream_stall_timeout == ServingOptions().stream_stall_timeout == 60.0
    assert parser.parse_args(["serve", "--stream-stall-timeout", "0"]).stream_stall_timeout == 0.0
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--stream-stall-timeout", bad])
        assert "--stream-stall-timeout: must be >= 0" in capsys.readouterr().err
