"""A rank > 0's side of the step protocol (``distributed/protocol.py``): ``Worker`` receives rank 0's
``StepMessage``s, rebuilds each step's ``ScheduledRequest``s on shadow ``Request``s and runs its
own runner on the same batch (``engine/rank_worker.py``'s ``worker_loop`` prepares the model and
builds it). It samples as rank 0 does and compares its tokens with rank 0's
(``WorkerStats.mismatches``); no state of its own depends on its samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.distributed.protocol import StepMessage, StepRow, receive_message, row_tables
from vllm_mlx.distributed.watchdog import RankLostError, is_collective_failure

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """What a worker ran; ``mismatches``: sampled tokens that differed from rank 0's;
    ``kv_layers`` / ``state_layers``: the KV pool arrays this rank wrote and the layers its state
    pool holds (a pipeline stage: its own layers only)."""

    steps: int = 0
    probes: int = 0
    pings: int = 0
    compared: int = 0
    mismatches: int = 0
    errors: int = 0
    kv_layers: int = 0
    state_layers: int = 0


class Worker:
    """A rank > 0: a runner over its shard, fed by rank 0's messages."""

    def __init__(self, runner, group: mx.distributed.Group) -> None:
        self.runner = runner
        self.group = group
        self.requests: dict[str, Request] = {}
        self.sampled: dict[str, tuple[int, int]] = {}  # id -> (output index, token) this rank drew
        self.unchecked: set[str] = set()  # constrained requests (see NewRequest.constrained)
        self.tables: dict[str, list[list[int]]] = {}  # id -> block tables as of its last row (StepRow)
        self.stats = WorkerStats()

    def run(self) -> WorkerStats:
        """Serve messages until "stop"."""
        while True:
            message = receive_message(self.group)
            if message.kind == "stop":
                self.stats.kv_layers, self.stats.state_layers = held_layers(self.runner)
                return self.stats
            if message.kind == "ping":
                self.stats.pings += 1
            elif message.kind == "probe":
                self.stats.probes += 1
                self._guarded(self.runner.probe)
            elif message.kind == "step":
                self._step(message)

    def _step(self, message: StepMessage) -> None:
        for rid in message.finished:
            self.requests.pop(rid, None)
            self.sampled.pop(rid, None)
            self.unchecked.discard(rid)
            self.tables.pop(rid, None)
        for new in message.new_requests:
            params = SamplingParams(**new.sampling)
            self.requests[new.request_id] = Request(
                new.request_id, new.prompt_token_ids, params, eos_token_ids=frozenset(new.eos_token_ids)
            )
            if new.constrained:
                self.unchecked.add(new.request_id)
        scheduled = [self._scheduled(row) for row in message.rows]
        output = self._guarded(self.runner.execute_model, SchedulerOutput(message.step_id, scheduled))
        self.stats.steps += 1
        for rid, token in (output.sampled_token_ids.items() if output is not None else ()):
            if rid not in self.unchecked:  # after the proposals it kept, when it verified some
                verdict = output.drafts.get(rid)
                kept = verdict.num_accepted if verdict is not None else 0
                self.sampled[rid] = (self.requests[rid].num_output_tokens + kept, token)

    def _scheduled(self, row: StepRow) -> ScheduledRequest:
        request = self.requests[row.request_id]
        self._compare(request, row.new_output_token_ids)
        request.output_token_ids.extend(row.new_output_token_ids)
        request.num_computed_tokens = row.num_computed_tokens
        tables = self.tables[row.request_id] = row_tables(row, self.tables.get(row.request_id))
        return ScheduledRequest(
            request, row.num_computed_tokens, row.num_new_tokens, tables[0], row.state_slot,
            row.state_read_slot, row.checkpoint_slot, tables if row.block_tables is not None else None,
            list(row.spec_token_ids),
        )  # fmt: skip

    def _compare(self, request: Request, new_tokens: list[int]) -> None:
        """Check this rank's last sample against rank 0's token at the same output index."""
        drawn = self.sampled.pop(request.request_id, None)
        if drawn is None:
            return
        index, token = drawn
        offset = index - request.num_output_tokens
        if 0 <= offset < len(new_tokens):
            self.stats.compared += 1
            if new_tokens[offset] != token:
                self.stats.mismatches += 1
                logger.warning("rank %d sampled %d for %s, rank 0 %d", self.group.rank(), token,
                               request.request_id, new_tokens[offset])  # fmt: skip

    def _guarded(self, call, *args):
        """Run ``call``; a failure is logged and survived, as rank 0's engine survives it (it
        re-runs the requests one by one, and those messages follow)."""
        try:
            return call(*args)
        except MemoryError:
            raise
        except Exception as exc:
            if is_collective_failure(exc):  # a peer is gone: nothing follows
                raise RankLostError(f"rank {self.group.rank()}: a peer is gone ({exc})") from exc
            self.stats.errors += 1
            logger.error("rank %d: step failed", self.group.rank(), exc_info=True)
            return None


def held_layers(runner) -> tuple[int, int]:
    """The layers ``runner``'s pools hold: KV arrays written, recurrent layers with state (a
    pipeline stage: its own layers only)."""
    kv_layers = sum(keys is not None for keys in runner.pool.keys)
    return kv_layers, len(runner.state_pool.arrays) if runner.state_pool is not None else 0
