"""The media policy: which image paths and URLs a prompt may use (vLLM's model), and the server's
regressions from issue 13 item 5.

Unit tests call ``load_image`` under the two presets on real files, FIFOs, symlinks and a real
HTTP server on 127.0.0.1 that counts its hits. Only the resolver is replaced, where a test needs
a public-looking name that resolves to a private address. The server tests run the real app
over a tiny VLM (tests/tiny_vlm.py) and show that nothing outside the request is read or fetched
unless the operator's flags allow it, with one error for every failure.
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("PIL")
from PIL import Image

from factories import data_url, png_header_only
from vllm_mlx.multimodal import media_fetch
from vllm_mlx.multimodal.images import load_image
from vllm_mlx.multimodal.media_policy import (
    SERVER_MAX_IMAGES,
    SERVER_MAX_PIXELS,
    UNAVAILABLE,
    MediaPolicy,
    is_public_address,
    parse_limit_mm_per_prompt,
)
from vllm_mlx.platform.errors import ImageInputError


def png(width=8, height=8, seed=0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (seed, 2 * seed % 256, 50)).save(out, format="PNG")
    return out.getvalue()


def error_of(source, policy) -> str:
    with pytest.raises(ImageInputError) as info:
        load_image(source, policy)
    return str(info.value)


@pytest.fixture
def media_dir(tmp_path):
    """An allowed directory with an image, a text file, a subdirectory, a FIFO and symlinks
    (one to an image inside, one to an image outside), and a secret image outside it."""
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "cat.png").write_bytes(png(seed=1))
    (inside / "notes.txt").write_text("not an image\n")
    (inside / "sub").mkdir()
    os.mkfifo(inside / "pipe.png")
    (tmp_path / "secret.png").write_bytes(png(seed=2))
    (inside / "alias.png").symlink_to(inside / "cat.png")
    (inside / "escape.png").symlink_to(tmp_path / "secret.png")
    return inside


# ---- addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "255.255.255.255", "224.0.1.1", "239.1.1.1", "198.18.0.1",
        "::1", "::", "fe80::1", "fe80::1%lo", "fc00::1", "ff02::1", "ff0e::1",
        "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::127.0.0.1", "2002:7f00:1::", "64:ff9b::a9fe:a9fe",
    ],
)  # fmt: skip
def test_local_private_and_multicast_addresses_are_not_public(address):
    assert not is_public_address(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "::ffff:8.8.8.8", "2002:808:808::"])
def test_public_addresses_are_public(address):
    assert is_public_address(address)


# ---- presets and flags ------------------------------------------------------------------------


def test_the_server_preset_allows_nothing_outside_the_request():
    policy = MediaPolicy.server()
    assert policy.allowed_local_media_path is None and not policy.allow_remote
    assert policy.max_images_per_prompt == SERVER_MAX_IMAGES == 4
    assert policy.max_pixels == SERVER_MAX_PIXELS and not policy.detailed_errors
    assert MediaPolicy() == MediaPolicy(max_images_per_prompt=None)  # safe field defaults too


def test_the_operator_preset_allows_local_files_and_public_urls():
    policy = MediaPolicy.operator()
    assert str(policy.allowed_local_media_path) == "/" and policy.allow_remote
    assert policy.allowed_media_domains is None and policy.allowed_private_hosts == ()
    assert policy.max_images_per_prompt is None and policy.detailed_errors


def test_server_flags_map_onto_the_policy(tmp_path):
    domains = MediaPolicy.server(allowed_media_domains=["Images.Example.com.", "cdn.example.org"])
    assert domains.allow_remote and domains.allowed_media_domains == ("images.example.com", "cdn.example.org")
    anywhere = MediaPolicy.server(allow_remote_media=True)
    assert anywhere.allow_remote and anywhere.allowed_media_domains is None
    local = MediaPolicy.server(allowed_local_media_path=tmp_path / "." / "")
    assert local.allowed_local_media_path == tmp_path.resolve() and not local.allow_remote
    with pytest.raises(ValueError, match="not a directory"):
        MediaPolicy.server(allowed_local_media_path=tmp_path / "missing")


def test_limit_mm_per_prompt_takes_vllms_json_form():
    assert parse_limit_mm_per_prompt('{"image": 2}') == 2
    assert parse_limit_mm_per_prompt("image=0") == 0  # the older key=value form
    for bad in ['{"video": 1}', '{"image": -1}', '{"image": "4"}', "{oops", "4"]:
        with pytest.raises(ValueError, match="limit-mm-per-prompt"):
            parse_limit_mm_per_prompt(bad)


def test_the_image_count_is_checked_on_its_own():
    MediaPolicy.server().check_image_count(4)
    with pytest.raises(ValueError, match="at most 4 image"):
        MediaPolicy.server().check_image_count(5)
    MediaPolicy.operator().check_image_count(1000)


def test_the_server_refuses_a_bomb_from_its_header():
    with pytest.raises(ImageInputError, match="pixel limit"):
        load_image(png_header_only(8000, 8000), MediaPolicy.server())  # 64 MP > 25 MP, nothing decoded


# ---- local files ------------------------------------------------------------------------------


def test_a_fifo_is_refused_at_once_without_blocking(media_dir):
    pipe = str(media_dir / "pipe.png")
    policies = [MediaPolicy.operator(), MediaPolicy.server(allowed_local_media_path=media_dir)]
    with ThreadPoolExecutor(6) as pool:  # six FIFOs used to starve the server's executor
        started = time.monotonic()
        futures = [pool.submit(error_of, pipe, policy) for policy in policies * 3]
        messages = [f.result(timeout=10) for f in futures]
    assert time.monotonic() - started < 5
    assert messages[0].endswith("not a readable image file") and messages[1] == UNAVAILABLE


def test_files_inside_the_allowed_directory_load(media_dir):
    policy = MediaPolicy.server(allowed_local_media_path=media_dir)
    expected = load_image(png(seed=1)).tobytes()
    for source in [media_dir / "cat.png", str(media_dir / "cat.png"), (media_dir / "cat.png").as_uri(),
                   str(media_dir / "sub" / ".." / "cat.png"), media_dir / "alias.png"]:  # fmt: skip
        assert load_image(source, policy).tobytes() == expected


def test_paths_resolving_outside_the_allowed_directory_are_refused(media_dir):
    policy = MediaPolicy.server(allowed_local_media_path=media_dir)
    secret = media_dir.parent / "secret.png"
    sources = [secret, str(media_dir / ".." / "secret.png"), media_dir / "escape.png", secret.as_uri(), "/etc/passwd"]
    assert {error_of(source, policy) for source in sources} == {UNAVAILABLE}
    detailed = MediaPolicy.operator(allowed_local_media_path=media_dir)  # the operator gets the reason
    assert "outside the allowed media directory" in error_of(media_dir / "escape.png", detailed)
    assert "outside" in error_of(str(media_dir / ".." / "secret.png"), detailed)


def test_missing_not_an_image_directory_fifo_and_device_read_the_same(media_dir):
    sources = [media_dir / "nope.png", media_dir / "notes.txt", media_dir / "sub", media_dir / "pipe.png"]
    server = MediaPolicy.server(allowed_local_media_path=media_dir)
    assert {error_of(s, server) for s in [*sources, "/dev/zero", "/etc/passwd"]} == {UNAVAILABLE}
    operator = MediaPolicy.operator()  # names the path, but never says which case it was
    assert {error_of(s, operator).replace(repr(str(s)), "PATH") for s in sources} == {"PATH: not a readable image file"}
    assert error_of("/dev/zero", operator) == "'/dev/zero': not a readable image file"


def test_without_an_allowed_directory_no_local_file_is_read(media_dir):
    assert error_of(media_dir / "cat.png", MediaPolicy.server()) == UNAVAILABLE
    assert "local files are not allowed" in error_of(media_dir / "cat.png", MediaPolicy())


# ---- URLs ------------------------------------------------------------------------------------


class CountingServer(ThreadingHTTPServer):
    """127.0.0.1 only: ``/ok.png`` is an image, ``/redirect?to=URL`` a 302; it records every hit."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hits: list[tuple[str, str]] = []  # (path, Host header)
        self.port = self.server_address[1]
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: CountingServer

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.hits.append((self.path, self.headers.get("Host", "")))
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            body = b""
        else:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            body = png(64, 64, seed=3)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def http_server(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    server = CountingServer()
    yield server
    server.close()


@pytest.fixture
def resolver(monkeypatch):
    """Names in ``fake`` resolve to the given addresses (each lookup recorded); others as usual."""
    real = socket.getaddrinfo
    fake: dict[str, list[str]] = {}
    lookups: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        lookups.append(host)
        if host not in fake:
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in fake[host]]

    monkeypatch.setattr(media_fetch.socket, "getaddrinfo", getaddrinfo)
    return fake, lookups


