"""The OpenAI-compatible HTTP server: a FastAPI app over one ``AsyncEngineCore``, run by uvicorn.

    vllm-mlx serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]

``build_app(engine)`` wires routes, middleware and error handlers around a started engine (the
caller owns the engine; several apps may share one, as the tests do). Besides OpenAI's chat
completions, completions and Responses, it serves Anthropic's Messages API (``/v1/messages``).
Every error is OpenAI's ``{"error": {message, type, param, code}}`` (Anthropic's
``{"type": "error", "error": {type, message}}`` on the ``/v1/messages`` routes): FastAPI's 422
validation errors become 400s.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_mlx import __version__
from vllm_mlx.config import EngineConfig
from vllm_mlx.core.sched.observation import RequestView
from vllm_mlx.core.snapshot import CacheSnapshot
from vllm_mlx.distributed.watchdog import RankLostError
from vllm_mlx.engine.async_engine import AsyncEngineCore, EngineDeadError
from vllm_mlx.engine.template_guard import template_guard
from vllm_mlx.entrypoints.anthropic.protocol import MessagesInput, MessagesRequest, error_body, is_messages_path
from vllm_mlx.entrypoints.anthropic.serving import AnthropicServing
from vllm_mlx.entrypoints.openai.cache_blocks import block_view
from vllm_mlx.entrypoints.openai.cache_disclosure import disk_view, visible
from vllm_mlx.entrypoints.openai.cli_args import lora_requests, serve_media_policy, serving_options, with_adapter_slots
from vllm_mlx.entrypoints.openai.metrics import ServerMetrics
from vllm_mlx.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES, ApiKeyMiddleware, BodySizeLimitMiddleware
from vllm_mlx.entrypoints.openai.lora_loading import LoRALoading
from vllm_mlx.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from vllm_mlx.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm_mlx.entrypoints.openai.serving import (
    ClientDisconnected,
    ModelInfo,
    OpenAIError,
    ServingOptions,
    engine_dead,
)
from vllm_mlx.entrypoints.openai.serving_chat import ChatServing
from vllm_mlx.entrypoints.openai.serving_completion import CompletionServing
from vllm_mlx.entrypoints.openai.serving_responses import ResponsesServing
from vllm_mlx.entrypoints.openai.serving_tokenize import TokenizeServing
from vllm_mlx.entrypoints.openai.sse_response import TRANSPORT_SCOPE_KEY, SSEResponse
from vllm_mlx.entrypoints.openai.tokenize_pool import TokenizePool
from vllm_mlx.entrypoints.request_model import UNENCODABLE
from vllm_mlx.lora.request import LoRARequest
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.cpu_backend import backend_summary, warn_reference_blas

logger = logging.getLogger(__name__)


class _ServerApp(FastAPI):
    """FastAPI, with each request's asyncio transport in its scope (``TRANSPORT_SCOPE_KEY``), where
    a stream's stall check reads its socket (``sse_response.py``). Under uvicorn, the ``send`` an
    app gets is a method of the request's cycle, which holds the connection's transport; under
    another server the key is absent, and only a blocked ``send`` counts as a stall."""

    async def __call__(self, scope, receive, send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if transport is not None and scope["type"] == "http":
            scope[TRANSPORT_SCOPE_KEY] = transport
        await super().__call__(scope, receive, send)


def build_app(
    engine: AsyncEngineCore,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    owns_engine: bool = False,
    media_policy: MediaPolicy | None = None,
    options: ServingOptions | None = None,
    lora_modules: Sequence[LoRARequest] = (),
    lora_loading_dir: str | Path | None = None,
) -> FastAPI:
    """The app for a started engine; ``served_model_name`` defaults to the model directory's name.
    Request images load under ``media_policy`` (None = ``MediaPolicy.server()``: no local file,
    no URL), whatever the engine's own policy.
    With ``owns_engine`` the app stops the engine when it shuts down. ``options``: the
    operator's limits and disclosure switches (None = the safe defaults). ``lora_modules``:
    adapters a request picks by naming one as its ``model`` (the engine needs ``enable_lora``).
    ``lora_loading_dir``: vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are on,
    for adapter folders inside it only (None: off, 404)."""
    options = options or ServingOptions()
    info = ModelInfo.read(engine)
    name = served_model_name or Path(info.path).name
    metrics = ServerMetrics(
        engine, name, disclose_hits=options.discloses_prefix_hits, per_tenant=options.enable_cache_stats_disclosure
    )
    pool = TokenizePool(options.tokenizer_threads)
    adapters = {lora.lora_name: lora for lora in lora_modules}
    chat = ChatServing(engine, name, metrics, info, pool, options, media_policy=media_policy, adapters=adapters)
    completion = CompletionServing(engine, name, metrics, info, pool, options, adapters=adapters)
    messages, responses = AnthropicServing(chat), ResponsesServing(chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if getattr(info.tokenizer, "chat_template", None):  # the first chat request need not start it
            pool.executor.submit(template_guard().warm, info.tokenizer)
        yield
        pool.shutdown()
        if owns_engine:  # here, not after uvicorn returns: it re-raises SIGTERM/SIGINT on exit
            await run_in_threadpool(engine.stop)

    app = _ServerApp(title="vllm-mlx", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, name
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # outermost: before the body is read

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error_response(OpenAIError(503, engine_health(engine), code="engine_dead"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    def model_cards() -> list[ModelCard]:
        card = ModelCard(id=name, root=name, max_model_len=info.max_model_len)  # no local paths
        return [card, *(ModelCard(id=n, root=n, parent=name, max_model_len=info.max_model_len) for n in adapters)]

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=model_cards()).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        card = next((c for c in model_cards() if c.id == model_id), None)
        if card is None:
            chat.check_model(model_id)  # the 404 that names what is served
        return card.model_dump()

    tokens = TokenizeServing(chat)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await tokens.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await tokens.detokenize(body)

    loading = LoRALoading(engine, adapters, lora_loading_dir, base_model=name)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return Response(await loading.load(body), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return Response(await loading.unload(body), media_type="text/plain")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(chat.create(body, request), options.stream_stall_timeout)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(completion.create(body, request), options.stream_stall_timeout)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await _respond(responses.create(body, request), options.stream_stall_timeout)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await _respond(messages.create(body, request), options.stream_stall_timeout)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesInput) -> dict:
        return (await messages.count_tokens(body)).model_dump()

    _add_cache_routes(app, engine, metrics, options)
    return app


def _add_cache_routes(app: FastAPI, engine: AsyncEngineCore, metrics: ServerMetrics, options: ServingOptions) -> None:
    """What the server tells about its cache and itself: stats, blocks, reset, Prometheus metrics."""

    async def engine_call(method):
        """A blocking engine method, off the event loop; a dead engine is a 503."""
        try:
            return await run_in_threadpool(method)
        except EngineDeadError as exc:
            raise engine_dead(exc.__cause__) from None

    @app.get("/v1/cache/stats")
    async def cache_stats() -> dict:
        summary = summarize_snapshot(await engine_call(engine.snapshot), options)
        disk = (await engine_call(engine.stats)).kv_disk
        if disk is not None:
            summary["kv_disk"] = disk_view(disk, options.discloses_prefix_hits)
        return summary

    @app.get("/v1/cache/blocks")
    async def cache_blocks(request_id: Annotated[list[str] | None, Query()] = None) -> dict:
        snapshot = await engine_call(engine.snapshot)
        return block_view(
            snapshot, request_id or [], per_request=options.cache_stats_per_request,
            disclose_hits=options.discloses_prefix_hits, per_tenant=options.enable_cache_stats_disclosure,
        )  # fmt: skip

    @app.delete("/v1/cache")
    async def reset_cache() -> dict:
        return {"reset": bool(await engine_call(engine.reset_prefix_cache))}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)


async def _respond(pending, stall_timeout: float | None) -> Response:
    """The JSON response, or the SSE stream (given up after ``stall_timeout`` s without a read)."""
    try:
        result = await pending
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SSEResponse(result, stall_timeout=stall_timeout, headers=headers)


def summarize_snapshot(snapshot: CacheSnapshot, options: ServingOptions | None = None) -> dict:
    """The stats endpoint's view of an engine ``snapshot()``: counts, not the block list.

    Requests appear as counts by status; with ``options.cache_stats_per_request`` (an operator's
    switch) also one entry per live request (its id and token counts, which other clients must
    not see). Numbers that move with prefix hits (counters, cached blocks, the free queue) only
    where ``options.discloses_prefix_hits`` (see ``cache_disclosure``).
    """
    options = options or ServingOptions()
    views, disclose = snapshot.requests, options.discloses_prefix_hits
    stats = visible(snapshot.stats, views, disclose=disclose)
    if disclose:
        block_states = dict(Counter(block.state for block in snapshot.blocks))
        free_queue_length = len(snapshot.free_queue)
    else:
        used, free = stats.num_used_blocks, stats.num_free_blocks
        block_states = {state: count for state, count in (("null", 1), ("used", used), ("free", free)) if count}
        free_queue_length = free
    summary = {
        "block_size": snapshot.block_size,
        "stats": stats.to_dict(tenants=options.enable_cache_stats_disclosure),
        "block_states": block_states,
        "free_queue_length": free_queue_length,
        "request_states": dict(Counter(view.status for view in views.values())),
        "cache_stats_disclosed": disclose,
    }
    if options.cache_stats_per_request:
        summary["requests"] = {request_id: _request_summary(view) for request_id, view in views.items()}
    return summary


def _request_summary(view: RequestView) -> dict:
    """One live request's counts for the stats endpoint: its view less the block ids, plus how many."""
    data = view.to_dict()
    del data["block_ids"]
    return data | {"num_blocks": len(view.block_ids)}


