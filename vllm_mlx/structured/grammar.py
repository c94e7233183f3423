"""Compile ``StructuredOutputsParams`` into llguidance matchers, cached by content.

Why llguidance (docs/benchmarks.md has the numbers): compiling a mid-size JSON Schema takes
~1 ms where XGrammar takes 180-680 ms (llguidance builds its lexer lazily, while masks are
computed), and its per-token mask cost (~30 us mean) is far below a decode step. It is what
vLLM and upstream vllm-mlx use.

``GrammarCompiler`` is thread-safe and does no MLX work: callers compile on their own thread
(the server in a worker thread, ``LLM`` on the caller's), and the engine thread only copies a
compiled grammar's initial matcher for each request (~10 us).

Before anything compiles, ``bounds.py`` refuses bounds that would cost unbounded memory; a
grammar not in the cache is then proven safe in a capped worker process (``compile_guard.py``)
before it is compiled here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from vllm_mlx.structured.bounds import DEFAULT_MAX_CONSTRAINT_BOUND, BoundExceeded, check_bounds
from vllm_mlx.structured.compile_guard import CompileGuard, CompileRefused
from vllm_mlx.structured.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used go first)."""


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (a bad schema, regex or grammar); the message says
    what is wrong in one line."""


class ConstraintTooLarge(ConstraintError):
    """A constraint too costly to compile: a bound over the limit (``bounds.py``), or a compile
    that ran out of memory or time in the guard's worker (``compile_guard.py``)."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``params`` (its JSON form; the cache key is its hash)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema_of(params.json)
        if params.disable_additional_properties:
            schema = close_objects(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ConstraintError(f"invalid JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes; non-ASCII stays as it is.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(_to_lark(params.grammar))


def _schema_of(value: str | dict | bool) -> dict | bool:
    return json.loads(value) if isinstance(value, str) else value


def _to_lark(grammar: str) -> str:
    """Lark as it is; GBNF (llama.cpp's ``root ::= ...``) converted by llguidance."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # the converter raises bare exceptions on bad GBNF
        raise ConstraintError(f"invalid grammar: {exc}") from None


def close_objects(schema: object) -> object:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``false`` (vLLM's ``disable_additional_properties``); other nodes are walked unchanged."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: close_objects(v) for k, v in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: its initial matcher, copied for each request that uses it."""

    key: str
    """sha256 of the grammar text (what the cache is keyed by)."""
    kind: str
    matcher: object
    """An ``llguidance.LLMatcher`` never advanced: only ``deep_copy`` is called on it."""
    vocab_size: int
    """Tokens its matchers know: their bitmasks have ceil(vocab_size / 32) words."""

    def new_matcher(self):
        """A fresh matcher at the start of the output (each request and each of ``n`` completions
        gets its own: no state crosses requests)."""
        return self.matcher.deep_copy()


class GrammarCompiler:
    """Builds matchers for one tokenizer; keeps the last ``cache_size`` compiled grammars.

    The llguidance tokenizer (~0.25 s to build) is made on first use, so engines that never
    see a constraint never pay for it.

    Args:
        tokenizer: The model's tokenizer (mlx-lm's ``TokenizerWrapper`` or a Hugging Face fast
            tokenizer): llguidance reads its ``tokenizer.json`` form.
        eos_token_ids: Every token that ends a completion: the constraint allows them exactly
            where the output is complete.
        cache_size: Compiled grammars kept.
        max_bound: The largest repetition bound a constraint may hold (``bounds.py``); ``compile``
            may be given another.
        isolate: Prove each grammar not in the cache safe in a worker process first
            (``compile_guard.py``); off only where the caller trusts every constraint.
    """

    def __init__(
        self,
        tokenizer,
        eos_token_ids,
        cache_size: int = DEFAULT_CACHE_SIZE,
        *,
        max_bound: int = DEFAULT_MAX_CONSTRAINT_BOUND,
        isolate: bool = True,
    ) -> None:
        self._hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.max_bound = max_bound
        self.isolate = isolate
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._tokenizer_json: str | None = None
        self._guard: CompileGuard | None = None
        self.hits = self.misses = 0

    @property
    def ll_tokenizer(self):
        """The llguidance tokenizer (built on first use, once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self):
        import llguidance

        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConstraintError("structured outputs need a fast (tokenizer.json) tokenizer; this model has none")
        backend = copy.copy(backend)  # serialized without padding or truncation, which llguidance must not see
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer_json = backend.to_str()
        return llguidance.LLTokenizer(self._tokenizer_json, eos_token=self.eos_token_ids or None)

    @property
    def guard(self) -> CompileGuard:
        """The worker pool that proves grammars safe (its workers start on first use)."""
        self.ll_tokenizer  # noqa: B018 -- builds the tokenizer text the workers load
        with self._lock:
            if self._guard is None:
                self._guard = CompileGuard(self._tokenizer_json, self.eos_token_ids)
            return self._guard

    def close(self) -> None:
        """Stop the guard's workers (they also exit with this process)."""
        with self._lock:
            guard = self._guard
        if guard is not None:
            guard.close()

    @property
    def vocab_size(self) -> int:
        """Tokens the matchers know (bitmask width = ceil(vocab_size / 32) words)."""
        return self.ll_tokenizer.vocab_size

    def compile(self, params: StructuredOutputsParams, max_bound: int | None = None) -> CompiledGrammar:
        """The compiled grammar of ``params``, from the cache when the same constraint was seen.
        ``max_bound``: the largest repetition bound allowed (None: this compiler's).

        Raises:
            ConstraintTooLarge: A bound over the limit, or a compile that ran out of memory or
                time in the guard's worker.
            ConstraintError: The schema, regex or grammar is invalid (the message says why).
        """
        try:
            check_bounds(params, self.max_bound if max_bound is None else max_bound)
        except BoundExceeded as exc:
            raise ConstraintTooLarge(str(exc)) from None
        text = grammar_text(params)
        key = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        compiled = CompiledGrammar(key, params.kind, self._new_matcher(text, params.kind), self.vocab_size)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _new_matcher(self, text: str, kind: str):
        if not self.isolate:
            return self._build_matcher(text, kind)
        try:
            with self.guard.checked(text) as error:
                if error is not None:
                    raise ConstraintError(f"invalid {_KIND_NAMES[kind]}: {compact_error(error)}")
                return self._build_matcher(text, kind)
        except CompileRefused as exc:
            raise ConstraintTooLarge(f"the {_KIND_NAMES[kind]} is too costly to compile: {exc}") from None

    def _build_matcher(self, text: str, kind: str):
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)  # never raises
        if matcher.is_error():
            raise ConstraintError(f"invalid {_KIND_NAMES[kind]}: {compact_error(matcher.get_error())}")
        return matcher

    def stats_view(self) -> GrammarCacheStats:
        """The compiled-grammar cache's counters (a copy)."""
        with self._lock:
            return GrammarCacheStats(len(self._cache), self.hits, self.misses)

    def stats(self) -> dict:
        """``stats_view()`` as plain data: cached grammars, hits and misses."""
        return self.stats_view().to_dict()


@dataclass
class GrammarCacheStats:
    """The compiled-grammar cache (``get_stats()["structured_outputs"]``)."""

    cached: int
    """Compiled grammars kept."""
    hits: int
    """Constraints served from the cache."""
    misses: int
    """Constraints compiled."""

    def to_dict(self) -> dict:
        return {"cached": self.cached, "hits": self.hits, "misses": self.misses}

    @classmethod
    def from_dict(cls, data: dict) -> GrammarCacheStats:
        return cls(data["cached"], data["hits"], data["misses"])


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def compact_error(message: str, limit: int = 300) -> str:
    """llguidance's multi-line message (source excerpts, carets, parser state) as one line."""
    message = message.split("<state>")[0]
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not _EXCERPT.match(line)]
    text = " ".join(kept) or "unknown error"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_EXCERPT = re.compile(r"^(\^+|\d+ \|.*)$")  # a caret line, or a numbered source line
