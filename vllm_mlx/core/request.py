"""Requests and their outputs: SamplingParams, RequestStatus, Request, RequestOutput.

Pure Python bookkeeping (no MLX): the scheduler owns ``Request`` objects and the
engine turns them into ``RequestOutput`` snapshots for callers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING

from vllm_mlx.core.fields import described
from vllm_mlx.platform.validation import check_encodable
from vllm_mlx.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from vllm_mlx.core.multimodal import MultiModalInput
    from vllm_mlx.structured.matcher import RequestConstraint
    from vllm_mlx.structured.reasoning_gate import ReasoningGate

MAX_LOGPROBS = 20
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)


# ---------------------------------------------------------------------------
# Validation helpers: each raises ValueError naming the field, value and range.


def _require_int(name: str, value: object) -> int:
    # bool is an int subclass; True as max_tokens is almost surely a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return value


def _require_float(name: str, value: object) -> int | float:
    """Return ``value`` unchanged (messages show what the caller passed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _check_min(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


def _normalize_stop(value: object) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a str or a list of str, got {value!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        check_encodable("stop", s)
    return list(items)


def _normalize_stop_token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"stop_token_ids must be a list of int, got {value!r}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r} in {value!r}")
    return list(value)


# ---------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """How to sample one request's completion (vLLM's field names and defaults). Each field's
    meaning is declared with it (``described``), and the configuration reference's
    ``SamplingParams`` table is generated from those declarations.

    Validated in ``__post_init__``: a bad value raises ``ValueError`` naming the
    field. ``stop`` is normalised to a list (a single str is accepted),
    ``stop_token_ids`` to a list and ``top_k=-1`` to ``0`` (both mean disabled).
    Validation runs at construction only; derive changed copies with
    ``dataclasses.replace`` (or ``clone``), which validates again.

    Raises:
        ValueError: A field has the wrong type or is out of range; the message names the
            field, the allowed range and the value given.
    """

    max_tokens: int = described(16, doc="most tokens to generate (>= 1)")
    min_tokens: int = described(
        0, doc="EOS and stop tokens are suppressed until this many tokens exist (0..`max_tokens`)",
    )  # fmt: skip
    temperature: float = described(1.0, doc="sampling temperature, >= 0; `0` is greedy (argmax)")
    top_p: float = described(1.0, doc="nucleus sampling mass in (0, 1]; `1` disables it")
    top_k: int = described(0, doc="keep the k most likely tokens; `0` (or `-1`, stored as `0`) disables it")
    min_p: float = described(
        0.0, doc="drop tokens below `min_p` × p(most likely token), in [0, 1]; `0` disables it",
    )  # fmt: skip
    repetition_penalty: float = described(1.0, doc="> 0; `1` disables it; applies to prompt and output tokens")
    presence_penalty: float = described(0.0, doc="in [-2, 2]; applies to output tokens")
    frequency_penalty: float = described(0.0, doc="in [-2, 2]; applies to output tokens")
    seed: int | None = described(
        None, doc="per-request seed: the same seed gives the same sample, alone or batched; `None` = the engine "
        "draws one (from `EngineConfig.seed`); with `n > 1` completion `i` uses `seed + i`",
    )  # fmt: skip
    stop: list[str] = described(
        default_factory=list,
        doc="strings that end generation (not included in the output); a single `str` is accepted",
    )  # fmt: skip
    stop_token_ids: list[int] = described(
        default_factory=list,
        doc="token ids that end generation, besides the model's EOS (the stopping token is in `token_ids`, not in "
        "the text)",
    )  # fmt: skip
    ignore_eos: bool = described(False, doc="keep generating past EOS (benchmarks)")
    logprobs: int | None = described(
        None, doc=f"how many top log-probabilities to return per token (0..{MAX_LOGPROBS}); `None` = none",
    )  # fmt: skip
    n: int = described(1, doc="completions per prompt (>= 1); they share the prompt's KV blocks")
    skip_special_tokens: bool = described(True, doc="leave special tokens out of the text")
    structured_outputs: StructuredOutputsParams | None = described(
        None, doc="constrain the output to a JSON Schema, regex, choice or grammar "
        "([Structured outputs](structured_outputs.md)); on a thinking model it starts after `</think>`",
    )  # fmt: skip
    max_thinking_tokens: int | None = described(
        None, doc="a thinking model's reasoning budget: `</think>` is forced after this many reasoning tokens "
        "(`None` = no limit; needs single-token think markers in the tokenizer) "
        "([Thinking models](structured_outputs.md#thinking-models))",
    )  # fmt: skip

    def __post_init__(self) -> None:
        self._validate_lengths()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_outputs()
        for name in _FLOAT_FIELDS:  # ints are accepted; store floats
            setattr(self, name, float(getattr(self, name)))

    def _validate_lengths(self) -> None:
        _check_min("max_tokens", _require_int("max_tokens", self.max_tokens), 1)
        _check_min("min_tokens", _require_int("min_tokens", self.min_tokens), 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.max_thinking_tokens is not None:
            _check_min("max_thinking_tokens", _require_int("max_thinking_tokens", self.max_thinking_tokens), 0)

    def _validate_sampling(self) -> None:
        _check_min("temperature", _require_float("temperature", self.temperature), 0)
        _check_range("top_p", _require_float("top_p", self.top_p), 0, 1, lo_open=True)
        top_k = _require_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {top_k}")
        self.top_k = max(top_k, 0)
        _check_range("min_p", _require_float("min_p", self.min_p), 0, 1)
        if self.seed is not None:
            _require_int("seed", self.seed)

    def _validate_penalties(self) -> None:
        if _require_float("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, _require_float(name, getattr(self, name)), -2, 2)

    def _validate_outputs(self) -> None:
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        _require_bool("ignore_eos", self.ignore_eos)
        _require_bool("skip_special_tokens", self.skip_special_tokens)
        if self.logprobs is not None:
            _check_range("logprobs", _require_int("logprobs", self.logprobs), 0, MAX_LOGPROBS)
        _check_min("n", _require_int("n", self.n), 1)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature == 0)."""
        return self.temperature == 0

    def clone(self, **changes) -> SamplingParams:
        """A validated copy (lists copied), with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


class RequestStatus(IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is final."""

    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()
    FINISHED_STOPPED = auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = auto()  # max_tokens reached (or the model's context)
    FINISHED_ABORTED = auto()  # cancelled by the caller
    FINISHED_ERROR = auto()  # failed alone (e.g. prompt too long); others keep running

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason: "stop", "length", "abort", "error"; None if not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    Token accounting (the scheduler counts tokens, not phases):

    - ``num_tokens = num_prompt_tokens + num_output_tokens``, and
      ``0 <= num_computed_tokens <= num_tokens``: tokens whose KV is in the cache.
      A request needs another forward pass over
      ``num_tokens - num_computed_tokens`` tokens (prefill, chunked or not, then
      one token per decode step).
    - ``num_cached_tokens`` counts prompt tokens served from the prefix cache on
      first scheduling; they are part of ``num_computed_tokens``.
    - On preemption (``preempt``) the KV blocks are freed and
      ``num_computed_tokens`` resets to 0: prompt and output so far are recomputed
      when it is scheduled again; ``output_token_ids`` is kept.

    Identity semantics (``eq=False``): requests hash and compare by object.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    """Folded into prefix-cache block hashes: different salts never share blocks."""
    mm_input: MultiModalInput | None = None
    """The prompt's images (placeholders, hashes, rotary positions); None for text prompts."""
    fairness_key: str = ""
    """Requests with the same key share one turn of admission (round-robin across keys, FIFO
    within one): all completions and prompts of one caller's request. "" = the request id."""

    # Mutable state, owned by the scheduler.
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, else None."""
    error_message: str | None = None
    constraint: RequestConstraint | None = None
    """The matcher of its structured-output constraint (the model runner masks its logits)."""
    reasoning_gate: ReasoningGate | None = None
    """A thinking model's reasoning: where the constraint starts, the thinking budget."""
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_disk_tokens: int = 0
    """Prompt tokens whose KV the disk tier read back for this request (part of its cache hit)."""
    lora_id: int = 0
    """The LoRA adapter it runs with (``LoRARequest.lora_int_id``; 0: the base model)."""
    lora_digest: str | None = None
    """Its adapter's content digest, part of its block hashes: a block computed under one
    adapter never serves another (nor, through the disk tier, another process's same id)."""
    lora_slot: int = 0
    """The adapter slot its rows use while it runs (set at admission; 0: the base model)."""
    admission_passes: int = 0
    """Steps in which it could not be admitted (``Scheduler.admission_check``) and others were
    admitted past it; bounded by ``MAX_ADMISSION_PASSES``."""
    speculative: bool | None = None
    """Whether this request speculates: None leaves it to the engine (it does when the engine has
    a ``speculative_config``); True asks for it (n-gram lookup when the engine has no config);
    False never (``EngineCore.add_request(speculative=...)``, ``%%generate --speculative``)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Tokens proposed to follow the known ones (speculative decoding), verified by the next
    step; never part of ``output_token_ids`` until verified."""
    num_draft_tokens: int = 0
    """Proposed tokens verified so far."""
    num_accepted_tokens: int = 0
    """Of them, those kept (each one a token the model itself chose)."""

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.fairness_key = self.fairness_key or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list on each call)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token. Its KV is not computed yet: the next step does it."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)

    def preempt(self) -> None:
        """Mark preempted: its blocks are gone, so everything is recomputed later."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.num_preemptions += 1

    def finish(self, status: RequestStatus, reason: str | int | None = None) -> None:
        """Move to a final ``status``; ``reason`` is the stop string/token id, if any.

        The first finish wins: finishing a finished request (say, an abort that
        raced a natural stop) changes nothing.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        if self.is_finished:
            return
        self.status = status
        self.stop_reason = reason
        self.finish_time = time.monotonic()

    def error(self, message: str) -> None:
        """Finish with FINISHED_ERROR and keep ``message`` for the caller."""
        if not self.is_finished:
            self.error_message = message
        self.finish(RequestStatus.FINISHED_ERROR)


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's shape: ``out.outputs[0].text``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    """One dict per generated token: top-N token id -> logprob, the sampled token included."""
    finish_reason: str | None = None
    """"stop", "length", "abort", "error", or None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that matched, else None."""
    parsed: object = None
    """With ``LLM.generate/chat(response_format=...)``: the text parsed and validated (a
    Pydantic model instance, or the JSON value); None when it does not parse or validate
    (e.g. cut short by ``max_tokens``)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Counts of a request's generation beyond its tokens (all its completions together)."""

    num_draft_tokens: int = 0
    """Proposed tokens verified (speculative decoding; 0 without it)."""
    num_accepted_tokens: int = 0
    """Of them, those kept: each one a token the model chose, produced without a step of its own."""
    num_disk_tokens: int = 0
    """Of the prompt tokens served from the prefix cache (``num_cached_tokens``), those whose KV
    the disk tier read back (``kv_disk_path``) rather than found in memory."""

    @property
    def acceptance_rate(self) -> float | None:
        """Kept over proposed; None before any proposal."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass
class RequestOutput:
    """A snapshot of a request's progress, delivered after each engine step.

    ``outputs`` hold the full text and tokens so far; ``new_token_ids`` and
    ``new_text`` are what is new since the previous snapshot of ``outputs[0]`` the
    consumer received (streaming; a ``RequestStream`` joins the deltas of snapshots
    it coalesced). The last snapshot has ``finished=True``; ``error`` is set when
    the request failed alone.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    """Times from time.monotonic()."""
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    """Speculative decoding's proposed and accepted tokens so far."""

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None

    @property
    def parsed(self) -> object:
        """The first completion's ``parsed`` (see ``CompletionOutput.parsed``)."""
        return self.outputs[0].parsed if self.outputs else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token, or None."""
        if self.arrival_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to finish, or None while running."""
        if self.arrival_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    def absorb_unread(self, unread: RequestOutput) -> RequestOutput:
        """This snapshot standing in for the older ``unread`` too (a stream keeps only the latest one
        its consumer has not read): everything is cumulative except ``new_token_ids`` and
        ``new_text``, which become ``unread``'s followed by this one's. Takes over ``unread``'s
        delta list (extended in place: joining stays linear however long the consumer lags)."""
        unread.new_token_ids.extend(self.new_token_ids)
        self.new_token_ids = unread.new_token_ids
        self.new_text = unread.new_text + self.new_text
        return self
