"""A deliberately naive byte-level BPE tokenizer, written from the algorithm's definition.

It is the independent oracle for the ``tokenizers``-based tokenizer that our GGUF conversion
builds: same vocabulary and merges, a different implementation.
"""

from __future__ import annotations

import functools

import regex

# GPT-2's pre-tokenization pattern (contractions, letters, numbers, other, whitespace).
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@functools.cache
def byte_symbols() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode symbols."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def regex_split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's ``unicode_regex_split``: each pattern in turn cuts every piece into its matches
    and the text between them, both kept."""
    pieces = [text]
    for pattern in patterns:
        compiled = regex.compile(pattern)
        cut = []
        for piece in pieces:
            start = 0
            for match in compiled.finditer(piece):
                if match.start() > start:
                    cut.append(piece[start : match.start()])
                if match.end() > match.start():
                    cut.append(match.group())
                start = max(start, match.end())
            if start < len(piece):
                cut.append(piece[start:])
        pieces = cut
    return pieces


class ReferenceBPE:
    """``patterns``, when given, replaces the GPT-2 (``split_digits``) pre-tokenization with
    llama.cpp's list of regexes; ``ignore_merges`` emits a piece that is a whole token as is."""

    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        special: list[str],
        split_digits: bool = False,
        patterns: list[str] | None = None,
        ignore_merges: bool = False,
    ):
        self.ids = {token: i for i, token in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
        self.special = sorted(special, key=len, reverse=True)
        self.split_digits = split_digits
        self.patterns = patterns
        self.ignore_merges = ignore_merges

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, is_special in self._split_special(text):
            if is_special:
                ids.append(self.ids[piece])
                continue
            for word in self._pre_tokenize(piece):
                symbols = "".join(byte_symbols()[b] for b in word.encode("utf-8"))
                if self.ignore_merges and symbols in self.ids:
                    ids.append(self.ids[symbols])
                    continue
                ids.extend(self.ids[part] for part in self._bpe(symbols))
        return ids

    def _split_special(self, text: str):
        start = i = 0
        while i < len(text):
            match = next((s for s in self.special if text.startswith(s, i)), None)
            if match:
                if start < i:
                    yield text[start:i], False
                yield match, True
                i += len(match)
                start = i
            else:
                i += 1
        if start < len(text):
            yield text[start:], False

    def _pre_tokenize(self, text: str) -> list[str]:
        if self.patterns is not None:
            return regex_split(text, self.patterns)
        chunks = regex.findall(r"\p{N}|\P{N}+", text) if self.split_digits else [text]
        return [word for chunk in chunks for word in GPT2_PATTERN.findall(chunk)]

    def _bpe(self, symbols: str) -> list[str]:
        parts = list(symbols)
        while len(parts) > 1:
            pairs = [(self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts
