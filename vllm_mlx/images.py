"""Image inputs: load from any source into a fully decoded RGB picture, and hash its content.

``load_image`` accepts a file path, a ``PIL.Image.Image``, raw ``bytes``, a ``data:`` URL or an
``http(s)://`` URL. Every source goes through the same decode path (EXIF orientation applied,
converted to RGB, pixels loaded), so one picture is one set of pixels however it arrived, and a
broken input fails here with :class:`ImageInputError` rather than deep inside a vision encoder.

Untrusted input is bounded: bytes are read in chunks up to ``max_bytes`` (never unbounded),
the pixel count is checked from the header *before* decoding (decompression-bomb guard), and a
URL fetch has a deadline. ``image_content_hash`` names decoded pixels, never file names.

Pillow is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Union

from vllm_mlx.canonical import canonical_bytes
from vllm_mlx.errors import ImageInputError

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "ImageInputError",
    "ImageSource",
    "image_content_hash",
    "load_image",
    "thumbnail_png",
]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
"""Largest encoded image accepted (file, bytes, data URL payload or HTTP body)."""
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024
"""Largest decoded image accepted (width × height): 48 MP photos pass, bombs do not."""

_CHUNK = 64 * 1024
_HASH_VERSION = b"vllm-mlx-image-v1\0"

ImageSource = Union[str, os.PathLike, bytes, bytearray, "PILImage.Image"]


# ---- loading -----------------------------------------------------------------------------


def load_image(
    source: ImageSource,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    timeout: float = 10.0,
) -> PILImage.Image:
    """Return ``source`` as a new, fully loaded RGB ``PIL.Image.Image``.

    A ``str`` starting with ``data:`` is a data URL (base64 or percent-encoded), one starting
    with ``http://``/``https://`` is fetched (``timeout`` bounds the whole fetch), any other
    ``scheme://`` is refused; every other ``str`` or ``PathLike`` is a local file path.
    Raises :class:`ImageInputError` (a one-line message naming the source) on any failure.
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        return _normalize(source, max_pixels, _describe(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        name = _describe(data)
        if len(data) > max_bytes:
            raise ImageInputError(f"{name}: {len(data)} bytes exceed the {max_bytes}-byte limit")
    elif isinstance(source, str) and source[:5].lower() == "data:":
        name = _describe(source)
        data = _decode_data_url(source, max_bytes, name)
    elif isinstance(source, str) and source.split("://", 1)[0].lower() in ("http", "https"):
        name = _describe(source)
        data = _fetch_url(source, max_bytes, timeout, name)
    elif isinstance(source, str) and _has_scheme(source):
        scheme = source.split("://", 1)[0]
        raise ImageInputError(
            f"{_describe(source)}: unsupported URL scheme {scheme!r} "
            "(use a file path, a data: URL or an http(s):// URL)"
        )
    elif isinstance(source, (str, os.PathLike)):
        name = _describe(source)
        data = _read_file(Path(source), max_bytes, name)
    else:
        raise ImageInputError(f"unsupported image source of type {type(source).__name__}")
    return _decode(data, max_pixels, name)


def _has_scheme(text: str) -> bool:
    scheme, sep, _ = text.partition("://")
    # One-letter "schemes" are Windows drive letters, never URLs.
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").isalnum()


def _read_file(path: Path, max_bytes: int, name: str) -> bytes:
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise ImageInputError(f"{name}: {size} bytes exceed the {max_bytes}-byte limit")
            data = f.read(max_bytes + 1)  # the file may grow after fstat
    except FileNotFoundError:
        raise ImageInputError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ImageInputError(f"{name}: is a directory, not an image file") from None
    except OSError as exc:
        raise ImageInputError(f"{name}: cannot read: {_one_line(exc)}") from exc
    if len(data) > max_bytes:
        raise ImageInputError(f"{name}: more than {max_bytes} bytes")
    return data


def _decode_data_url(url: str, max_bytes: int, name: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageInputError(f"{name}: malformed data URL (no ',' before the data)")
    is_base64 = header.lower().endswith(";base64")
    # Bound the work before decoding: base64 encodes 3 bytes in 4 characters.
    if (len(payload) * 3 // 4 if is_base64 else len(payload) // 3) > max_bytes:
        raise ImageInputError(f"{name}: data exceeds the {max_bytes}-byte limit")
    if is_base64:
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageInputError(f"{name}: invalid base64 data: {_one_line(exc)}") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise ImageInputError(f"{name}: {len(data)} bytes exceed the {max_bytes}-byte limit")
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s): urllib would also follow one to ftp://."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            raise urllib.error.HTTPError(
                newurl, code, f"redirect to unsupported scheme {scheme!r}", headers, fp
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch_url(url: str, max_bytes: int, timeout: float, name: str) -> bytes:
    """GET ``url`` within ``timeout`` seconds in all, reading at most ``max_bytes + 1`` bytes."""
    import http.client

    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    headers = {"User-Agent": "vllm-mlx", "Accept": "image/*"}
    try:
        request = urllib.request.Request(url, headers=headers)  # ValueError on a malformed URL
        with opener.open(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ImageInputError(
                    f"{name}: response of {length} bytes exceeds the {max_bytes}-byte limit"
                )
            chunks, total = [], 0
            while chunk := response.read1(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise ImageInputError(
                        f"{name}: response exceeds the {max_bytes}-byte limit (stopped reading)"
                    )
                if time.monotonic() > deadline:
                    raise ImageInputError(f"{name}: fetch timed out after {timeout:g} s")
                chunks.append(chunk)
    except urllib.error.HTTPError as exc:
        raise ImageInputError(f"{name}: HTTP {exc.code} {_one_line(exc.reason)}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            raise ImageInputError(f"{name}: fetch timed out after {timeout:g} s") from None
        raise ImageInputError(f"{name}: fetch failed: {_one_line(reason)}") from None
    except TimeoutError:
        raise ImageInputError(f"{name}: fetch timed out after {timeout:g} s") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ImageInputError(f"{name}: fetch failed: {_one_line(exc)}") from None
    return b"".join(chunks)


def _decode(data: bytes, max_pixels: int, name: str) -> PILImage.Image:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageInputError(f"{name}: empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageInputError(f"{name}: not a recognised image format") from None
    except Image.DecompressionBombError:
        raise ImageInputError(f"{name}: too many pixels (decompression-bomb guard)") from None
    except Exception as exc:  # Pillow plugins raise many types on malformed headers
        raise ImageInputError(f"{name}: unreadable image: {_one_line(exc)}") from None
    return _normalize(image, max_pixels, name)


def _normalize(image: PILImage.Image, max_pixels: int, name: str) -> PILImage.Image:
    """Check the pixel count (header only), then apply EXIF orientation, RGB and ``load()``."""
    from PIL import ImageOps

    width, height = image.size
    if width < 1 or height < 1:
        raise ImageInputError(f"{name}: empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageInputError(
            f"{name}: {width}x{height} = {width * height} pixels exceed the "
            f"{max_pixels}-pixel limit"
        )
    try:
        image.load()  # decode now: a truncated file fails here, not later
        image = ImageOps.exif_transpose(image)  # a new image (a copy when nothing to rotate)
        image = image.convert("RGB") if image.mode != "RGB" else image
        image.load()
    except ImageInputError:
        raise
    except Exception as exc:  # truncated data: OSError, SyntaxError, struct.error, ...
        raise ImageInputError(f"{name}: cannot decode image: {_one_line(exc)}") from None
    return image


def _describe(source: object) -> str:
    """A short, one-line name for ``source`` in error messages."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"image bytes ({len(source)} bytes)"
    if isinstance(source, str) and source[:5].lower() == "data:":
        head = source.split(",", 1)[0][:40]
        return f"data URL '{head},...' ({len(source)} chars)"
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        text = text if len(text) <= 200 else text[:200] + "..."
        return repr(text) if not isinstance(source, str) or "://" not in text else f"URL {text!r}"
    size = getattr(source, "size", None)
    mode = getattr(source, "mode", "?")
    if size is not None:
        return f"PIL image ({size[0]}x{size[1]} {mode})"
    return f"image source of type {type(source).__name__}"


def _one_line(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= 200 else text[:200] + "..."


# ---- hashing and thumbnails --------------------------------------------------------------


def image_content_hash(image: PILImage.Image, processor_key: tuple = ()) -> str:
    """sha256 hex of the decoded pixels (mode, size, raw bytes) and the processor settings.

    Hash images returned by :func:`load_image`: the same picture by path, bytes, data URL or
    PIL object then hashes the same (file names never enter), and one changed pixel does not.
    ``processor_key`` (None/bool/int/float/str/bytes, tuples/lists, dicts with str keys) names
    whatever turns pixels into encoder input (model id, resize, normalisation).
    """
    digest = hashlib.sha256(_HASH_VERSION)
    digest.update(canonical_bytes(image.mode))
    digest.update(struct.pack("<QQ", *image.size))
    pixels = image.tobytes()
    digest.update(struct.pack("<Q", len(pixels)))
    digest.update(pixels)
    digest.update(canonical_bytes(processor_key, extended=True))
    return digest.hexdigest()


def thumbnail_png(image: PILImage.Image, max_side: int = 96) -> bytes:
    """PNG bytes of ``image`` scaled down (aspect kept) so neither side exceeds ``max_side``."""
    if max_side < 1:
        raise ValueError(f"max_side must be >= 1, got {max_side}")
    thumb = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    thumb.thumbnail((max_side, max_side))
    out = io.BytesIO()
    thumb.save(out, format="PNG")
    return out.getvalue()
