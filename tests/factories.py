"""Helpers many test modules share: driving an engine to the end, waiting for a condition,
test images, chunked text. (Fixtures that build models, engines and shells live in conftest.py,
servers in live_server.py, notebook shells in notebook_shell.py.)"""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib


def run_to_end(engine, max_steps: int = 10_000) -> dict:
    """Step ``engine`` until no request is unfinished; the final output of each request, by id."""
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    return final


def wait_until(predicate, what: str = "condition", timeout: float = 60.0, poll_s: float = 0.02):
    """Poll ``predicate`` until it returns something true and return that; fail the test with
    ``what`` after ``timeout`` seconds (wide: a busy machine is slow, not broken)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(poll_s)
    return value


def split_at(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the positions ``cuts`` (taken modulo its length + 1): streaming chunks."""
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def make_image(width=32, height=24, mode="RGB", seed=0):
    """A deterministic PIL image whose pixels depend on ``seed``."""
    from PIL import Image

    data = bytes((i * 7 + seed * 13) % 256 for i in range(width * height * len(mode)))
    return Image.frombytes(mode, (width, height), data)


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG claiming ``width`` x ``height`` whose pixel data is a few bytes (a bomb's shape)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