def test_urls_are_refused_by_default_on_the_server(http_server):
    for url in [http_server.url("/ok.png"), http_server.url("/ok.png", "localhost"), "https://example.com/a.png"]:
        assert error_of(url, MediaPolicy.server()) == UNAVAILABLE
    assert "not allowed by the media policy" in error_of(http_server.url("/ok.png"), MediaPolicy())
    assert http_server.hits == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "2130706433", "0x7f.1"])
def test_loopback_is_refused_however_it_is_spelled(http_server, host):
    url = http_server.url("/ok.png", host)
    assert error_of(url, MediaPolicy.server(allow_remote_media=True)) == UNAVAILABLE
    message = error_of(url, MediaPolicy.operator())
    assert "local or private address (refused)" in message or "fetch failed" in message
    assert http_server.hits == []


def test_a_public_name_resolving_to_a_private_address_is_refused(http_server, resolver):
    fake, _ = resolver
    fake["images.example.com"] = ["127.0.0.1"]
    fake["mixed.example.com"] = ["93.184.216.34", "10.0.0.7"]  # ANY private address refuses
    policy = MediaPolicy.operator(allowed_media_domains=["images.example.com", "mixed.example.com"])
    assert "resolves to 127.0.0.1" in error_of(http_server.url("/ok.png", "images.example.com"), policy)
    assert "resolves to 10.0.0.7" in error_of(http_server.url("/ok.png", "mixed.example.com"), policy)
    assert http_server.hits == []


