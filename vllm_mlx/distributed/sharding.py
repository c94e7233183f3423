"""Tensor parallelism's split of the model: every rank loads the whole model and keeps its slice
(``shard_model``: mlx-lm's ``model.shard(group)``, which splits attention heads, KV heads and the
MLP; the embedding and the head stay whole). Sharded layers end in an ``all_sum``, so every rank
computes the same hidden states and the same logits. Each rank's KV pool holds its own KV heads
for the same blocks, so rank 0's block tables are valid on every rank (``distributed/protocol.py``).
Pipeline parallelism's split into stages is ``distributed/pipeline.py``."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from vllm_mlx.distributed.group import TensorParallelError, check_same_model


def check_shardable(model, config: dict, world_size: int) -> None:
    """Raise ``TensorParallelError`` unless ``model`` can be split over ``world_size`` ranks:
    an architecture with mlx-lm's ``shard``, attention and KV heads that divide evenly (each
    rank keeps whole KV heads, and the query heads that share them)."""
    text = config.get("text_config", config)
    model_type = text.get("model_type", config.get("model_type", "?"))
    if not callable(getattr(model, "shard", None)):
        raise TensorParallelError(
            f"tensor parallelism needs an architecture that mlx-lm can shard; {model_type!r} has no shard()"
        )
    check_heads_divide(config, world_size)


def check_heads_divide(config: dict, world_size: int) -> None:
    """The part of ``check_shardable`` that needs only the config (``serve`` checks it before it
    starts any rank)."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    for name, count in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads)):
        if count is not None and count % world_size:
            raise TensorParallelError(
                f"tensor parallelism over {world_size} ranks needs heads that divide evenly: "
                f"the model has {count} {'KV' if name.startswith('num_key') else 'attention'} heads "
                f"({name}={count}), and {count} % {world_size} = {count % world_size}"
            )


def shard_model(model, config: dict, model_path: Path, group: mx.distributed.Group) -> None:
    """Check (collectively: every rank must call it), then keep this rank's shard in place."""
    from vllm_mlx.models.digest import model_digest

    check_same_model(group, model_digest(model_path), model_path)
    check_shardable(model, config, group.size())
    model.shard(group)
    mx.eval(model.parameters())
