"""A lower bound on a text's token count from its length alone: a prompt that cannot fit the
context is refused before it is tokenized (tokenizing megabytes takes seconds of a worker).

Every token of the vocabulary stands for at most ``max_token_chars`` characters of the text it
came from, if the tokenizer never drops text on the way (see ``token_bound``). For a byte-level
BPE (GPT-2, Llama 3, Qwen, SmolLM) a token's string has one character per byte, and a text has
at least as many bytes as characters; for a SentencePiece BPE (``▁`` for a space, ``<0x41>``
byte fallbacks) a token's string is at least as long as the text it covers. Added tokens
(``<|im_start|>``) are in the vocabulary as their text. So a text of ``n`` characters is at least
``ceil(n / max_token_chars)`` tokens. A BPE without ``<unk>`` or byte fallback drops the characters
its vocabulary lacks: a byte-level one may lack some bytes (SmolLM2's has no token for 21 of the
256, six of them ASCII control characters, which vanish from a text), so those characters are
not counted (``dropped``). A tokenizer that can drop or merge text otherwise (a normalizer that
strips or composes, a pre-tokenizer that removes whitespace, an added token that swallows the
whitespace beside it, WordPiece's or a fused ``<unk>`` for a whole unknown word, a vocabulary
without some character and nothing to stand for it) has no such bound: its prompts are tokenized
whatever their length.

Pure Python: read once at startup from the Hugging Face tokenizer's own description.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# Normalizers and pre-tokenizers that never remove a character of the text (a Replace must
# put something back; Split and Punctuation must keep what they split on).
_KEEPING_NORMALIZERS = {"Prepend", "Replace", "Sequence"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "Sequence"}


@dataclass(frozen=True)
class TokenBound:
    """At most ``max_token_chars`` characters per token, not counting the ``dropped`` ones, which
    the tokenizer removes; None: no bound is known."""

    max_token_chars: int | None = None
    dropped: frozenset[str] = frozenset()

    def min_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can become (0 without a bound)."""
        if self.max_token_chars is None:
            return 0
        kept = len(text) - sum(text.count(character) for character in self.dropped)
        return math.ceil(kept / self.max_token_chars)


def token_bound(tokenizer: object) -> TokenBound:
    """The bound of ``tokenizer`` (a transformers fast tokenizer, or mlx-lm's wrapper of one);
    ``TokenBound()`` (none) for any other kind, or one that can drop text."""
    hf = tokenizer if hasattr(tokenizer, "backend_tokenizer") else getattr(tokenizer, "_tokenizer", None)
    backend = getattr(hf, "backend_tokenizer", None)  # mlx-lm's TokenizerWrapper holds it in _tokenizer
    if backend is None or not hasattr(hf, "get_vocab"):
        return TokenBound()
    try:
        description = json.loads(backend.to_str())
        vocab = hf.get_vocab()
    except Exception:  # a tokenizer that cannot describe itself has no bound we can trust
        return TokenBound()
    dropped = _dropped_characters(description, vocab)
    if not (_keeps_text(description) and vocab) or dropped is None:
        return TokenBound()
    return TokenBound(max(len(token) for token in vocab), dropped)


def _dropped_characters(description: dict, vocab: dict) -> frozenset[str] | None:
    """The characters the BPE model removes from a text: with no ``<unk>`` and no byte fallback,
    those its vocabulary lacks. Listed for a byte-level BPE, whose alphabet is the 256 bytes: the
    one-byte characters whose byte has no token (every other character keeps a byte, unless a
    continuation byte has no token either: then None, no bound); None for another BPE that lacks
    characters (any character of Unicode may be one)."""
    model = description.get("model") or {}
    if model.get("byte_fallback") or model.get("unk_token") in vocab:
        return frozenset()
    if not _byte_level(description.get("pre_tokenizer")):
        return None
    byte_char = _byte_level_characters()
    if any(byte_char[b] not in vocab for b in range(0x80, 0xC0)):
        return None
    return frozenset(chr(b) for b in range(0x80) if byte_char[b] not in vocab)


def _byte_level(component: dict | None) -> bool:
    if component is None:
        return False
    if component.get("type") == "Sequence":
        return any(_byte_level(c) for c in component.get("pretokenizers") or [])
    return component.get("type") == "ByteLevel"


def _byte_level_characters() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character standing for each byte (printable Latin-1
    bytes for themselves, the others shifted past 255, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def _keeps_text(description: dict) -> bool:
    """Every character of a text reaches some token: nothing is stripped or merged into one."""
    if any(t.get("lstrip") or t.get("rstrip") for t in description.get("added_tokens") or []):
        return False  # such a token swallows the whitespace beside it, however long
    model = description.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return False
    return _only(description.get("normalizer"), _KEEPING_NORMALIZERS, "normalizers") and _only(
        description.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS, "pretokenizers"
    )


def _only(component: dict | None, allowed: set[str], children: str) -> bool:
    """``component`` (a normalizer or pre-tokenizer, maybe a Sequence) uses only ``allowed`` kinds
    in ways that keep every character."""
    if component is None:
        return True
    kind = component.get("type")
    if kind not in allowed:
        return False
    if kind == "Sequence":
        return all(_only(c, allowed, children) for c in component.get(children) or [])
    if kind == "Replace" and not component.get("content"):
        return False
    if kind in ("Split", "Punctuation") and str(component.get("behavior", "")).lower() == "removed":
        return False
    return True
