"""Render chat templates in worker processes whose time and memory are limited.

A chat template is code from a model's files (a Jinja template in ``tokenizer_config.json``, a
GGUF header's ``tokenizer.chat_template``). transformers runs it in Jinja's sandbox, which stops
it reading files but not looping: nested loops of 10^10 iterations, or ``'a' * 10**10``, pass
the sandbox and hold a server thread for hours or take all its memory. So templates render in a
pool of worker processes (``template_worker.py``, shared by every tokenizer of this process): the
worker renders with the tokenizer itself (sent pickled once per worker, so the prompt is
exactly what ``tokenizer.apply_chat_template`` writes), each render has ``timeout_s`` and may
add ``memory_bytes``; a worker over either is killed or fails the render, and the request gets a
``ChatTemplateError`` saying which. Tokenizing the rendered text stays in this process.

A tokenizer that cannot be pickled, or whose class the worker cannot import (one from a model
directory's code, which the operator allowed with ``trust_remote_code``: that directory's code
runs here anyway), renders in this process, with a warning; nothing else does.

The price, measured on a 2-core Linux box (docs/serving.md): ~0.3 ms more per render (the round
trip), ~1.5 s once per worker to start it (Python, transformers, mlx-lm) and ~0.1 s once per
worker and tokenizer to load it. ``warm`` starts a worker ahead of the first request.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import pickle
import threading
import weakref
from pathlib import Path

from vllm_mlx.platform.worker_pool import Worker, WorkerCrashed, WorkerFailed, WorkerPool, WorkerTimeout

__all__ = ["ChatTemplateError", "TemplateGuard", "TemplateOverrun", "template_guard"]

DEFAULT_TIMEOUT_S = 10.0
"""Seconds one render may take (a chat of 100,000 tokens renders in ~50 ms)."""
DEFAULT_MEMORY_BYTES = 1 << 30
"""Memory one render may add to its worker."""
DEFAULT_MAX_WORKERS = 2
LOAD_TIMEOUT_S = 120.0
"""Seconds a worker may take to load a tokenizer (a 250k-token vocabulary takes ~1 s)."""
LOAD_MEMORY_BYTES = 8 << 30
"""Address space a worker may add loading a tokenizer (our own pickle: the cap only stops a runaway;
the tokenizer library's threads reserve much more address space than they use)."""

WORKER_HANDLER = Path(__file__).with_name("template_worker.py")

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The chat template refused the messages, or ran out of time or memory rendering them."""


class TemplateOverrun(ChatTemplateError):
    """The chat template ran out of time or memory (or its worker failed) rendering the messages."""


@dataclasses.dataclass(frozen=True)
class _Pickled:
    """A tokenizer as the workers load it, and the template it had when pickled."""

    key: str
    data: str  # base64 of the pickle
    chat_template: object


class TemplateGuard:
    """Renders chat templates in up to ``max_workers`` worker processes.

    Args:
        timeout_s: Seconds one render may take.
        memory_bytes: Memory one render may add to its worker.
        max_workers: Renders at once; more callers wait for a free worker.
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        max_workers: int = DEFAULT_MAX_WORKERS,
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.workers = WorkerPool(WORKER_HANDLER, {"memory_bytes": memory_bytes}, max_workers=max_workers)
        self._pickled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _Pickled | None
        self._lock = threading.Lock()

    def render(self, tokenizer, messages: list[dict], *, add_generation_prompt: bool, tools: list[dict] | None) -> str:
        """``tokenizer.apply_chat_template(messages, tokenize=False, ...)``, rendered in a worker.

        Raises:
            ChatTemplateError: The template refused the messages, or overran its time or memory.
        """
        pickled = self._pickle(tokenizer)
        if pickled is None:
            return _render_here(tokenizer, messages, add_generation_prompt, tools)
        request = {"tokenizer": pickled.key, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "tools": tools}  # fmt: skip
        with self.workers.worker() as worker:
            answer = self._ask(worker, request)
            if answer.get("missing"):
                if not self._load(worker, tokenizer, pickled):
                    return _render_here(tokenizer, messages, add_generation_prompt, tools)
                answer = self._ask(worker, request)
        if answer.get("out_of_memory"):
            raise self._out_of_memory()
        if "error" in answer:
            raise ChatTemplateError(answer["error"])
        return answer["text"]

    def warm(self, tokenizer) -> None:
        """Start a worker and load ``tokenizer`` into it, so the first request does not wait."""
        try:
            self.render(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tools=None)
        except (ChatTemplateError, RuntimeError) as exc:  # the request that needs it will say so
            logger.debug("warming the chat template worker: %s", exc)

    def close(self) -> None:
        """Stop the idle workers (a later render starts new ones)."""
        self.workers.close()

    def _ask(self, worker: Worker, request: dict, timeout_s: float | None = None) -> dict:
        try:
            return worker.ask(request, timeout_s or self.timeout_s, default=_template_value)
        except WorkerTimeout:
            raise TemplateOverrun(
                f"rendering the chat template took longer than {timeout_s or self.timeout_s:g} s; it was stopped"
            ) from None
        except WorkerCrashed:
            raise self._out_of_memory() from None
        except WorkerFailed as exc:
            raise TemplateOverrun(f"rendering the chat template failed in its worker ({exc})") from None

    def _out_of_memory(self) -> TemplateOverrun:
        return TemplateOverrun(
            f"rendering the chat template needed more than {self.memory_bytes >> 20} MiB of memory; it was stopped"
        )

    def _load(self, worker: Worker, tokenizer, pickled: _Pickled) -> bool:
        """Load ``tokenizer`` into ``worker``; False (and it renders here from now on) when the
        worker cannot import its class.

        Raises:
            TemplateOverrun: The load overran its (generous) time or memory.
        """
        request = {"load": pickled.key, "tokenizer": pickled.data, "memory_bytes": LOAD_MEMORY_BYTES}
        answer = self._ask(worker, request, LOAD_TIMEOUT_S)
        if "unloadable" not in answer:
            return True
        logger.warning("the chat template worker cannot load this tokenizer (%s): its chat template renders in "
                       "the server's process, without a time limit", answer["unloadable"])  # fmt: skip
        with self._lock:
            self._pickled[tokenizer] = None
        return False

    def _pickle(self, tokenizer) -> _Pickled | None:
        """``tokenizer`` pickled (once, again when its template changed), or None where it cannot be."""
        template = getattr(tokenizer, "chat_template", None)
        with self._lock:
            try:
                pickled = self._pickled.get(tokenizer, False)
            except TypeError:  # not weakly referenceable: pickled per call
                pickled = False
        if pickled is None or (pickled and pickled.chat_template == template):
            return pickled
        try:
            data = pickle.dumps(tokenizer)
        except Exception as exc:  # noqa: BLE001 -- any object may refuse pickling its own way
            logger.warning("this tokenizer cannot be sent to the chat template worker (%s): its chat template "
                           "renders in the server's process, without a time limit", exc)  # fmt: skip
            pickled = None
        else:
            pickled = _Pickled(hashlib.sha256(data).hexdigest()[:32], base64.b64encode(data).decode(), template)
        with self._lock:
            try:
                self._pickled[tokenizer] = pickled
            except TypeError:
                pass
        return pickled


def _render_here(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)


def _template_value(value: object) -> object:
    """A value JSON has no form for, as transformers hands it to a template (``_plain_template_data``):
    dataclasses and pydantic models as dicts, anything else as a placeholder naming its type."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return f"<{type(value).__name__}>"


_GUARD: TemplateGuard | None = None
_GUARD_LOCK = threading.Lock()


def template_guard() -> TemplateGuard:
    """This process's guard (shared: its workers keep several tokenizers)."""
    global _GUARD
    with _GUARD_LOCK:
        if _GUARD is None:
            _GUARD = TemplateGuard()
        return _GUARD
