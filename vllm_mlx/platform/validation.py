"""Checks at the boundary where untrusted input enters: text that must encode, and the caps
that keep one request from taking the engine's memory or time.

Pure Python (no MLX, no imports of ours): ``SamplingParams``, the engine and the server all use these, so a bad
value gets the same clear ``ValueError`` whichever front door it came through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class SampledLimits(Protocol):
    """What ``RequestLimits.check_sampling`` reads of a ``request.SamplingParams`` (a protocol:
    request.py imports this module, so this module cannot import it back)."""

    n: int
    stop: list[str]
    stop_token_ids: list[int]


def check_encodable(name: str, text: str) -> None:
    """Raise ``ValueError`` if ``text`` cannot be encoded as UTF-8.

    JSON (and Python) strings may hold unpaired surrogates (``"\\ud800"``); tokenizers and
    the block hashes need UTF-8, so such text is refused where it enters.
    """
    if not is_encodable(text):
        index = next(i for i, char in enumerate(text) if "\ud800" <= char <= "\udfff")
        raise ValueError(f"{name} is not valid Unicode: unpaired surrogate at index {index}")


def is_encodable(text: str) -> bool:
    """True when ``text`` encodes as UTF-8 (it holds no unpaired surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_path(value: object, path: str = "") -> str | None:
    """The dotted path (``messages.0.content``) of the first string in ``value`` (JSON data:
    dicts, lists, strings, numbers) that is not valid UTF-8; a bad dict key gives its dict's
    path (``body`` at the top). None when every string encodes."""
    if isinstance(value, str):
        return None if is_encodable(value) else path or "body"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and not is_encodable(key):
            return path or "body"
        found = unencodable_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class RequestLimits:
    """Per-request caps an operator sets (``vllm-mlx serve --max-...``); the defaults are
    the server's safe ones. Each cap is checked before any work is queued."""

    max_prompts_per_request: int = field(default=256, metadata={"help": "prompts in one /v1/completions request"})
    max_n: int = field(default=16, metadata={"help": "completions per prompt (n)"})
    max_stop_strings: int = field(default=32, metadata={"help": "stop strings per request"})
    max_stop_string_length: int = field(default=1024, metadata={"help": "characters in one stop string"})
    max_stop_token_ids: int = field(default=256, metadata={"help": "stop token ids per request"})
    max_constraint_bound: int = field(
        default=10_000,
        metadata={"help": "largest repetition bound in a structured-output constraint (maxItems, regex {n,m}, ...); "
                  "all of one constraint's bounds may add up to 10 times it"},
    )  # fmt: skip  -- structured/bounds.py DEFAULT_MAX_CONSTRAINT_BOUND

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def check_num_prompts(self, num_prompts: int) -> None:
        if num_prompts > self.max_prompts_per_request:
            raise LimitExceeded(
                "prompt",
                f"{num_prompts} prompts in one request exceed the limit of {self.max_prompts_per_request} "
                "(--max-prompts-per-request)",
            )

    def check_sampling(self, params: SampledLimits) -> None:
        """Raise ``LimitExceeded`` (a ``ValueError``) naming the field and the flag."""
        if params.n > self.max_n:
            raise LimitExceeded("n", f"n={params.n} exceeds the limit of {self.max_n} (--max-n)")
        if len(params.stop) > self.max_stop_strings:
            raise LimitExceeded(
                "stop", f"{len(params.stop)} stop strings exceed the limit of {self.max_stop_strings} (--max-stop-strings)"
            )
        longest = max(map(len, params.stop), default=0)
        if longest > self.max_stop_string_length:
            raise LimitExceeded(
                "stop",
                f"a stop string of {longest} characters exceeds the limit of {self.max_stop_string_length} "
                "(--max-stop-string-length)",
            )
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise LimitExceeded(
                "stop_token_ids",
                f"{len(params.stop_token_ids)} stop token ids exceed the limit of {self.max_stop_token_ids} "
                "(--max-stop-token-ids)",
            )


class LimitExceeded(ValueError):
    """A request over one of the operator's caps; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