def test_the_domain_allowlist_is_exact(http_server):
    policy = MediaPolicy.server(allowed_media_domains=["example.com"], allowed_private_hosts=["127.0.0.1"])
    assert error_of(http_server.url("/ok.png"), policy) == UNAVAILABLE  # 127.0.0.1 is not listed
    detailed = MediaPolicy.operator(allowed_media_domains=["example.com"])
    assert "not one of the allowed media domains" in error_of("http://sub.example.com/a.png", detailed)
    assert "not one of the allowed media domains" in error_of("http://example.com.evil.net/a.png", detailed)
    assert http_server.hits == []


def test_an_allowed_private_host_is_fetched_from_the_checked_address(http_server, resolver):
    fake, lookups = resolver
    fake["images.lan"] = ["127.0.0.1"]
    policy = MediaPolicy.operator(allowed_private_hosts=["images.lan"])
    image = load_image(http_server.url("/ok.png", "images.lan"), policy)
    assert image.tobytes() == load_image(png(64, 64, seed=3)).tobytes()
    # One lookup of the name (then only the checked address literal), asking for the name.
    assert lookups.count("images.lan") == 1 and set(lookups) == {"images.lan", "127.0.0.1"}
    assert http_server.hits == [("/ok.png", f"images.lan:{http_server.port}")]


