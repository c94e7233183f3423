"""ASGI middleware: API-key check and request-body size limit, answering in OpenAI's error shape
(Anthropic's on the ``/v1/messages`` routes).

Both are plain ASGI (not ``BaseHTTPMiddleware``), so streaming responses and client-disconnect
notifications pass through untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException

from vllm_mlx.entrypoints.anthropic.protocol import error_body, is_messages_path
from vllm_mlx.entrypoints.openai import DEFAULT_MAX_BODY_BYTES


async def send_error(
    send,
    scope,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] = (),
) -> None:
    if is_messages_path(scope["path"]):
        error = error_body(status, message)
    else:
        error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    body = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


OPEN_PATHS = frozenset({"/health", "/version"})
"""Paths answered without the key: probes (liveness, the version) that tell nothing of requests."""


class ApiKeyMiddleware:
    """Require the key on every path but ``open_paths`` (``/docs``, ``/openapi.json`` and
    ``/metrics`` included: the API's shape and the server's traffic are the operator's):
    ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's),
    compared in constant time. An allow-list, so a route added later is protected by default."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            bearer, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
            if not (self._matches(bearer, b"Bearer ") or self._matches(x_api_key)):
                message = "Missing API key." if bearer is None and x_api_key is None else "Incorrect API key provided."
                await send_error(
                    send, scope, 401, message, code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")]
                )
                return
        await self.app(scope, receive, send)

    def _matches(self, given: bytes | None, prefix: bytes = b"") -> bool:
        return given is not None and hmac.compare_digest(given, prefix + self.key)


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body without (or with a lying) Content-Length grows too big.
    An ``HTTPException`` so that FastAPI's body parsing passes it through as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body too large (limit {limit} bytes).")


class BodySizeLimitMiddleware:
    """413 for request bodies over ``max_bytes``: by Content-Length up front, else while reading."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await send_error(
                send, scope, 413, f"Request body too large (limit {self.max_bytes} bytes).", code="request_too_large"
            )
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