def engine_health(engine: AsyncEngineCore) -> str:
    """Why ``/health`` fails: the kind of failure (the traceback is in the log), or a stop. A
    lost tensor-parallel rank is said in full (its message names ranks and steps only)."""
    if isinstance(engine.error, RankLostError):
        return f"The engine failed: {engine.error}"
    if engine.error is not None:
        return f"The engine failed ({type(engine.error).__name__}); see the server log."
    return "The engine is not running."


# -- errors -----------------------------------------------------------------------------------


def _error_response(exc: OpenAIError, request: Request | None = None) -> JSONResponse:
    """The error in the shape of the API the request went to."""
    if request is not None and is_messages_path(request.url.path):
        return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status)
    return JSONResponse(exc.to_dict(), status_code=exc.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_to_openai(exc.errors()), request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        unrouted = exc.status_code == 404 and exc.detail == "Not Found"  # no route, not a handler's 404
        message = _not_served(request.url.path) if unrouted else str(exc.detail)
        response = _error_response(OpenAIError(exc.status_code, message, code=code), request)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(EngineDeadError)
    async def dead_engine(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_response(engine_dead(exc.__cause__), request)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # The details (paths, reprs) go to the log, never to the client.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error_response(OpenAIError(500, "Internal server error; see the server log."), request)


SERVED_PATHS = (
    "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, /tokenize, "
    "/detokenize, /v1/cache/stats, /health, /metrics"
)
NOT_YET = {
    "/v1/embeddings": "embeddings are not supported by this server yet",
    "/v1/score": "scoring is not supported by this server yet",
    "/v1/rerank": "reranking is not supported by this server yet",
    "/v1/audio": "audio is not supported by this server",
    "/v1/images": "image generation is not supported by this server",
}


def _not_served(path: str) -> str:
    """A 404's message: what this path would be, if we know it, and what is served."""
    reason = next((why for prefix, why in NOT_YET.items() if path.startswith(prefix)), f"{path} is not served here")
    return f"Not found: {reason}. This server serves {SERVED_PATHS}."


def validation_to_openai(errors) -> OpenAIError:
    """FastAPI/pydantic validation errors -> one 400 naming the first bad field."""
    errors = list(errors)
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return OpenAIError(400, f"Malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    unencodable = next((e for e in errors if e.get("type") == UNENCODABLE), None)
    if unencodable is not None:  # the whole body's check: its path, not the body's, names the field
        param = unencodable["ctx"]["path"].split(".")[0]
        return OpenAIError(400, f"Invalid request: {unencodable['msg']}", param=param, code="invalid_request")
    parts, param = [], None
    for error in errors[:3]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    return OpenAIError(400, "Invalid request: " + "; ".join(parts) + more, param=param, code="invalid_request")


# -- running it -------------------------------------------------------------------------------


def served_name(model: str, path: Path) -> str:
    """The default model id: a hub id as given; the directory name for a path or 'default'."""
    if model != "default" and not Path(model).expanduser().exists():
        return model
    return path.name


def run_server(args: argparse.Namespace, engine_options: dict) -> int:
    """``vllm-mlx serve``: start the engine, serve until interrupted, stop the engine.

    Returns 0 after an interrupt, 1 when the engine failed (so a supervisor restarts it).
    """
    import uvicorn

    media_policy = serve_media_policy(args)  # a bad flag fails before the model loads
    options = serving_options(args)
    loras = lora_requests(args)
    engine_options = with_adapter_slots(engine_options, len(loras))
    engine = AsyncEngineCore(EngineConfig(model=args.model, **engine_options)).start()
    try:
        for lora in loras:  # read now: an adapter that does not fit stops the server before it serves
            try:
                engine.register_lora(lora)
            except ValueError as exc:  # AdapterError: unreadable, another model's, neither LoRA nor DoRA
                print(f"vllm-mlx serve: --lora-modules {lora.lora_name}: {exc}", file=sys.stderr, flush=True)
                return 2
        name = args.served_model_name or served_name(args.model, engine.model_path)
        app = build_app(
            engine,
            served_model_name=name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_size,
            owns_engine=True,
            media_policy=media_policy,
            options=options,
            lora_modules=loras,
            lora_loading_dir=args.enable_lora_loading,
        )
        backend = backend_summary(engine.weight_format)
        print(f"vllm-mlx: serving {name!r} on http://{args.host}:{args.port} ({backend})", file=sys.stderr, flush=True)
        warn_reference_blas()
        if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
            print("vllm-mlx: warning: listening beyond loopback without --api-key", file=sys.stderr, flush=True)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
        return serve_until_engine_ends(uvicorn.Server(config), engine)
    finally:
        engine.stop()


def serve_until_engine_ends(server, engine: AsyncEngineCore, **run_kwargs) -> int:
    """Run the uvicorn ``server`` until it is interrupted or the engine thread ends.

    A failed engine shuts the server down and returns 1: with no engine it could only answer
    503s, and a supervisor (systemd, Kubernetes, a shell loop) restarts a process that exits.
    """

    def watch() -> None:
        engine.wait_ended()
        if engine.error is not None:
            print(
                f"vllm-mlx: the engine failed ({type(engine.error).__name__}); shutting down (exit status 1)",
                file=sys.stderr,
                flush=True,
            )
        server.should_exit = True

    threading.Thread(target=watch, name="vllm-mlx-engine-watch", daemon=True).start()
    server.run(**run_kwargs)
    return 1 if engine.error is not None else 0
