"""Image inputs: every source decodes to the same RGB pixels; every failure is ImageInputError."""

from __future__ import annotations

import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image

from factories import data_url, make_image, png_bytes, png_header_only
from vllm_mlx.multimodal.images import (
    ImageInputError,
    image_content_hash,
    load_image,
    thumbnail_png,
)
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.errors import VllmMlxError

# The HTTP tests fetch from a server on 127.0.0.1, which the default policy refuses (see
# test_media_policy.py): this one lets loopback through and tests the fetch itself.
LOOPBACK = MediaPolicy.operator(allowed_private_hosts=("127.0.0.1",))


def jpeg_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


# ---- every source, one picture ------------------------------------------------------------


def test_all_sources_give_the_same_rgb_pixels_and_hash(tmp_path):
    original = make_image(mode="RGBA")
    data = png_bytes(original)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    other_name = tmp_path / "renamed.bin"
    other_name.write_bytes(data)

    sources = [str(path), path, other_name, data, bytearray(data), data_url(data), original]
    images = [load_image(s) for s in sources]
    expected = original.convert("RGB").tobytes()
    for image in images:
        assert image.mode == "RGB" and image.size == (32, 24)
        assert image.tobytes() == expected
    assert len({image_content_hash(im) for im in images}) == 1


def test_pil_input_is_copied_not_mutated():
    original = make_image()
    loaded = load_image(original)
    assert loaded is not original
    loaded.putpixel((0, 0), (1, 2, 3))
    assert original.getpixel((0, 0)) != (1, 2, 3)


def test_exif_orientation_is_applied():
    image = make_image(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    out = io.BytesIO()
    image.save(out, format="PNG", exif=exif)
    assert load_image(out.getvalue()).size == (20, 40)


def test_one_pixel_change_changes_the_hash():
    a = make_image()
    b = a.copy()
    r, g, bl = b.getpixel((5, 5))
    b.putpixel((5, 5), (r ^ 1, g, bl))
    assert image_content_hash(a) != image_content_hash(b)
    assert image_content_hash(a) == image_content_hash(a.copy())


def test_processor_key_changes_the_hash():
    image = make_image()
    plain = image_content_hash(image)
    keyed = image_content_hash(image, ("model-a", (448, 448), 0.5))
    assert plain != keyed
    assert keyed != image_content_hash(image, ("model-b", (448, 448), 0.5))
    assert keyed != image_content_hash(image, ("model-a", (448, 448), 0.25))
    assert keyed == image_content_hash(image, ("model-a", [448, 448], 0.5))
    assert image_content_hash(image, ("a", 1)) != image_content_hash(image, ("a1",))
    assert image_content_hash(image, ("x",)) != image_content_hash(image, (b"x",))
    assert image_content_hash(image, ({"b": 1, "a": 2},)) == image_content_hash(
        image, ({"a": 2, "b": 1},)
    )
    with pytest.raises(TypeError):
        image_content_hash(image, (object(),))


def test_same_pixels_different_size_hash_differently():
    flat = Image.new("RGB", (4, 6), (9, 9, 9))
    tall = Image.new("RGB", (6, 4), (9, 9, 9))
    assert image_content_hash(flat) != image_content_hash(tall)


def test_thumbnail_is_a_small_png_keeping_aspect():
    thumb = Image.open(io.BytesIO(thumbnail_png(make_image(400, 200))))
    assert thumb.format == "PNG" and thumb.size == (96, 48)
    small = Image.open(io.BytesIO(thumbnail_png(make_image(10, 20), max_side=96)))
    assert small.size == (10, 20)  # never enlarged
    with pytest.raises(ValueError):
        thumbnail_png(make_image(), max_side=0)


# ---- local failures -----------------------------------------------------------------------


def assert_input_error(source, match, policy=None, **kwargs):
    with pytest.raises(ImageInputError, match=match) as info:
        load_image(source, policy, **kwargs)
    assert isinstance(info.value, VllmMlxError)
    assert "\n" not in str(info.value)
    return str(info.value)


# A path that is missing, a directory, empty or not an image: one message (so an error never
# tells whether a file exists); test_media_policy.py checks FIFOs, devices and the server's.


def test_missing_path(tmp_path):
    message = assert_input_error(str(tmp_path / "nope.png"), "not a readable image file")
    assert "nope.png" in message


def test_directory_path(tmp_path):
    assert_input_error(tmp_path, "not a readable image file")


def test_zero_size_file(tmp_path):
    path = tmp_path / "empty.png"
    path.write_bytes(b"")
    assert "empty.png" in assert_input_error(path, "not a readable image file")


def test_text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, not an image\n")
    assert_input_error(path, "not a readable image file")


@pytest.mark.parametrize("encode", [png_bytes, jpeg_bytes])
def test_truncated_file(tmp_path, encode):
    data = encode(make_image(64, 64))
    path = tmp_path / "cut.img"
    path.write_bytes(data[: len(data) // 2])
    assert_input_error(path, "cut.img")


def test_too_many_pixels_checked_before_decoding():
    assert_input_error(png_bytes(make_image(50, 50)), "2500 pixels exceed", max_pixels=2000)
    # Headers alone: nothing is decoded, so this is quick and allocates nothing.
    assert_input_error(png_header_only(9000, 9000), "pixel limit")
    assert_input_error(png_header_only(100_000, 100_000), "too many pixels")


def test_too_many_pixels_for_pil_input():
    assert_input_error(make_image(50, 50), "PIL image", max_pixels=100)


def test_too_many_bytes(tmp_path):
    data = png_bytes(make_image())
    path = tmp_path / "big.png"
    path.write_bytes(data)
    limit = len(data) - 1
    assert_input_error(path, "byte limit", max_bytes=limit)
    assert_input_error(data, "byte limit", max_bytes=limit)
    assert_input_error(data_url(data), "byte limit", max_bytes=limit)


def test_data_url_bad_base64():
    message = assert_input_error("data:image/png;base64,@@not*base64@@" + "A" * 500, "base64")
    assert len(message) < 300  # long data URLs are cut in messages


def test_data_url_variants():
    data = png_bytes(make_image())
    wrapped = data_url(data).replace("base64,", "base64,\n", 1)  # whitespace is tolerated
    assert load_image(wrapped).size == (32, 24)
    assert_input_error("data:image/png;base64", "malformed")
    assert_input_error("data:text/plain,hello", "not a recognised image")


def test_file_urls_are_local_paths(tmp_path):
    path = tmp_path / "picture.png"
    path.write_bytes(png_bytes(make_image()))
    assert load_image(path.as_uri()).tobytes() == load_image(path).tobytes()
    assert_input_error("file://otherhost/a.png", "must name a local path")


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "gopher://example.com/a.png", "s3://bucket/key.png"]
)
def test_unsupported_schemes(url):
    assert_input_error(url, "unsupported URL scheme")


def test_unsupported_type():
    assert_input_error(12345, "unsupported image source")


# ---- HTTP ---------------------------------------------------------------------------------

PNG = png_bytes(make_image(20, 10))
BIG_TOTAL = 256 * 1024 * 1024


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):
        if self.path == "/ok.png":
            self._send(200, PNG, "image/png")
        elif self.path == "/text":
            self._send(200, b"<html>hi</html>", "text/html")
        elif self.path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(BIG_TOTAL))
            self.end_headers()
            self._stream_big()
        elif self.path == "/big-undeclared":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self._stream_big()
        elif self.path == "/to-ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/a.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/to-ok":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow":
            self.server.stop.wait(5)  # no response within the client's timeout
            self._send(200, PNG, "image/png")
        elif self.path == "/trickle":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for i in range(len(PNG)):
                    self.wfile.write(PNG[i : i + 1])
                    self.wfile.flush()
                    if self.server.stop.wait(0.1):
                        return
            except OSError:
                return
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, code, body, content_type):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream_big(self):
        chunk = b"\0" * (64 * 1024)
        sent = 0
        try:
            while sent < BIG_TOTAL and not self.server.stop.is_set():
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            self.server.big_result.append(("aborted", sent))
        else:
            self.server.big_result.append(("complete", sent))
        self.server.big_done.set()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.stop = threading.Event()
        self.big_done = threading.Event()
        self.big_result: list = []

    def handle_error(self, request, client_address):
        pass  # clients that hang up early are the point of several tests


