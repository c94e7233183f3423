"""The cost model of the step protocol (``docs/distributed.md``): the collectives one
tensor-parallel step issues and the bytes each rank hands them, which a link's latency and
bandwidth turn into a time. ``tests/distributed/test_distributed_costs.py`` checks it against the
collectives the engine really issues; ``bench/distributed.py`` measures the links."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTraffic:
    """The collectives one tensor-parallel step issues and the bytes each rank hands them
    (``docs/distributed.md``): what a link's latency and bandwidth turn into a time."""

    collectives: int
    nbytes: int

    def wire_bytes(self, world_size: int) -> float:
        """Bytes a rank sends in a ring all-reduce: 2 (N - 1) / N of its input (reduce-scatter,
        then all-gather)."""
        return self.nbytes * 2 * (world_size - 1) / world_size

    def seconds(self, latency_s: float, bandwidth_bytes_s: float) -> float:
        """Predicted communication time: latency per collective plus bytes over the bandwidth
        (an all_sum's measured rate already folds the ring's 2 (N - 1) / N in)."""
        return self.collectives * latency_s + self.nbytes / bandwidth_bytes_s


def step_traffic(
    config: dict, num_tokens: int, message_bytes: int, dtype_bytes: int = 4, forward_calls: int = 1
) -> StepTraffic:
    """What one step of ``num_tokens`` tokens (B for a decode step of B requests) exchanges on a
    dense model sharded by mlx-lm's ``shard``: per layer, ``o_proj`` and ``down_proj`` end in an
    ``all_sum`` of a [tokens, hidden] activation (``dtype_bytes``: 4 for float32, 2 for bfloat16);
    before it, rank 0's ``StepMessage`` (``message_bytes`` long) costs two: an int32 length and
    the payload of uint8s (``broadcast_bytes``). Independent of the rank count: every rank
    hands each collective the whole activation.

    A step whose rows the runner splits into several padded forward calls
    (``group_for_padding``: a prefill step of prompts of different lengths) pays the layers'
    collectives once per call: pass ``forward_calls``, and as ``num_tokens`` the tokens of every
    call, padding included (rows x the call's longest row). A decode step is one call of B."""
    text = config.get("text_config", config)
    per_layer = 2  # attention's output projection and the MLP's down projection
    activations = per_layer * text["num_hidden_layers"]
    activation_bytes = activations * num_tokens * text["hidden_size"] * dtype_bytes
    return StepTraffic(forward_calls * activations + 2, activation_bytes + 4 + message_bytes)