def test_every_redirect_is_checked_again(http_server, resolver):
    fake, _ = resolver
    fake["images.lan"] = ["127.0.0.1"]
    policy = MediaPolicy.operator(allowed_private_hosts=["images.lan"])
    target = http_server.url("/ok.png")  # the same server, by its loopback address: not allowed
    message = error_of(http_server.url(f"/redirect?to={target}", "images.lan"), policy)
    assert "'127.0.0.1' resolves to 127.0.0.1, a local or private address (refused)" in message
    assert [path for path, _ in http_server.hits] == [f"/redirect?to={target}"]  # the target: never
    allowed = load_image(http_server.url("/redirect?to=/ok.png", "images.lan"), policy)  # same host: fine
    assert allowed.size == (64, 64)
    ftp = error_of(http_server.url("/redirect?to=ftp://images.lan/a.png", "images.lan"), policy)
    assert "unsupported scheme 'ftp'" in ftp


def test_redirect_loops_end(http_server, resolver):
    fake, _ = resolver
    fake["images.lan"] = ["127.0.0.1"]
    policy = MediaPolicy.operator(allowed_private_hosts=["images.lan"], max_redirects=2)
    loop = "/redirect?to=" + "/redirect?to=" * 5 + "/ok.png"
    assert "more than 2 redirects" in error_of(http_server.url(loop, "images.lan"), policy)
    assert len(http_server.hits) == 3


def test_connection_errors_do_not_reach_a_server_client(resolver):
    fake, _ = resolver
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    fake["closed.lan"] = ["127.0.0.1"]
    server = MediaPolicy.server(allow_remote_media=True, allowed_private_hosts=["closed.lan"])
    assert error_of(f"http://closed.lan:{closed}/a.png", server) == UNAVAILABLE
    operator = MediaPolicy.operator(allowed_private_hosts=["closed.lan"])
    assert "fetch failed" in error_of(f"http://closed.lan:{closed}/a.png", operator)


def self_signed(tmp_path, name: str) -> tuple[str, str]:
    """A certificate for ``name`` (its own CA) and its key, as PEM files."""
    import datetime

    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return str(cert_file), str(key_file)


def test_https_verifies_the_host_name_on_the_checked_address(tmp_path, http_server, resolver, monkeypatch):
    import ssl

    cert, key = self_signed(tmp_path, "images.lan")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    http_server.socket = server_tls.wrap_socket(http_server.socket, server_side=True)
    client_tls = ssl.create_default_context(cafile=cert)  # trust our CA instead of the system's
    monkeypatch.setattr(media_fetch, "_tls_context", lambda: client_tls)
    fake, _ = resolver
    fake["images.lan"] = fake["other.lan"] = ["127.0.0.1"]
    policy = MediaPolicy.operator(allowed_private_hosts=["images.lan", "other.lan"])
    url = f"https://images.lan:{http_server.port}/ok.png"
    assert load_image(url, policy).size == (64, 64)  # SNI and certificate name: images.lan
    assert "fetch failed" in error_of(f"https://other.lan:{http_server.port}/ok.png", policy)  # wrong name
    assert [host for _, host in http_server.hits] == [f"images.lan:{http_server.port}"]


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_engine(tiny_qwen2_vl_dir):
    pytest.importorskip("fastapi")
    from vllm_mlx.engine.async_engine import AsyncEngineCore

    engine = AsyncEngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, force_model_takeover=True).start()
    yield engine
    engine.stop()


@pytest.fixture
def serve(vlm_engine):
    """``serve(media_policy)``: the app on a live loopback port; returns a poster of image URLs."""
    import httpx
    from live_server import LiveServer

    from vllm_mlx.entrypoints.openai.server import build_app

    servers = []

    def start(media_policy=None):
        server = LiveServer(build_app(vlm_engine, served_model_name="vlm", media_policy=media_policy))
        servers.append(server)

        def post(*urls: str) -> httpx.Response:
            parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
            messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]
            body = {"messages": messages, "max_tokens": 3, "temperature": 0}
            return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

        return post

    yield start
    for server in servers:
        server.stop()


