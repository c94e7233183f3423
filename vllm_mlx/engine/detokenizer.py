"""Incremental detokenization with stop strings, one instance per request.

``IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=..., stop=...)`` turns the
token ids a request generates into streamed text. ``add_tokens(ids)`` returns the newly visible
text (possibly ``""``); ``finish()`` flushes what was held back when the request ends without a
stop string match. ``tokenizer`` is anything with ``decode(ids, skip_special_tokens=...)``: mlx-lm's
``TokenizerWrapper`` or a transformers tokenizer.

Invariants:

* ``text`` is the concatenation of everything ``add_tokens``/``finish`` returned, and always a
  prefix of the full decoded output (``decode(output_ids)``) cut right before the first stop string
  match, if any. After ``finish()`` without a match it equals the full decoded output.
* ``text`` never ends with a ``'\\ufffd'`` of a multi-byte character split across byte-level
  tokens while more tokens may complete it: decoded text ending with ``'\\ufffd'`` is held back.
  Only ``finish()``, or a run of ``MAX_PENDING`` ids in which no prefix decodes to complete text,
  emits one as is, since then it is what the model produced.
* ``text`` never ends with a partial stop string: the longest suffix that is a prefix of some
  stop string is held back until it either completes the stop string (then it is dropped with
  everything after it and ``stop_string`` is set) or turns out not to. Of several stop strings,
  the one whose match is complete first in the text wins, however the tokens were grouped.
* Each call decodes a bounded window of ids, and stop strings are matched by an automaton fed
  each new character once (``stop_strings.py``), so the cost per token grows neither with the
  output length nor with the length or number of stop strings (amortized over the stream).

Decoding follows vLLM's scheme: ``decode(window)`` minus ``decode(window[:read])`` is the new text.
The window starts with the last few prompt tokens so the first output token is decoded in context
(a leading space survives); whenever it yields complete text, the ids before ``read`` are dropped
and ``read`` moves to the end, so the ids just emitted become the context of the next ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_mlx.engine.stop_strings import StopScanner

__all__ = ["IncrementalDetokenizer"]

PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the first output token
MAX_PENDING = 16  # pending ids after which complete text is looked for id by id
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams one request's output text; see the module docstring for the invariants."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self._pieces: list[str] = []  # the visible text, joined on demand by ``text``
        self.stop_string: str | None = None
        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT:]]
        self._ids = context  # the decode window; ids[:read] are emitted text or prompt context
        self._read = len(context)
        self._scanner = StopScanner(self.stop) if self.stop else None  # holds back partial stops
        self._finished = False

    @property
    def text(self) -> str:
        """The visible text so far: everything ``add_tokens``/``finish`` returned."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def done(self) -> bool:
        """True after a stop string matched or ``finish()`` was called."""
        return self._finished or self.stop_string is not None

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that became visible (may be ``""``)."""
        if self.done or not len(token_ids):
            return ""
        stalled = len(self._ids) - self._read >= MAX_PENDING
        self._ids.extend(int(t) for t in token_ids)
        return self._emit(self._decode_new(stalled=stalled))

    def finish(self) -> str:
        """End the request: return the held-back text, a trailing ``'\\ufffd'`` included."""
        if self.done:
            return ""
        out = self._emit(self._decode_new(final=True))
        if self._scanner is not None and self.stop_string is None:
            held = self._scanner.flush()
            out += held
            self._pieces.append(held)
        self._finished = True
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, *, stalled: bool = False, final: bool = False) -> str:
        """The text of the ids not yet emitted, up to where it is complete; "" while it is not."""
        if self._read == len(self._ids):
            return ""
        seen = self._decode(self._ids[: self._read])
        end = len(self._ids)
        text = self._decode(self._ids)
        while not final and (len(text) <= len(seen) or text.endswith(_REPLACEMENT)):
            if not stalled:
                return ""  # wait: more tokens may complete the character
            end -= 1  # stalled: fall back to the last id where the text was complete
            if end == self._read:  # there is none: emit the text as it is
                end, text = len(self._ids), self._decode(self._ids)
                break
            text = self._decode(self._ids[:end])
        # Slide the window: the ids just emitted become the next call's context.
        del self._ids[: self._read]
        self._read = end - self._read
        return text[len(seen) :]

    def _emit(self, new: str) -> str:
        """Apply the stop strings to ``new`` text; return the part that becomes visible."""
        if self._scanner is not None:
            new = self._scanner.feed(new)
            self.stop_string = self._scanner.stop_string
        self._pieces.append(new)
        return new
