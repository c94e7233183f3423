"""Tiny models whose text repeats: speculative decoding's tests need text that repeats, so that
n-gram lookup proposes tokens that are sometimes right and sometimes wrong."""

from __future__ import annotations

from tiny_model import TINY_GEMMA3, TINY_NEMOTRON_H, TINY_QWEN3_5

LIKELY = range(2000, 2012)  # " temper", " enough", "ales", " likely", ...: real text, repeating
"""The token ids that keep full-size embedding and output rows (``build_tiny_llama``)."""
ARCHS = {"llama": {}, "gemma3_text": TINY_GEMMA3, "qwen3_5": TINY_QWEN3_5, "nemotron_h": TINY_NEMOTRON_H}
"""The architectures built: full attention, sliding windows, recurrent layers padded or not."""