def test_server_reads_no_file_and_fetches_no_url_by_default(serve, media_dir, http_server):
    post = serve()  # no media flags
    sources = ["/etc/passwd", "file:///etc/passwd", str(media_dir / "cat.png"), str(media_dir / "nope.png"),
               str(media_dir / "sub"), str(media_dir / "pipe.png"), http_server.url("/ok.png"),
               http_server.url("/ok.png", "localhost"), "http://169.254.169.254/latest/meta-data/"]  # fmt: skip
    started = time.monotonic()
    responses = [post(source) for source in sources]
    assert time.monotonic() - started < 30  # the FIFO did not block a worker
    assert {r.status_code for r in responses} == {400}
    assert {r.text for r in responses} == {responses[0].text}  # byte-identical: nothing to map
    assert responses[0].json()["error"]["message"] == f"Invalid image: {UNAVAILABLE}"
    assert http_server.hits == []
    assert post(data_url(png(64, 64, seed=4))).status_code == 200  # the request's own image: fine


def test_server_with_remote_media_still_refuses_local_addresses(serve, http_server):
    post = serve(MediaPolicy.server(allow_remote_media=True))
    responses = [post(http_server.url("/ok.png")), post(http_server.url("/ok.png", "localhost")),
                 post(http_server.url("/redirect?to=/ok.png"))]  # fmt: skip
    assert {(r.status_code, r.text) for r in responses} == {(400, responses[0].text)}
    assert http_server.hits == []


def test_allowed_local_media_path_lets_images_inside_through(serve, media_dir):
    (media_dir / "photo.png").write_bytes(png(64, 64, seed=5))
    post = serve(MediaPolicy.server(allowed_local_media_path=media_dir))
    inside = [post(str(media_dir / "photo.png")), post((media_dir / "photo.png").as_uri())]
    by_data = post(data_url(png(64, 64, seed=5)))
    assert [r.status_code for r in inside] == [200, 200] and by_data.status_code == 200
    texts = {r.json()["choices"][0]["message"]["content"] for r in [*inside, by_data]}
    assert len(texts) == 1  # the same picture, however it came
    outside = [
        post(source)
        for source in [str(media_dir.parent / "secret.png"), str(media_dir / "escape.png"),
                       str(media_dir / ".." / "secret.png"), "/etc/passwd", str(media_dir / "nope.png")]
    ]  # fmt: skip
    assert {(r.status_code, r.text) for r in outside} == {(400, outside[0].text)}


def test_too_many_images_are_refused_before_any_is_loaded(serve, http_server, resolver):
    fake, _ = resolver
    fake["images.lan"] = ["127.0.0.1"]
    post = serve(MediaPolicy.server(allowed_media_domains=["images.lan"], allowed_private_hosts=["images.lan"]))
    urls = [http_server.url(f"/ok.png?{i}", "images.lan") for i in range(SERVER_MAX_IMAGES + 1)]
    response = post(*urls)
    assert response.status_code == 400 and "at most 4 image" in response.json()["error"]["message"]
    assert http_server.hits == []
    assert post(*urls[:1]).status_code == 200 and len(http_server.hits) == 1  # the allowed host itself


def test_huge_images_are_refused_from_their_header(serve, media_dir):
    for i in range(SERVER_MAX_IMAGES):
        (media_dir / f"huge{i}.png").write_bytes(png_header_only(8000, 8000))
    post = serve(MediaPolicy.server(allowed_local_media_path=media_dir))
    started = time.monotonic()
    response = post(*[str(media_dir / f"huge{i}.png") for i in range(SERVER_MAX_IMAGES)])
    assert response.status_code == 400 and time.monotonic() - started < 10


def test_serve_refuses_a_missing_media_directory_before_loading_the_model(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    from vllm_mlx.entrypoints.cli import main

    started = time.monotonic()
    missing = str(tmp_path / "missing")
    assert main(["serve", "--model", str(tmp_path / "no-model"), "--allowed-local-media-path", missing]) == 1
    assert "is not a directory" in capsys.readouterr().err and time.monotonic() - started < 10
