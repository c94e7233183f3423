"""The token view of ``%%generate --logprobs K``: per-token data and its HTML.

Each generated token is shaded by its probability; hovering it shows the top K alternatives
(pure CSS, so it works while the cell is busy and in a saved notebook). Token text is model
output: every piece of it is HTML-escaped, and nothing here emits a tag from it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm_mlx_jupyter.views.markup import escape

TOKENS = "tokens"  # the generation format that renders the token view

# Scoped to .vllm-mlx-tokens; hover shows the alternatives, with no script.
_STYLE = """<style>
.vllm-mlx-tokens { font: 13px/1.9 var(--jp-code-font-family, monospace); white-space: pre-wrap; word-break: break-word; }
.vllm-mlx-tok { position: relative; border-radius: 2px; cursor: default; }
.vllm-mlx-tok:hover { outline: 1px solid #1e88e5; }
.vllm-mlx-alts { display: none; position: absolute; left: 0; top: 1.7em; z-index: 20; min-width: 12em;
  padding: 4px 6px; border-radius: 4px; background: rgba(30, 30, 30, 0.94); color: #fff; white-space: pre; font-size: 11px; line-height: 1.5; }
.vllm-mlx-tok:hover > .vllm-mlx-alts { display: block; }
.vllm-mlx-alt-sampled { color: #ffd54f; }
</style>"""


@dataclass(frozen=True)
class Alternative:
    """One of the top-K candidates at a position."""

    text: str
    token_id: int
    logprob: float

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)


@dataclass(frozen=True)
class TokenInfo:
    """One generated token: its text, its logprob and the top-K alternatives at its position
    (most likely first; they may or may not include the sampled token)."""

    text: str
    token_id: int
    logprob: float
    top: tuple[Alternative, ...]

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)


class TokenLog:
    """Builds ``TokenInfo``s from a generation's outputs, extending as tokens arrive (each
    token is decoded once). ``decode`` turns one token id into text; ``k`` is ``--logprobs``.
    Thread-safe: the consumer thread renders while the kernel reads ``.tokens``."""

    def __init__(self, decode: Callable[[int], str], k: int) -> None:
        self._decode = decode
        self._k = k
        self._tokens: list[TokenInfo] = []
        self._texts: dict[int, str] = {}
        self._lock = threading.Lock()

    def update(self, output) -> list[TokenInfo]:
        """The tokens of ``output`` (a ``RequestOutput``, a server's ``RemoteOutput``, which
        brings them built, or None), as a new list."""
        streamed = getattr(output, "token_infos", None)
        if streamed is not None:
            return list(streamed)
        completion = output.outputs[0] if output is not None and output.outputs else None
        with self._lock:
            if completion is not None and completion.logprobs is not None:
                pairs = zip(completion.token_ids, completion.logprobs)
                for token_id, entry in list(pairs)[len(self._tokens) :]:
                    self._tokens.append(self._info(token_id, entry))
            return list(self._tokens)

    def _info(self, token_id: int, entry: dict[int, float]) -> TokenInfo:
        """``entry``: top-K ids -> logprobs, plus the sampled one (as the engine records it)."""
        best = sorted(entry.items(), key=lambda item: -item[1])[: self._k]
        top = tuple(Alternative(self._text(i), i, lp) for i, lp in best)
        return TokenInfo(self._text(token_id), token_id, entry[token_id], top)

    def _text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self._decode(token_id)
        return self._texts[token_id]


def token_html(tokens: list[TokenInfo]) -> str:
    """The token view: one span per token, its background as dark as the token was unlikely."""
    spans = "".join(_span(token) for token in tokens)
    return f'{_STYLE}<div class="vllm-mlx-tokens">{spans}</div>'


def _span(token: TokenInfo) -> str:
    shade = 0.6 * (1.0 - token.prob)  # a sure token stays clear; an unlikely one turns red
    alts = "\n".join(
        f'<span class="{"vllm-mlx-alt-sampled" if _same(alt, token) else ""}">'
        f"{alt.prob:6.1%}  {escape(_visible(alt.text))}</span>"
        for alt in token.top
    )
    head = f"{token.prob:.1%} (logprob {token.logprob:.3f})"
    return (f'<span class="vllm-mlx-tok" style="background:rgba(229,57,53,{shade:.2f})">'
            f'{escape(token.text)}<span class="vllm-mlx-alts">{escape(head)}\n{alts}</span></span>')  # fmt: skip


def _visible(text: str) -> str:
    """Whitespace made visible in the alternatives list (a bare newline shows as nothing)."""
    return repr(text)[1:-1] if not text.strip() or "\n" in text else text


def tokens_bundle(gen) -> dict:
    """The body of a ``--logprobs`` generation: the token view, and the text as plain text."""
    tokens = gen.tokens
    if not tokens:  # before the first token, or no token log attached
        return {"text/html": f'<div class="vllm-mlx-tokens">{escape(gen.text)}</div>', "text/plain": gen.text}
    return {"text/html": token_html(tokens), "text/plain": gen.text}


def _same(alt: Alternative, token: TokenInfo) -> bool:
    """The alternative is the sampled token (by id; by text where ids are unknown, -1: remote)."""
    return alt.token_id == token.token_id and alt.text == token.text
