"""HTTP(S) fetches of image URLs under a ``MediaPolicy``.

For each hop (the URL, then every redirect, at most ``max_redirects``): the scheme must be http or
https, the host must pass ``policy.check_host``, every address it resolves to must pass
``policy.check_addresses``, and the connection goes to one of those checked addresses, with the
host name in the ``Host`` header and as the TLS server name (certificates are verified against
it). Nothing is looked up twice, so a name that resolves to a public address when checked and to
a private one a moment later (DNS rebinding) gains nothing. Environment proxies are not used:
the address checked is the address connected to.

The body is read in chunks up to ``max_bytes`` (a larger declared length is refused before
reading), and ``fetch_timeout`` bounds the whole fetch, redirects and a trickling body included.
Name resolution itself is the system resolver's, bounded by its own timeouts.
"""

from __future__ import annotations

import functools
import http.client
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.errors import ImageInputError

__all__ = ["fetch_url"]

_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)
_HEADERS = {"User-Agent": "vllm-mlx", "Accept": "image/*", "Connection": "close"}


@dataclass(frozen=True)
class _Hop:
    """One URL, vetted: where to connect and what to ask for."""

    scheme: str
    host: str
    port: int
    target: str
    """Path and query, as sent in the request line."""
    addresses: tuple[str, ...]
    """Every address the host resolved to, all checked."""


def fetch_url(url: str, policy: MediaPolicy, name: str) -> bytes:
    """GET ``url`` under ``policy``; raises ``ImageInputError`` (naming ``name``) on any failure."""
    deadline = time.monotonic() + policy.fetch_timeout
    try:
        for _ in range(policy.max_redirects + 1):
            hop = _vet(url, policy, name)
            connection = _connect(hop, deadline, policy.fetch_timeout)
            sock = connection.sock  # the response reads from it after http.client drops it
            response = None
            try:
                connection.request("GET", hop.target, headers=_HEADERS)
                response = connection.getresponse()
                if response.status in _REDIRECTS:
                    url = _redirect_target(url, response, name)
                    continue
                if response.status != 200:
                    raise ImageInputError(f"{name}: HTTP {response.status} {_one_line(response.reason)}")
                return _read_body(response, sock, policy.max_bytes, deadline, name)
            finally:  # both: the socket closes (and a sender stops) only when neither holds it
                if response is not None:
                    response.close()
                connection.close()
    except TimeoutError:
        raise ImageInputError(f"{name}: fetch timed out after {policy.fetch_timeout:g} s") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ImageInputError(f"{name}: fetch failed: {_one_line(exc) or type(exc).__name__}") from None
    raise ImageInputError(f"{name}: more than {policy.max_redirects} redirects")


def _vet(url: str, policy: MediaPolicy, name: str) -> _Hop:
    """Parse ``url`` and check its scheme, host and every address the host resolves to."""
    parts = urllib.parse.urlsplit(url)  # ValueError on e.g. an unclosed IPv6 bracket
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageInputError(f"{name}: redirect to unsupported scheme {scheme!r}")
    host = parts.hostname
    if not host:
        raise ValueError("no host in the URL")
    port = parts.port or (443 if scheme == "https" else 80)
    policy.check_host(host, name)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ImageInputError(f"{name}: fetch failed: cannot resolve {host!r} ({exc.strerror})") from None
    addresses = tuple(dict.fromkeys(info[4][0] for info in found))
    policy.check_addresses(host, list(addresses), name)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    return _Hop(scheme, host, port, target, addresses)


def _connect(hop: _Hop, deadline: float, timeout: float) -> http.client.HTTPConnection:
    """A connection to the first checked address that answers."""
    cls = _PinnedHTTPSConnection if hop.scheme == "https" else _PinnedHTTPConnection
    error: OSError | None = None
    for address in hop.addresses:
        connection = cls(hop.host, hop.port, address, _remaining(deadline, timeout))
        try:
            connection.connect()
            return connection
        except TimeoutError:
            raise
        except OSError as exc:  # try the host's next address
            connection.close()
            error = exc
    raise error or OSError("no address to connect to")


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to ``address`` (already checked) for ``host`` (the Host header)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """The same over TLS: the certificate is verified against ``host``, which is also the SNI."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=_tls_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        try:
            self.sock = _tls_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def _redirect_target(url: str, response: http.client.HTTPResponse, name: str) -> str:
    location = response.getheader("Location")
    if not location:
        raise ImageInputError(f"{name}: HTTP {response.status} redirect without a Location")
    return urllib.parse.urljoin(url, location.strip())


def _read_body(
    response: http.client.HTTPResponse, sock: socket.socket, max_bytes: int, deadline: float, name: str
) -> bytes:
    """At most ``max_bytes`` of the body, before ``deadline``."""
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise ImageInputError(f"{name}: response of {length.strip()} bytes exceeds the {max_bytes}-byte limit")
    chunks, total = [], 0
    while True:
        sock.settimeout(_remaining(deadline, None))
        chunk = response.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise ImageInputError(f"{name}: response exceeds the {max_bytes}-byte limit (stopped reading)")
        chunks.append(chunk)


def _remaining(deadline: float, cap: float | None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left if cap is None else min(left, cap)


def _one_line(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= 200 else text[:200] + "..."
