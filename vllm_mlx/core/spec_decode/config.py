"""What ``speculative_config`` may say (vLLM's keys), checked once when the engine is configured.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})``, the same on
``EngineConfig``, ``--speculative-config '{"method": "ngram", ...}'`` on the CLI and the server,
``%vllm_mlx load --speculative-config ...`` in a notebook; a method's name alone
(``--speculative-config ngram``) takes its defaults, and a ``model`` without a method means
``draft_model`` (as in vLLM). An unknown key or method, or a value out of range, is a
``ValueError`` that names it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)
"""Proposers the engine runs."""
WHY_NOT = {
    "mtp": "mlx-lm drops the multi-token-prediction heads of every family that has them when it loads "
    "the weights (qwen3_5, qwen3_next, deepseek_v41, nemotron_h, mimo, kimi_linear, ...: their "
    "sanitize() removes the mtp weights), so there is no head to run; use 'draft_model' or 'ngram'",
}
"""vLLM's methods we do not run, and why."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. Every request that may speculate (``speculates``) does, with a
    proposal length the adaptive policy chooses up to ``num_speculative_tokens``."""

    method: str = NGRAM
    """``"ngram"``: prompt lookup, the tokens that followed the latest earlier occurrence of the
    context's tail (``core/spec_decode/ngram.py``); no extra model. ``"draft_model"``: a smaller
    model with the same tokenizer (``model``) proposes greedily (``engine/draft_model.py``)."""
    model: str | None = None
    """draft_model: the draft model (a path or anything ``model=`` takes); its tokenizer must
    be the target's."""
    num_speculative_tokens: int = 4
    """The most tokens proposed for one request in one step (k: a step verifies k + 1 positions)."""
    prompt_lookup_min: int = 1
    """ngram: the shortest tail matched."""
    prompt_lookup_max: int = 4
    """ngram: the longest tail matched (the longest that occurred earlier wins)."""
    adaptive: bool = True
    """Let each request's measured acceptance and the batch's size choose its proposal length
    (``core/spec_decode/policy.py``); False: always propose up to ``num_speculative_tokens``."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            why = f": {WHY_NOT[self.method]}" if self.method in WHY_NOT else f"; use one of {list(METHODS)}"
            raise ValueError(f"speculative_config: method {self.method!r} is not supported{why}")
        if (self.method == DRAFT_MODEL) != (self.model is not None):
            raise ValueError(
                "speculative_config: 'model' (the draft model) is required with method 'draft_model'"
                if self.model is None
                else f"speculative_config: 'model' is for method 'draft_model', not {self.method!r}"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"speculative_config: model must be a path or model name, got {self.model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The config from what a caller gave: itself, a dict of its keys, JSON text of one, a
        method's name alone (``"ngram"``: its defaults), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and value.strip().isidentifier():
            value = {"method": value.strip()}
        elif isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "model" in value and "method" not in value:
            value = {**value, "method": DRAFT_MODEL}
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MAX_SPECULATIVE_TOKENS = 16
"""More proposed tokens than this never pay: the chance that all of them are right falls
geometrically while the verify cost grows (bench/speculative_cost.py)."""


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The ``--speculative-config`` flag's JSON text."""
    config = SpeculativeConfig.of(text)
    assert config is not None
    return config
