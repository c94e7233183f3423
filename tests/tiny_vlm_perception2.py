"""Tiny random-weight models of families that keep per-request state on the model between calls,
which the engine holds beside the request's own caches (``VisionLanguageModel.request_state``).

* :func:`build_tiny_falcon_perception`: Falcon Perception: Falcon OCR's layout, positions and mask
  (tests/tiny_vlm_falcon.py), with coordinate and size heads. After every call its text model
  decodes a coordinate and a size from the last hidden state; a decode step whose token is
  ``<|coord|>`` (``<|size|>``) gets them encoded as its embedding, and ``<|seg|>`` closes a
  detection, whose coordinate later steps skip. The tiny tokenizer has the three tokens and the
  head favours them, so greedy generation feeds coordinates and sizes back within a few tokens.
  Its processor places the image itself (the text is the query) and resizes every image to 256 px
  a side at least: 128 px patches keep an image 4-12 tokens.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm_falcon import _build_falcon

PERCEPTION_HEADS = {"coord_enc_dim": 16, "coord_dec_dim": 32, "coord_out_dim": 16, "size_enc_dim": 16,
                    "size_dec_dim": 32, "size_out_dim": 16, "do_segmentation": False}  # fmt: skip
PERCEPTION_TOKENS = {"coord_token_id": "<|coord|>", "size_token_id": "<|size|>", "seg_token_id": "<|seg|>"}
"""The special tokens its decode steps act on, by the config key naming each one's id."""
PERCEPTION_PATCH = 128
"""Pixels a side of a patch: its processor resizes every image to 256 px a side at least (a constant of
its code, where Falcon OCR's takes 64), so 128 px patches keep an image 4-12 tokens, as Falcon OCR's 32."""
FEEDBACK_BIAS = 3.0
"""Added to the three tokens' head rows (scaled random weights): enough that greedy tokens take them
often, not so much that they take nothing else."""


def build_tiny_falcon_perception(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Falcon Perception directory (module doc)."""
    return _build_falcon(
        out_dir, "falcon_perception", PERCEPTION_HEADS, seed, PERCEPTION_TOKENS, _favour_feedback, PERCEPTION_PATCH
    )


def _favour_feedback(model, ids: dict[str, int]) -> None:
    """Make the coordinate, size and segmentation tokens likely: their head rows point along the
    mean hidden direction the final norm leaves (its weight), scaled by ``FEEDBACK_BIAS``."""
    import mlx.core as mx

    head = model.language_model.lm_head.weight
    direction = model.language_model.model.norm.weight
    rows = mx.array([ids[token] for token in PERCEPTION_TOKENS.values()])
    head[rows] = head[rows] + FEEDBACK_BIAS * direction / mx.linalg.norm(direction)
    model.language_model.lm_head.weight = head
