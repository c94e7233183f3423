"""A request's images: where they sit in the prompt, what identifies them, how positions run.

A multimodal prompt is token ids in which every image occupies a run of placeholder tokens (the
model's image token, repeated once per vision feature; for some families with marker tokens
between rows or tiles). The placeholders themselves are the same ids for every image, so three
things cannot come from the token ids alone and live here:

* **Identity.** Each image carries the content hash of its decoded pixels and the processor's
  settings. The hashes of the images overlapping a KV block go into that block's prefix-cache
  extra keys; with the chained block hashes, every block from an image onwards is shared only
  by requests with the same images in the same order.
* **Features.** The runner replaces the placeholders' embeddings by the vision encoder's output,
  fetched from the MLLM cache or computed once per request prefill.
* **Positions.** Qwen2-VL style models rotate with three position axes (time, height, width):
  an image's features get 2-D grid positions and the text after it continues from the largest
  one. ``MultiModalInput.positions`` precomputes them for the prompt; a generated token at index
  ``i`` sits at ``i + rope_delta`` on every axis.

Plain data plus numpy: no MLX arrays are made here (``features`` is filled by the runner, on the
engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ImageInput", "MultiModalInput", "mrope_positions"]


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt, processed and placed."""

    image_hash: str
    """Content hash of the decoded pixels and processor settings (``images.image_content_hash``)."""
    image: Any
    """The decoded RGB ``PIL.Image`` (thumbnails for the cache inspector)."""
    pixel_values: np.ndarray
    """The image processor's output for this image alone."""
    offset: int
    """Index of the image's first placeholder token in the prompt."""
    num_tokens: int
    """Placeholder tokens (= vision features) the image occupies."""
    grid: tuple[int, int, int] | None = None
    """(t, h, w) in patches, for encoders that need the grid (Qwen2-VL)."""
    token_ids: list[int] | None = None
    """The ids of the image's ``num_tokens`` prompt tokens, for families whose image block is
    not one id repeated (SmolVLM: tiles framed by marker tokens); None: ``num_tokens`` copies
    of the model's image token."""
    encoder_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """Further preprocessor outputs the encoder needs (SmolVLM's ``pixel_attention_mask``)."""
    features: Any = None
    """The encoder output (``[num_tokens, hidden]``) while the request is prefilling."""

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(eq=False)
class MultiModalInput:
    """The images of one prompt, in prompt order, and the prompt's rotary positions."""

    images: list[ImageInput] = field(default_factory=list)
    positions: np.ndarray | None = None
    """``[3, num_prompt_tokens]`` multi-axis positions, or None for 1-D rotary models."""
    rope_delta: int = 0
    """Position of token ``i`` past the prompt is ``i + rope_delta`` (on every axis)."""
    both_ways: list[tuple[int, int]] = field(default_factory=list)
    """Spans ``[start, end)`` of prompt positions whose tokens attend to each other both ways
    (``use_bidirectional_attention``: an image's soft tokens in Gemma 4, PaliGemma's whole prompt):
    a query in a span also sees the keys up to its end. Invariants the engine keeps: a prefill
    chunk never ends inside a span (``whole_spans``), and a prefix-cache hit never ends inside one
    (``resumable_blocks``: the whole span is recomputed); a span is an image's run or starts at 0 (a
    prefix LM's whole prompt: ``VisionLanguageModel.text_only_input``), and the blocks it overlaps carry
    it in their hashes (``block_extra_keys``), so a block hit before a span was computed causally."""

    def block_extra_keys(self, block_index: int, block_size: int) -> tuple:
        """Hashes, in order, of the images whose placeholders overlap block ``block_index``, then the
        both-ways spans that overlap it (so a block is shared only by prompts whose spans are the same)."""
        start, end = block_index * block_size, (block_index + 1) * block_size
        images = tuple(im.image_hash for im in self.images if im.offset < end and im.end > start)
        # The spans too: a block's KV depends on where its span ends (a whole-prompt span's end is the
        # prompt's length, which no token of the block says), and a hit past a span takes its blocks.
        return images + tuple(("both_ways", s, e) for s, e in self.spans_in(start, block_size))

    def position_ids(self, start: int, count: int) -> np.ndarray:
        """``[axes, count]`` positions of tokens ``start .. start + count - 1`` (``axes``: the prompt's,
        3 for Qwen2-VL's layout, 4 for Hunyuan-VL's; past the prompt every axis is the same)."""
        index = np.arange(start, start + count, dtype=np.int64)
        axes = self.positions.shape[0] if self.positions is not None else 3
        out = np.broadcast_to(index + self.rope_delta, (axes, count)).copy()
        if self.positions is not None:
            in_prompt = index < self.positions.shape[1]
            out[:, in_prompt] = self.positions[:, index[in_prompt]]
        return out

    def overlaps(self, start: int, count: int) -> list[tuple[ImageInput, int, int]]:
        """``(image, lo, hi)`` for each image with placeholders in tokens ``[start, start + count)``:
        prompt indices ``lo .. hi - 1`` hold that image's features ``lo - offset .. hi - offset - 1``."""
        end = start + count
        found = []
        for image in self.images:
            lo, hi = max(start, image.offset), min(end, image.end)
            if lo < hi:
                found.append((image, lo, hi))
        return found

    def split_span(self, position: int) -> tuple[int, int] | None:
        """The both-ways span that ``position`` cuts in two (start < position < end), if any."""
        return next(((s, e) for s, e in self.both_ways if s < position < e), None)

    def whole_spans(self, start: int, count: int) -> int:
        """``count`` tokens from ``start``, moved so the chunk does not end inside a both-ways
        span: back to the span's start where the chunk holds tokens before it, else on to its
        end (past the step's budget: the span's queries must see all its keys in one call)."""
        span = self.split_span(start + count)
        if span is None:
            return count
        return span[0] - start if span[0] > start else span[1] - start

    def resumable_blocks(self, num_blocks: int, block_size: int) -> int:
        """The most of ``num_blocks`` leading cached blocks a hit may take: none may end inside a
        both-ways span (its queries would need keys the hit's end cuts off; the span is recomputed)."""
        while num_blocks and self.split_span(num_blocks * block_size) is not None:
            num_blocks -= 1
        return num_blocks

    def spans_in(self, start: int, count: int) -> list[tuple[int, int]]:
        """The both-ways spans that overlap tokens ``[start, start + count)``."""
        return [(s, e) for s, e in self.both_ways if s < start + count and e > start]

    def done_with_images(self, num_computed: int) -> bool:
        """True once every placeholder is in the KV cache: no image feature is needed again
        unless the request is preempted and recomputed."""
        return all(image.end <= num_computed for image in self.images)


def mrope_positions(
    num_tokens: int, images: list[ImageInput], spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """``(positions [3, num_tokens], rope_delta)`` for Qwen2-VL style multi-axis rotary.

    Text tokens advance all three axes together. An image's placeholders form its merged patch
    grid (t, h/m, w/m) laid out row-major: each gets (t_i, h_i, w_i) plus the position where the
    image starts. The text after an image resumes one past the largest position used so far.
    """
    positions = np.zeros((3, num_tokens), dtype=np.int64)
    next_pos = 0
    cursor = 0
    for image in sorted(images, key=lambda im: im.offset):
        text = image.offset - cursor
        positions[:, cursor : image.offset] = next_pos + np.arange(text)
        next_pos += text
        t, h, w = image.grid
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != image.num_tokens:
            raise ValueError(f"image grid {image.grid} gives {t * h * w} features, not {image.num_tokens}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        positions[:, image.offset : image.end] = next_pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        next_pos += max(t, h, w)
        cursor = image.end
    positions[:, cursor:] = next_pos + np.arange(num_tokens - cursor)
    last = int(positions.max()) if num_tokens else -1
    return positions, last + 1 - num_tokens
