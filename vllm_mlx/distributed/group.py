"""The group of ranks (``init_group``) and what every rank must agree on at start-up, checked
collectively (every rank calls each check, in the same order, and all raise alike): the same model
(``check_same_model``), the same way of splitting it (``check_same_mode``), and one KV pool sizing
from the ranks' combined memory needs (``combine_memory_needs``), and one weight format
(``most_of``: the smallest format any rank's memory allows)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_mlx.core.kv.sizing import MemoryNeeds
from vllm_mlx.distributed.ring_formation import form_group


class TensorParallelError(ValueError):
    """The model cannot be split over the ranks (or the ranks disagree about it)."""


def init_group(strict: bool = True) -> mx.distributed.Group:
    """The world group (``mlx.launch`` or ``rank_supervisor`` sets up the backend's environment),
    formed and checked by ``ring_formation.form_group``: retried when the ring fails to form, and
    every member holding this launch's nonce (``RingFormationError`` otherwise)."""
    try:
        group = form_group(strict=strict)
    except RuntimeError as exc:
        raise TensorParallelError(
            f"tensor parallelism found no distributed backend ({exc}); launch the ranks with "
            "mlx.launch -n 2 --backend ring (rank 0: the engine, the others: worker_loop)"
        ) from None
    if group.size() < 2:
        raise TensorParallelError("tensor parallelism needs at least 2 ranks (launch with mlx.launch -n 2)")
    return group


def check_same_model(group: mx.distributed.Group, digest: str, path: Path | str = "") -> None:
    """Every rank loaded the same model (``model_digest``s agree); else every rank raises,
    naming the ranks whose model differs from rank 0's."""
    mine = mx.array(np.frombuffer(bytes.fromhex(digest), np.uint8).astype(np.int32))
    gathered = np.array(mx.distributed.all_gather(mine, group=group)).reshape(group.size(), -1)
    differ = [rank for rank in range(group.size()) if not (gathered[rank] == gathered[0]).all()]
    if differ:
        raise TensorParallelError(
            f"the ranks loaded different models: rank(s) {', '.join(map(str, differ))} differ from rank 0 "
            f"(config, tokenizer, weight-file names, sizes, safetensors headers or sampled bytes: "
            f"vllm_mlx.models.digest); rank {group.rank()} loaded {path}"
        )


SPLIT_MODES = ("tensor", "pipeline")


def check_same_mode(group: mx.distributed.Group, mode: str) -> None:
    """Every rank splits the model the same way (``SPLIT_MODES``): a rank that shards while
    another splits into stages would issue different collectives and hang. Else every rank
    raises, naming what each rank asked for."""
    mine = mx.array([SPLIT_MODES.index(mode)], dtype=mx.int32)
    modes = [SPLIT_MODES[i] for i in np.array(mx.distributed.all_gather(mine, group=group)).tolist()]
    if len(set(modes)) > 1:
        raise TensorParallelError(
            "the ranks disagree on how to split the model: "
            + ", ".join(f"rank {rank} {m} parallelism" for rank, m in enumerate(modes))
        )


def most_of(group: mx.distributed.Group, mine: int) -> int:
    """The largest of every rank's ``mine`` (collectively: every rank must call it)."""
    gathered = mx.distributed.all_gather(mx.array([mine], dtype=mx.int64), group=group)
    return int(np.array(gathered).max())


def combine_memory_needs(group: mx.distributed.Group, mine: MemoryNeeds) -> MemoryNeeds:
    """Every rank's ``MemoryNeeds`` combined (collectively: every rank must call it): the most
    any rank needs per KV token and per request state, the least memory any rank has."""
    fields = (mine.kv_bytes_per_token, mine.state_bytes_per_request, mine.available_bytes)
    gathered = mx.distributed.all_gather(mx.array([fields], dtype=mx.int64), group=group)
    rows = np.array(gathered).reshape(group.size(), len(fields))
    return MemoryNeeds(int(rows[:, 0].max()), int(rows[:, 1].max()), int(rows[:, 2].min()))
