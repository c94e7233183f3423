"""llama.cpp's byte-level BPE pre-tokenizers, by their ``tokenizer.ggml.pre`` names.

llama.cpp (``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``) splits text with a list of regexes
applied in turn: each regex cuts every piece left by the previous one into its matches and the
text between them (both kept). ``tokenizers``' ``Split(behavior="isolated")`` does exactly that,
so each entry below is that list, followed by the byte-level alphabet mapping.

The regexes are the models' own (their ``tokenizer.json``). Where llama.cpp spells one differently
for ``std::regex`` (the case-insensitive contractions of llama3/qwen2 as ``'[sS]|...``) the two are
equivalent; for tekken and gpt-4o llama.cpp approximates the letter classes with lookaheads that
differ on non-ASCII capitals after small letters, and the models' regexes are kept.

The flags are llama.cpp's for the same name: ``ignore_merges`` (a piece that is a whole vocabulary
token is emitted as is), the BOS default (the file's ``add_bos_token`` overrides it) and
``clean_spaces`` (``clean_up_tokenization_spaces``).
"""

from __future__ import annotations

from dataclasses import dataclass

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PUNCTUATION = r"[\p{P}\$\+<=>\^~\|]+"


@dataclass(frozen=True)
class BPEPreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes and the flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    clean_spaces: bool = True

    def build(self):
        """The ``tokenizers`` pre-tokenizer: each regex in turn, then the byte-level alphabet."""
        from tokenizers import Regex, pre_tokenizers

        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.regexes]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_GPT2 = BPEPreTokenizer((GPT2,))
_DIGITS_GPT2 = BPEPreTokenizer((r"\p{N}", GPT2))
_LLAMA3 = BPEPreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = BPEPreTokenizer((QWEN2,), clean_spaces=False)

PRE_TOKENIZERS: dict[str, BPEPreTokenizer] = {
    # Files converted before llama.cpp recorded a pre-tokenizer; llama.cpp's fallback list.
    "default": BPEPreTokenizer((PUNCTUATION, GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt2": _GPT2,  # not a name llama.cpp writes; kept for files written by hand as before
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "smollm": BPEPreTokenizer((r"\p{N}", GPT2), clean_spaces=False),
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,  # Granite 3.x
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "lfm2": _LLAMA3,
    "dbrx": BPEPreTokenizer((LLAMA3,)),
    "smaug-bpe": BPEPreTokenizer((LLAMA3,)),
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": BPEPreTokenizer((QWEN2,)),
    "stablelm2": BPEPreTokenizer((QWEN2,)),
    "qwen35": BPEPreTokenizer((QWEN35,), clean_spaces=False),  # Qwen3.5: combining marks stay with letters
    "tekken": BPEPreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True, clean_spaces=False),  # Mistral Nemo
    "gpt-4o": BPEPreTokenizer((GPT4O,), clean_spaces=False),  # Phi-4-mini
    "llama4": BPEPreTokenizer((GPT4O,), clean_spaces=False),
}
