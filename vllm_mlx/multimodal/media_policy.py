"""Where an image may come from: the media policy, and the checks that enforce it.

vLLM's model. A prompt's images are paths, URLs, data URLs, bytes or PIL images; paths and URLs
reach outside the request, so a ``MediaPolicy`` says which of them may be used:

* ``MediaPolicy.operator()``, the default of the Python API, notebooks and ``vllm-mlx generate``
  (whoever writes the prompt runs the engine): any local file, and http(s) URLs of public hosts.
* ``MediaPolicy.server()``, the default of ``vllm-mlx serve`` (prompts come from clients): no
  local file and no URL unless the operator allows them (``--allowed-local-media-path``,
  ``--allowed-media-domains``, ``--allow-remote-media``).

Invariants, under every policy:

* a local path is used only if its resolved path (symlinks followed) lies inside
  ``allowed_local_media_path``, and only if it is a regular file: it is opened non-blocking and
  checked with ``fstat`` before any read, so a FIFO or a device never blocks a thread;
* a URL is fetched only if every address its host resolves to is public (not loopback, private,
  shared, link-local, multicast, reserved or unspecified, also when wrapped in an IPv4-mapped,
  IPv4-compatible, 6to4 or NAT64 IPv6 address), over a connection to an address that was
  checked (no second lookup for DNS rebinding to exploit); every redirect is checked again;
* the image count is checked before any image is loaded, the encoded size while reading, the
  pixel count from the header before decoding;
* with ``detailed_errors=False`` every failure of a path or URL reads the same
  (``UNAVAILABLE``): a client cannot tell a missing file from a refused one, or a closed port
  from a timeout. The Python API keeps the detail, except that a missing file and a file that
  is not an image always read the same.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vllm_mlx.platform.errors import ImageInputError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "SERVER_MAX_IMAGES",
    "SERVER_MAX_PIXELS",
    "UNAVAILABLE",
    "MediaPolicy",
    "is_public_address",
    "parse_limit_mm_per_prompt",
]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
"""Largest encoded image accepted (file, bytes, data URL payload or HTTP body)."""
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024
"""Largest decoded image for the operator (width × height): 48 MP photos pass, bombs do not."""
SERVER_MAX_PIXELS = 25_000_000
"""The server's default per image: 5000×5000, 75 MB as RGB."""
SERVER_MAX_IMAGES = 4
"""The server's default number of images in one prompt (``--limit-mm-per-prompt``)."""
UNAVAILABLE = "image could not be loaded: it is missing, not an image, or not allowed by the server's media policy"
"""The one message for every failed path or URL when ``detailed_errors`` is False."""

# IPv6 prefixes that carry an IPv4 address in their last 32 bits.
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class MediaPolicy:
    """Which image sources a prompt may use, and how large an image may be.

    The field defaults allow nothing outside the request (the server's stance); use
    ``operator()`` or ``server()`` rather than building one from scratch.
    """

    allowed_local_media_path: Path | None = None
    """Local files are read only inside this directory; None = no local files (``Path("/")``:
    any)."""
    allow_remote: bool = False
    """Fetch http(s) URLs at all."""
    allowed_media_domains: tuple[str, ...] | None = None
    """With ``allow_remote``: only these host names (exact match, as vLLM); None = any host."""
    allowed_private_hosts: tuple[str, ...] = ()
    """Host names (exact, as in the URL) that may resolve to loopback or private addresses: an
    image server on your own network. A redirect elsewhere is checked as usual."""
    max_images_per_prompt: int | None = None
    """Most images in one prompt, checked before any is loaded; None = no limit."""
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = SERVER_MAX_PIXELS
    fetch_timeout: float = 10.0
    """Seconds for one URL, redirects included."""
    max_redirects: int = 5
    detailed_errors: bool = True
    """False: every failed path or URL gives ``UNAVAILABLE`` (see the module docstring)."""

    def __post_init__(self) -> None:
        # Host names compare lower-cased without a trailing dot; lists become tuples.
        if self.allowed_media_domains is not None:
            object.__setattr__(self, "allowed_media_domains", tuple(map(_normal_host, self.allowed_media_domains)))
        object.__setattr__(self, "allowed_private_hosts", tuple(map(_normal_host, self.allowed_private_hosts)))

    @classmethod
    def operator(cls, **overrides) -> MediaPolicy:
        """The Python API's: any local file, public http(s) URLs, 64 MP per image."""
        options = dict(allowed_local_media_path=Path("/"), allow_remote=True, max_pixels=DEFAULT_MAX_PIXELS)
        return cls(**{**options, **overrides})

    @classmethod
    def server(
        cls,
        *,
        allowed_local_media_path: str | os.PathLike | None = None,
        allowed_media_domains: list[str] | tuple[str, ...] | None = None,
        allow_remote_media: bool = False,
        **overrides,
    ) -> MediaPolicy:
        """The server's: local files only inside ``allowed_local_media_path``; URLs only of
        ``allowed_media_domains`` (or of any public host with ``allow_remote_media``); 4 images
        per prompt, 25 MP each; one error message for every failed path or URL.

        Raises:
            ValueError: ``allowed_local_media_path`` is not an existing directory.
        """
        root = None
        if allowed_local_media_path:
            root = Path(allowed_local_media_path).expanduser()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {str(root)!r} is not a directory")
            root = root.resolve()
        domains = tuple(allowed_media_domains) if allowed_media_domains else None
        options = dict(
            allowed_local_media_path=root,
            allow_remote=bool(domains) or allow_remote_media,
            allowed_media_domains=None if allow_remote_media else domains,
            max_images_per_prompt=SERVER_MAX_IMAGES,
            detailed_errors=False,
        )
        return cls(**{**options, **overrides})

    # ---- the checks ------------------------------------------------------------------------

    def check_image_count(self, count: int) -> None:
        """Raise ``ValueError`` if a prompt with ``count`` images is over the limit."""
        limit = self.max_images_per_prompt
        if limit is not None and count > limit:
            raise ValueError(f"a prompt may carry at most {limit} image(s) (limit_mm_per_prompt); this one has {count}")

    def local_path(self, source: str | os.PathLike, name: str) -> str:
        """The resolved path of ``source`` if the policy lets it be read (not yet opened)."""
        if self.allowed_local_media_path is None:
            raise ImageInputError(f"{name}: local files are not allowed by the media policy")
        resolved = Path(os.path.realpath(os.fspath(source)))
        root = Path(os.path.realpath(self.allowed_local_media_path))
        if not resolved.is_relative_to(root):
            raise ImageInputError(f"{name}: outside the allowed media directory {str(root)!r}")
        return str(resolved)

    def check_host(self, host: str, name: str) -> None:
        """Raise ``ImageInputError`` unless URLs of ``host`` may be fetched at all."""
        if not self.allow_remote:
            raise ImageInputError(f"{name}: image URLs are not allowed by the media policy")
        domains = self.allowed_media_domains
        if domains is not None and _normal_host(host) not in domains:
            raise ImageInputError(f"{name}: host {host!r} is not one of the allowed media domains")

    def check_addresses(self, host: str, addresses: list[str], name: str) -> None:
        """Raise ``ImageInputError`` if any address ``host`` resolved to is not public (unless
        ``host`` is one of ``allowed_private_hosts``)."""
        if _normal_host(host) in self.allowed_private_hosts:
            return
        for address in addresses:
            if not is_public_address(address):
                raise ImageInputError(f"{name}: {host!r} resolves to {address}, a local or private address (refused)")


def is_public_address(address: str) -> bool:
    """True for a globally routable unicast address (IPv4 embedded in IPv6 is checked too)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and (ip in _IPV4_COMPATIBLE or ip in _NAT64):
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(str(embedded))
    return ip.is_global and not ip.is_multicast


def parse_limit_mm_per_prompt(text: str) -> int:
    """The image count of ``--limit-mm-per-prompt``: vLLM's JSON form ``'{"image": 4}'`` (the
    older ``image=4`` is accepted too). Other modalities are refused: only images exist here."""
    text = text.strip()
    try:
        limits = json.loads(text) if text.startswith("{") else dict(_key_value(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt: expected JSON like '{{\"image\": 4}}', got {text!r}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f"--limit-mm-per-prompt: only 'image' is supported, got {text!r}")
    count = limits.get("image", SERVER_MAX_IMAGES)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"--limit-mm-per-prompt: the image limit must be an integer >= 0, got {count!r}")
    return count


def _key_value(part: str) -> tuple[str, int]:
    key, sep, value = part.partition("=")
    if not sep:
        raise ValueError(part)
    return key.strip(), int(value)


def _normal_host(host: str) -> str:
    return host.strip().lower().rstrip(".")
