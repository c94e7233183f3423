"""Image inputs: load from any source into a fully decoded RGB picture, and hash its content.

``load_image`` accepts a file path (or ``file://`` URL), a ``PIL.Image.Image``, raw ``bytes``, a
``data:`` URL or an ``http(s)://`` URL. Every source goes through the same decode path (EXIF
orientation applied, converted to RGB, pixels loaded), so one picture is one set of pixels however
it arrived, and a broken input fails here with :class:`ImageInputError` rather than deep inside a
vision encoder.

Which paths and URLs may be used at all is the ``MediaPolicy``'s call (``media_policy.py``: local
files only inside an allowed directory and only regular files, URLs only of allowed public hosts,
fetched by ``media_fetch.py``). Untrusted input is bounded: bytes are read in chunks up to
``max_bytes`` (never unbounded), the pixel count is checked from the header *before* decoding
(decompression-bomb guard), and a URL fetch has a deadline. ``image_content_hash`` names decoded
pixels, never file names.

Pillow is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import os
import struct
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Union

from vllm_mlx.core.canonical import canonical_bytes
from vllm_mlx.multimodal.media_policy import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, UNAVAILABLE, MediaPolicy
from vllm_mlx.platform.errors import ImageInputError
from vllm_mlx.platform.outside_files import FileTooLarge, OutsideFileError, read_regular_file

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "ImageInputError",
    "ImageSource",
    "MediaPolicy",
    "image_content_hash",
    "load_image",
    "thumbnail_png",
]

_HASH_VERSION = b"vllm-mlx-image-v1\0"
_NOT_READABLE = "not a readable image file"
"""One message for a path that is missing, not a regular file, unreadable or not an image."""

ImageSource = Union[str, os.PathLike, bytes, bytearray, "PILImage.Image"]


class _Undecodable(ImageInputError):
    """The bytes are not a decodable image (empty, unknown format, truncated)."""


# ---- loading -----------------------------------------------------------------------------


def load_image(
    source: ImageSource,
    policy: MediaPolicy | None = None,
    *,
    max_bytes: int | None = None,
    max_pixels: int | None = None,
    timeout: float | None = None,
) -> PILImage.Image:
    """Return ``source`` as a new, fully loaded RGB ``PIL.Image.Image``.

    A ``str`` starting with ``data:`` is a data URL (base64 or percent-encoded), one starting
    with ``http://``/``https://`` is fetched, one starting with ``file://`` is a local path, any
    other ``scheme://`` is refused; every other ``str`` or ``PathLike`` is a local file path.
    ``policy`` (default ``MediaPolicy.operator()``) decides which paths and URLs may be used and
    the limits; ``max_bytes``, ``max_pixels`` and ``timeout`` override its limits.
    Raises :class:`ImageInputError` (a one-line message naming the source) on any failure.
    """
    policy = _with_limits(policy or MediaPolicy.operator(), max_bytes, max_pixels, timeout)
    reaches_out = isinstance(source, os.PathLike) or (isinstance(source, str) and source[:5].lower() != "data:")
    try:
        return _load(source, policy)
    except ImageInputError:
        if reaches_out and not policy.detailed_errors:
            raise ImageInputError(UNAVAILABLE) from None
        raise


def _with_limits(policy: MediaPolicy, max_bytes, max_pixels, timeout) -> MediaPolicy:
    limits = {"max_bytes": max_bytes, "max_pixels": max_pixels, "fetch_timeout": timeout}
    limits = {k: v for k, v in limits.items() if v is not None}
    return dataclasses.replace(policy, **limits) if limits else policy


def _load(source: ImageSource, policy: MediaPolicy) -> PILImage.Image:
    from PIL import Image

    if isinstance(source, Image.Image):
        return _normalize(source, policy.max_pixels, _describe(source))
    name = _describe(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > policy.max_bytes:
            raise ImageInputError(f"{name}: {len(data)} bytes exceed the {policy.max_bytes}-byte limit")
        return _decode(data, policy.max_pixels, name)
    if not isinstance(source, (str, os.PathLike)):
        raise ImageInputError(f"unsupported image source of type {type(source).__name__}")
    if isinstance(source, str) and source[:5].lower() == "data:":
        return _decode(_decode_data_url(source, policy.max_bytes, name), policy.max_pixels, name)
    scheme = _scheme(source) if isinstance(source, str) else ""
    if scheme in ("http", "https"):
        from vllm_mlx.multimodal.media_fetch import fetch_url

        return _decode(fetch_url(source, policy, name), policy.max_pixels, name)
    if scheme not in ("", "file"):
        raise ImageInputError(
            f"{name}: unsupported URL scheme {scheme!r} (use a file path, a data: URL or an http(s):// URL)"
        )
    return _load_file(_file_url_path(source, name) if scheme else source, policy, name)


def _load_file(path: str | os.PathLike, policy: MediaPolicy, name: str) -> PILImage.Image:
    """A local image, if the policy allows its resolved path; one message for missing, not a
    regular file, unreadable and not an image (an error never tells whether a file exists)."""
    data = _read_file(policy.local_path(path, name), policy.max_bytes, name)
    try:
        return _decode(data, policy.max_pixels, name)
    except _Undecodable:
        raise ImageInputError(f"{name}: {_NOT_READABLE}") from None


def _scheme(text: str) -> str:
    """The lower-cased URL scheme of ``text``, or "" for a plain path."""
    scheme, sep, _ = text.partition("://")
    # One-letter "schemes" are Windows drive letters, never URLs.
    if sep and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").isalnum():
        return scheme.lower()
    return ""


def _file_url_path(url: str, name: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageInputError(f"{name}: a file:// URL must name a local path (no host)")
    return urllib.request.url2pathname(parts.path)


def _read_file(path: str, max_bytes: int, name: str) -> bytes:
    """The bytes of the regular file at ``path`` (already resolved by the policy), read as every
    file from outside is (``platform/outside_files.py``), without following a symlink swapped in
    since it was resolved: a FIFO, a device or a directory is refused at once. Missing, not
    regular, changed while read and unreadable all read the same (``_NOT_READABLE``)."""
    try:
        return read_regular_file(path, max_bytes, follow_links=False)
    except FileTooLarge as exc:
        raise ImageInputError(f"{name}: {exc.size} bytes exceed the {max_bytes}-byte limit") from None
    except (OSError, OutsideFileError):
        raise ImageInputError(f"{name}: {_NOT_READABLE}") from None


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


def _decode(data: bytes, max_pixels: int, name: str) -> PILImage.Image:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise _Undecodable(f"{name}: empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise _Undecodable(f"{name}: not a recognised image format") from None
    except Image.DecompressionBombError:
        raise ImageInputError(f"{name}: too many pixels (decompression-bomb guard)") from None
    except Exception as exc:  # Pillow plugins raise many types on malformed headers
        raise _Undecodable(f"{name}: unreadable image: {_one_line(exc)}") from None
    return _normalize(image, max_pixels, name)


def _normalize(image: PILImage.Image, max_pixels: int, name: str) -> PILImage.Image:
    """Check the pixel count (header only), then apply EXIF orientation, RGB and ``load()``."""
    from PIL import ImageOps

    width, height = image.size
    if width < 1 or height < 1:
        raise _Undecodable(f"{name}: empty image ({width}x{height})")
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
        raise _Undecodable(f"{name}: cannot decode image: {_one_line(exc)}") from None
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
