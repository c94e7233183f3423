"""Pipeline parallelism: each rank holds a contiguous range of the model's layers (mlx-lm's
``pipeline()``), and every rank still runs the same batch through the same engine protocol as
tensor parallelism (``distributed/protocol.py``: rank 0 the engine, the others ``worker_loop``).

mlx-lm splits the layers in reverse (rank 0 holds the *last* layers, rank N - 1 the first and
the embedding's work) and its ``__call__`` does, per forward: ``recv_like`` the hidden states
from rank + 1, run the local layers, ``send`` them to rank - 1, then ``all_gather`` them so every
rank ends with rank 0's final hidden states, hence the same logits and the same samples. So the
step protocol, the sampling and the watchdog are those of tensor parallelism, unchanged.

After the split the model's ``layers`` and ``make_cache()`` are the local layers only, so each
rank's layer specs, KV pool, state pool and block groups are measured on its own layers. Rank 0
schedules for every rank: its block tables and state slots must mean the same thing on each, so
every rank's layers must form the same layer groups (same kinds, in the same order) as rank 0's
(``check_stages_alike``). The split is a pure function of the layer count and the rank count
(``layer_split``, mlx-lm's own rule), so every rank checks every other rank's range without
communicating, and all ranks refuse alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from vllm_mlx.core.kv.spec import LayerSpec, group_layers
from vllm_mlx.distributed.group import TensorParallelError, check_same_model


class PipelineParallelError(TensorParallelError):
    """The model cannot be split into pipeline stages over the ranks."""


@dataclass(frozen=True)
class StageRange:
    """The layers ``start <= i < stop`` that one rank holds."""

    rank: int
    start: int
    stop: int

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


def layer_split(num_layers: int, world_size: int) -> list[StageRange]:
    """Each rank's layers under mlx-lm's ``PipelineMixin.pipeline(group)`` default: an even
    split, the low ranks taking the extra layers, rank r after ranks r + 1 .. N - 1."""
    base, extra = divmod(num_layers, world_size)
    counts = [base + (1 if r < extra else 0) for r in range(world_size)]
    ranges = []
    for rank in range(world_size):
        start = sum(counts[rank + 1 :])
        ranges.append(StageRange(rank, start, start + counts[rank]))
    return ranges


def pipeline_stage(model):
    """The module whose ``pipeline(group)`` splits ``model``'s layers (mlx-lm keeps it in
    ``model.model``; Qwen3.5's wrapper in ``model.language_model.model``), or None."""
    for path in (("model",), ("language_model", "model")):
        module = model
        for name in path:
            module = getattr(module, name, None)
        if callable(getattr(module, "pipeline", None)):
            return module
    return None


def check_pipelinable(model, config: dict, specs: list[LayerSpec], world_size: int) -> None:
    """Raise ``PipelineParallelError`` unless ``model`` (its whole-model ``specs``) can be split
    into ``world_size`` stages: an architecture with mlx-lm's ``pipeline()``, at least one layer
    per rank, and stages whose layer groups agree (``check_stages_alike``)."""
    text = config.get("text_config", config)
    model_type = text.get("model_type", config.get("model_type", "?"))
    stage = pipeline_stage(model)
    if stage is None:
        raise PipelineParallelError(
            f"pipeline parallelism needs an architecture that mlx-lm can split into stages; "
            f"{model_type!r} has no pipeline() (use tensor parallelism, or an architecture such as qwen3_5)"
        )
    num_layers = len(stage.layers)
    if num_layers < world_size:
        raise PipelineParallelError(
            f"pipeline parallelism over {world_size} ranks needs at least one layer per rank; "
            f"{model_type!r} has {num_layers} layers"
        )
    if len(specs) == num_layers:  # one cache per layer: specs index layers (else nothing to compare)
        check_stages_alike(specs, layer_split(num_layers, world_size))


def check_stages_alike(specs: list[LayerSpec], split: list[StageRange]) -> None:
    """Every stage's layers form the same layer groups, in the same order, as rank 0's: rank 0's
    scheduler hands out one block table per group and a state slot when it has recurrent layers,
    and every rank must read them the same way."""

    def kinds(stage: StageRange) -> list[LayerSpec]:
        return [group.spec for group in group_layers(specs[stage.start : stage.stop])]

    first = kinds(split[0])
    for stage in split[1:]:
        if kinds(stage) != first:
            raise PipelineParallelError(
                f"pipeline parallelism over {len(split)} ranks: rank {stage.rank}'s layers "
                f"{stage.start}..{stage.stop - 1} need caches {_names(kinds(stage))}, rank 0's layers "
                f"{split[0].start}..{split[0].stop - 1} {_names(first)}; rank 0 schedules for every rank, "
                "so every stage needs the same kinds of layers in the same order"
            )


def _names(kinds: list[LayerSpec]) -> str:
    return "[" + ", ".join(type(k).__name__ for k in kinds) + "]"


def pipeline_model(model, config: dict, specs: list[LayerSpec], model_path, group: mx.distributed.Group) -> None:
    """Check (collectively: every rank must call it), then keep this rank's stage in place; the
    other ranks' layers are dropped (``None``) and their weights freed."""
    from vllm_mlx.models.digest import model_digest

    check_same_model(group, model_digest(model_path), model_path)
    check_pipelinable(model, config, specs, group.size())
    pipeline_stage(model).pipeline(group)
    mx.eval(model.parameters())