@pytest.fixture
def server(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    host, port = srv.server_address[:2]
    srv.url = f"http://{host}:{port}"
    try:
        yield srv
    finally:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def test_http_valid_png(server):
    image = load_image(f"{server.url}/ok.png", LOOPBACK)
    assert image.mode == "RGB" and image.size == (20, 10)
    assert image_content_hash(image) == image_content_hash(load_image(PNG))


def test_http_404(server):
    message = assert_input_error(f"{server.url}/missing.png", "HTTP 404", LOOPBACK)
    assert "/missing.png" in message


def test_http_redirects_only_to_http(server):
    assert load_image(f"{server.url}/to-ok", LOOPBACK).size == (20, 10)
    assert_input_error(f"{server.url}/to-ftp", "unsupported scheme 'ftp'", LOOPBACK)


def test_malformed_http_urls():
    assert_input_error("http://", "fetch failed")
    assert_input_error("https://[bad/x.png", "fetch failed")


def test_http_non_image(server):
    assert_input_error(f"{server.url}/text", "not a recognised image", LOOPBACK)


@pytest.mark.parametrize("path", ["/big-declared", "/big-undeclared"])
def test_http_body_over_max_bytes_is_not_fully_read(server, path):
    start = time.monotonic()
    assert_input_error(f"{server.url}{path}", "byte limit", LOOPBACK, max_bytes=100_000)
    assert time.monotonic() - start < 5
    assert server.big_done.wait(10)
    outcome, sent = server.big_result[0]
    assert outcome == "aborted" and sent < BIG_TOTAL


def test_http_slow_response_times_out(server):
    start = time.monotonic()
    assert_input_error(f"{server.url}/slow", "timed out", LOOPBACK, timeout=0.5)
    assert time.monotonic() - start < 3


def test_http_trickling_body_hits_the_overall_deadline(server):
    start = time.monotonic()
    assert_input_error(f"{server.url}/trickle", "timed out", LOOPBACK, timeout=0.5)
    assert time.monotonic() - start < 3


def test_http_connection_refused(monkeypatch):
    import socket

    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert_input_error(f"http://127.0.0.1:{port}/a.png", "fetch failed", LOOPBACK)
