"""``RemoteEngine``: a running ``vllm-mlx serve`` in the place of the kernel's engine.

``%vllm_mlx connect URL`` gives the session one of these instead of an ``AsyncEngineCore``. It
has the part of the engine's surface the notebook uses — ``add_request`` (a ``RequestStream``,
read blocking or with ``async for``), ``abort``, ``cache_snapshot``, ``reset_prefix_cache``,
``stop`` — and speaks the server's OpenAI API underneath:

- a prompt that is text (``--raw``) goes to ``/v1/completions``; a ``ChatPrompt`` (the messages
  the session would have put through the chat template) to ``/v1/chat/completions``, so the
  server applies the same template the kernel would have. Its images (``--image``) are loaded
  here, as the kernel's engine would load them, and sent inline (``remote_messages``): the
  server reads no file and fetches no URL for us. Its tools and ``tool_choice`` go along: the
  server renders, enforces and parses them, and streams the calls (``delta.tool_calls``);
- every request streams (SSE) on one asyncio loop in a background thread: concurrent cells are
  concurrent HTTP streams, batched by the server's engine;
- ``abort`` cancels the stream's task, which closes its connection: the server aborts a request
  whose client went away and frees its blocks;
- ``cache_snapshot`` reads ``/v1/cache/blocks`` (only this notebook's requests, by the response
  ids the server gave them) and rebuilds the engine's snapshot shape, so the inspector draws
  the server's blocks unchanged. A request is known by its server id from its first chunk on
  (the server answers after the prefill), so the inspector lists it from then.

Outputs are ``RemoteOutput``s: the text so far and token counts (the chunks so far while
streaming, the server's usage at the end), and with ``--logprobs`` the tokens' texts, logprobs
and top alternatives — no token ids, which the API does not stream.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from vllm_mlx.core.snapshot import CacheSnapshot
from vllm_mlx.engine.async_engine import EngineDeadError, RequestStream
from vllm_mlx.tool_parsers.base import ToolCall
from vllm_mlx_jupyter.views.markup import as_float, as_int
from vllm_mlx_jupyter.views.server_view import numbers, snapshot_from_view
from vllm_mlx_jupyter.views.token_view import Alternative, TokenInfo

CONNECT_TIMEOUT = 10.0
# SamplingParams fields with their OpenAI (or vLLM extension) names; the others are sent below.
_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                    "max_thinking_tokens")  # fmt: skip


class ConnectError(ValueError):
    """The server cannot be used: unreachable, the wrong key, or not a vllm-mlx server."""


class RemoteUnsupported(ValueError):
    """A request the OpenAI API cannot express (it would otherwise be silently changed)."""


@dataclass(frozen=True)
class ChatPrompt:
    """Messages for ``/v1/chat/completions`` (the server applies the chat template), with the
    turn's tools (OpenAI's shape) and ``tool_choice`` (OpenAI's form), which the server renders,
    enforces and parses with its own tool-call parser."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


@dataclass(frozen=True)
class RemoteOutput:
    """One streamed state of a remote request (the fields of ``RequestOutput`` the notebook
    reads). ``num_completion_tokens`` counts chunks while streaming, the server's usage at the end."""

    request_id: str
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    server_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the server parsed out of the output (``delta.tool_calls``, pieces joined)."""
    reasoning: str | None = None
    """A thinking model's reasoning, as the server split it off (``reasoning_content``)."""
    token_infos: tuple[TokenInfo, ...] = ()
    """With ``--logprobs``: the streamed tokens so far, each with its top alternatives (token ids
    are -1: the API carries token texts, not ids)."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class RemoteEngine:
    """A ``vllm-mlx serve`` at ``url``, used like the kernel's ``AsyncEngineCore``.

    ``RemoteEngine.connect(url, api_key)`` checks the server (and the key) before returning:
    nothing is half-connected. Thread-safe: cells, the monitor and the inspector call it from
    their own threads.
    """

    remote = True

    def __init__(self, url: str, api_key: str | None, model: str) -> None:
        self.url = url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(CONNECT_TIMEOUT, read=None)  # a stream may wait long for a token
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=CONNECT_TIMEOUT)
        self._async_http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-mlx-remote", daemon=True)
        self._thread.start()
        self._tasks: dict[str, asyncio.Future] = {}
        self._server_ids: dict[str, str] = {}  # our request id -> the server's (its response id)
        self._lock = threading.Lock()
        self._running = True

    @classmethod
    def connect(cls, url: str, api_key: str | None = None) -> RemoteEngine:
        """Check that ``url`` is a vllm-mlx server that accepts ``api_key``; raise ``ConnectError``."""
        if not url.startswith(("http://", "https://")):
            raise ConnectError(f"connect: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        base = url.rstrip("/")
        try:
            models = httpx.get(f"{base}/v1/models", headers=headers, timeout=CONNECT_TIMEOUT)
            blocks = httpx.get(f"{base}/v1/cache/blocks", headers=headers, timeout=CONNECT_TIMEOUT)
        except httpx.HTTPError as exc:
            raise ConnectError(f"connect: no server answers at {base}: {exc}") from None
        if models.status_code == 401:
            raise ConnectError(f"connect: {base} refused the API key: {_message(models)} (give --api-key KEY)")
        if models.status_code != 200 or blocks.status_code != 200:
            bad = models if models.status_code != 200 else blocks
            raise ConnectError(f"connect: {base} is not a vllm-mlx server ({bad.request.url.path}: "
                               f"HTTP {bad.status_code})")  # fmt: skip
        return cls(base, api_key, models.json()["data"][0]["id"])

    # -- the engine's surface ---------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    def add_request(self, prompt, params, request_id: str, constraint=None, lora_request=None) -> RequestStream:
        """Start streaming ``prompt`` (text or a ``ChatPrompt``); ``constraint`` is ignored
        (the server compiles ``params.structured_outputs`` itself); ``lora_request`` (a
        ``ServedAdapter``) names the server's adapter to run with, as the request's ``model``."""
        if not self._running:
            raise EngineDeadError(f"disconnected from {self.url}")
        path, body = request_body(prompt, params, lora_request.lora_name if lora_request is not None else self.model)
        stream = RequestStream(request_id, self)
        task = asyncio.run_coroutine_threadsafe(self._stream(path, body, request_id, stream), self._loop)
        with self._lock:
            self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._forget(request_id))
        return stream

    def served_adapters(self) -> list[str]:
        """The adapters the server serves (``/v1/models``: its ``--lora-modules`` and those loaded
        at runtime), by name."""
        response = self._http.get("/v1/models")
        if response.status_code != 200:
            raise ConnectError(f"{self.url}/v1/models: HTTP {response.status_code}: {_message(response)}")
        return [card["id"] for card in response.json()["data"] if card.get("parent")]

    def abort(self, request_id: str) -> None:
        """Close the request's stream; the server aborts it (a no-op once it has ended)."""
        with self._lock:
            task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def check_params(self, params) -> None:
        """Refuse what the API cannot carry; ``RemoteUnsupported`` names the flag."""
        request_body("", params, self.model)

    def compile_constraint(self, params) -> None:
        """The server compiles constraints; a bad one is the generation's error."""
        return None

    def check_images(self, images) -> None:
        """Images go inline in chat messages (``remote_messages``); the server checks them."""

    def snapshot(self, include_blocks: bool = True) -> CacheSnapshot:
        """``cache_snapshot()`` read once into the engine's typed ``CacheSnapshot`` (what the
        server does not show is empty or 0)."""
        return CacheSnapshot.from_dict(self.cache_snapshot(include_blocks))

    def cache_snapshot(self, include_blocks: bool = True) -> dict:
        """The server's block grid and this notebook's requests, in ``cache_snapshot()``'s shape
        (every field checked: ``views/server_view.py``). Without ``include_blocks`` (the
        session's monitor, asking about queued requests) no request is known yet: the server
        names a request with its first token."""
        if not include_blocks:
            return {"block_size": 0, "blocks": [], "requests": {}, "free_queue": [], "stats": {}}
        with self._lock:
            ids = dict(self._server_ids)
        response = self._http.get("/v1/cache/blocks", params={"request_id": list(ids.values())})
        _raise_for(response)
        return snapshot_from_view(response.json(), {server: ours for ours, server in ids.items()})

    def get_stats(self) -> dict:
        """``/v1/cache/stats``; its ``stats`` (what ``%vllm_mlx status`` shows) as numbers only."""
        response = self._http.get("/v1/cache/stats")
        _raise_for(response)
        body = response.json()
        body = body if isinstance(body, dict) else {}
        return {**body, "stats": numbers(body.get("stats"))}

    def reset_prefix_cache(self) -> bool:
        response = self._http.delete("/v1/cache")
        _raise_for(response)
        return bool(response.json().get("reset"))

    def stop(self) -> None:
        """Abort this notebook's streams and close the connections (the server keeps running)."""
        self._running = False
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        asyncio.run_coroutine_threadsafe(self._async_http.aclose(), self._loop).result(CONNECT_TIMEOUT)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._http.close()

    # -- streaming --------------------------------------------------------------------------

    async def _stream(self, path: str, body: dict, request_id: str, stream: RequestStream) -> None:
        """Read one SSE stream into ``stream``; the last item put is always a finished output."""
        state = RemoteOutput(request_id)
        try:
            async with self._async_http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    state = _finished(state, "error", error=f"HTTP {response.status_code}: {_message(response)}")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    state = self._apply(state, json.loads(line[6:]))
                    if not state.finished:
                        stream.put(state)
            state = state if state.finish_reason else _finished(state, "error", error="the stream ended early")
            state = dataclasses.replace(state, finished=True, finish_time=time.monotonic())
        except asyncio.CancelledError:
            state = _finished(state, "abort")
        except (httpx.HTTPError, ValueError) as exc:
            state = _finished(state, "error", error=f"{type(exc).__name__}: {exc}")
        except (TypeError, KeyError, AttributeError) as exc:  # a chunk of the wrong shape
            state = _finished(state, "error", error=f"the server sent a malformed chunk ({type(exc).__name__}: {exc})")
        finally:
            stream.put(state if state.finished else _finished(state, "error", error="no answer"))

    def _apply(self, state: RemoteOutput, chunk: dict) -> RemoteOutput:
        """``state`` after one SSE chunk (text delta, finish reason, usage or error)."""
        if "error" in chunk:  # OpenAI's {"message": ...}, or whatever else a server sends
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            return _finished(state, "error", error=str(message))
        if state.server_id is None and chunk.get("id"):
            with self._lock:
                self._server_ids[state.request_id] = chunk["id"]
            state = dataclasses.replace(state, server_id=chunk["id"])
        changes: dict = {}
        for choice in chunk.get("choices", []):  # one: n is 1
            changes |= _choice_changes(state, choice)
        usage = chunk.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            changes.update(num_prompt_tokens=as_int(usage.get("prompt_tokens")),
                           num_completion_tokens=as_int(usage.get("completion_tokens")),
                           num_cached_tokens=as_int(details.get("cached_tokens")))  # fmt: skip
        return dataclasses.replace(state, **changes)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._tasks.pop(request_id, None)
            self._server_ids.pop(request_id, None)


def _choice_changes(state: RemoteOutput, choice: dict) -> dict:
    """The ``RemoteOutput`` fields one streamed choice changes (a completions ``text`` or a chat
    ``delta``: content, reasoning, tool-call pieces; logprobs; the finish reason)."""
    message = choice.get("delta") or {}
    delta = choice.get("text") or message.get("content") or ""
    changes: dict = {"text": state.text + delta}
    if message.get("reasoning_content"):
        changes["reasoning"] = (state.reasoning or "") + message["reasoning_content"]
    if message.get("tool_calls"):
        changes["tool_calls"] = joined_calls(state.tool_calls, message["tool_calls"])
    if choice.get("logprobs"):
        changes["token_infos"] = state.token_infos + token_infos(choice["logprobs"])
    produced = delta or message.get("tool_calls") or message.get("reasoning_content")
    changes["num_completion_tokens"] = state.num_completion_tokens + (1 if produced else 0)
    if state.first_token_time is None:
        changes["first_token_time"] = time.monotonic()
    if choice.get("finish_reason"):
        changes["finish_reason"] = choice["finish_reason"]
    return changes


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter a connected server serves, by the name a request's ``model`` picks it with
    (what a cell's ``--adapter NAME`` is, connected)."""

    lora_name: str


def request_body(prompt, params, model: str) -> tuple[str, dict]:
    """(path, JSON body) of a streamed request; ``RemoteUnsupported`` for what cannot go."""
    from vllm_mlx.core.request import SamplingParams

    if params.n != SamplingParams().n:
        raise RemoteUnsupported("n is not supported when connected to a server")
    chat = isinstance(prompt, ChatPrompt)
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    body.update({name: getattr(params, name) for name in _SAMPLING_FIELDS if getattr(params, name) is not None})
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.structured_outputs is not None:
        body["structured_outputs"] = _constraint_dict(params.structured_outputs)
    if params.logprobs is not None:  # the top K: chat asks for them apart, completions by K
        body |= {"logprobs": True, "top_logprobs": params.logprobs} if chat else {"logprobs": params.logprobs}
    if chat:
        tools = {"tools": prompt.tools, "tool_choice": prompt.tool_choice}
        body |= {name: value for name, value in tools.items() if value is not None}
        return "/v1/chat/completions", {**body, "messages": prompt.messages}
    if not isinstance(prompt, str):
        raise RemoteUnsupported("a server takes text or chat messages, not a prepared prompt (images?)")
    return "/v1/completions", {**body, "prompt": prompt}


def joined_calls(calls: tuple[ToolCall, ...], pieces: list[dict]) -> tuple[ToolCall, ...]:
    """``calls`` after one chunk's ``delta.tool_calls``: a piece with a new ``index`` starts a
    call (its ``id`` and name), later pieces of that index add to its ``arguments``."""
    joined = list(calls)
    for piece in pieces:
        function = piece.get("function") or {}
        index = piece.get("index", len(joined))
        if index >= len(joined):
            joined.append(ToolCall(piece.get("id") or f"call_{index}", function.get("name") or "", ""))
        call = joined[index]
        joined[index] = dataclasses.replace(call, arguments=call.arguments + (function.get("arguments") or ""))
    return tuple(joined)


def token_infos(logprobs: dict) -> tuple[TokenInfo, ...]:
    """One chunk's ``logprobs`` as ``TokenInfo``s: chat's ``content`` list, or completions'
    parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as token -> logprob).
    Texts are made ``str`` and logprobs finite floats (``-inf`` when not a number): a server's
    values are shown, never trusted to have the right types."""
    if "content" in logprobs:
        return tuple(
            TokenInfo(_token_text(entry["token"]), -1, _logprob(entry["logprob"]),
                      tuple(Alternative(_token_text(top["token"]), -1, _logprob(top["logprob"]))
                            for top in entry.get("top_logprobs") or ()))
            for entry in logprobs["content"] or ()
        )  # fmt: skip
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return tuple(
        TokenInfo(_token_text(token), -1, _logprob(logprob),
                  tuple(Alternative(_token_text(text), -1, _logprob(lp)) for text, lp in (top or {}).items()))
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops)
    )  # fmt: skip


def _token_text(value: object) -> str:
    return value if isinstance(value, str) else str(value)


def _logprob(value: object) -> float:
    return min(as_float(value, float("-inf")), 0.0)


def remote_messages(messages: list[dict]) -> list[dict]:
    """``messages`` for the server: each image part (``{"type": "image", "image": source}``, as
    ``--image`` gives: a path, URL, bytes or PIL image) becomes an ``image_url`` part holding a
    PNG data URL. Loaded here, in the kernel, under the operator's policy, as the kernel's own
    engine would; ``ImageInputError`` (one line naming the image) when one cannot be."""

    def part(item: dict) -> dict:
        if item.get("type") != "image":
            return item
        return {"type": "image_url", "image_url": {"url": image_data_url(item["image"])}}

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]  # fmt: skip


def image_data_url(source) -> str:
    """``source`` loaded (``vllm_mlx.multimodal.images.load_image``) and encoded as a PNG data URL."""
    from vllm_mlx.multimodal.images import load_image

    buffer = io.BytesIO()
    load_image(source).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _constraint_dict(constraint) -> dict:
    """A ``StructuredOutputsParams`` as the server's ``structured_outputs`` object (set fields)."""
    fields = dataclasses.fields(constraint)
    return {f.name: _plain(getattr(constraint, f.name)) for f in fields if getattr(constraint, f.name) != f.default}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _finished(state: RemoteOutput, reason: str, error: str | None = None) -> RemoteOutput:
    return dataclasses.replace(state, finished=True, finish_reason=reason, error=error, finish_time=time.monotonic())


def _message(response: httpx.Response) -> str:
    """The error message of an OpenAI-style error body (or the body's start)."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _raise_for(response: httpx.Response) -> None:
    if response.status_code != 200:
        raise ConnectError(f"{response.request.url.path}: HTTP {response.status_code}: {_message(response)}")
