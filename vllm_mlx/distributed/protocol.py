"""The step protocol: how rank 0's engine drives the other ranks of a tensor- or pipeline-parallel
engine (``mx.distributed``), each rank holding a part of the weights (``distributed/sharding.py``,
``distributed/pipeline.py``) and of the KV pool. Rank 0's block tables are valid on every rank.

Rank 0 is the engine (``EngineCore`` with ``tensor_parallel=True``): scheduler, prefix cache,
detokenizing, sampling that counts. Before each forward it broadcasts the step as a
``StepMessage`` (plain data, JSON) and every other rank runs ``worker_loop``
(``engine/rank_worker.py``): its ``Worker`` (``distributed/worker.py``) rebuilds the
step's ``ScheduledRequest``s on shadow ``Request``s and runs its runner on the same batch.

Sampling: rank 0's token is the one that counts; it reaches the workers in the next message
(they need the token ids of the next step anyway, so nothing is broadcast per sampled token).
Workers sample too (the runner does), from the same all-reduced logits with the same
per-request seed and step, so they draw the same tokens; ``WorkerStats.mismatches`` counts the
times they did not (always 0 unless a rank diverged; a constrained request's mask lives on rank 0
only, so its worker samples are not compared). No rank's state depends on its own samples.

Invariant: every rank issues the same collectives in the same order. At start-up every rank
calls ``prepare_engine_model`` (load, weights, shard checks, KV measurement) and then builds its
runner (its head probe is a forward); after that each collective belongs to a message rank 0 sent
first. A step that fails is survived (rank 0 re-runs it request by request and probes, and sends
those too) only when it fails alike on every rank before its first collective; a failure inside
a forward leaves the ranks out of step.

A rank that dies or hangs ends the engine, never silently: a dead peer closes its liveness
connection to rank 0 (``distributed/liveness.py``: the ring's collectives raise only sometimes, and may
block instead), and a ring error in a message sent or received becomes ``RankLostError``; a hung one
is caught by rank 0's ``CollectiveWatchdog`` (``distributed/watchdog.py``: a deadline on every step,
heartbeat and stop message). Rank 0's engine then fails its requests with that error; a worker
whose rank 0 is gone raises it and exits.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.distributed.watchdog import RankLostError

# ---- the step protocol (plain data) ---------------------------------------------------------


@dataclass
class NewRequest:
    """What a worker needs to know of a request the first time a step schedules it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict
    """``SamplingParams`` fields (``structured_outputs`` left out: constraints apply on rank 0)."""
    eos_token_ids: list[int]
    constrained: bool = False
    """It has a structured-output constraint: its mask lives on rank 0 only, so the worker's own
    samples for it are not compared with rank 0's."""


@dataclass
class StepRow:
    """One scheduled row (``ScheduledRequest`` as plain data). ``new_output_token_ids``: the
    request's output tokens rank 0 has not sent before (sampled since), so a worker's shadow
    request holds every token of the request, as penalties and ``step`` need.

    Block tables travel as deltas: ``block_ids`` (the first block group's table) and
    ``block_tables`` (every group's, with several groups; else None) hold the ids appended to
    the tables of the request's previous row, which the worker kept; a decode step that crosses
    no block boundary sends none. When a table changed otherwise (the first row of a request, a
    re-admission after preemption, a sliding window's blocks turned null), ``whole_tables`` is
    True and they hold the whole tables (``table_delta``)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    new_output_token_ids: list[int] = field(default_factory=list)
    state_slot: int = 0
    state_read_slot: int | None = None
    checkpoint_slot: int | None = None
    block_tables: list[list[int]] | None = None
    whole_tables: bool = True
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens the row verifies (speculative decoding; proposed on rank 0)."""


def table_delta(known: list[list[int]] | None, tables: list[list[int]]) -> list[list[int]] | None:
    """The ids to append to each of ``known`` (the tables a worker holds) to get ``tables``, or
    None when some table is not ``known``'s plus appended ids (then the whole tables go)."""
    if known is None or len(known) != len(tables):
        return None
    if any(table[: len(old)] != old for old, table in zip(known, tables)):
        return None
    return [table[len(old) :] for old, table in zip(known, tables)]


def row_tables(row: StepRow, known: list[list[int]] | None) -> list[list[int]]:
    """A worker's side of ``table_delta``: the request's whole tables after ``row``, from the
    tables of its previous row (``known``; None before its first)."""
    sent = row.block_tables if row.block_tables is not None else [row.block_ids]
    if row.whole_tables:
        return sent
    return [old + new for old, new in zip(known, sent, strict=True)]


@dataclass
class StepMessage:
    """What rank 0 broadcasts: ``kind`` "step" (run ``rows``), "probe" (run ``runner.probe()``),
    "start" (``start``: the runner's sizing), "ping" (nothing to run: rank 0's idle heartbeat,
    which finds a dead or hung rank before a request does) or "stop". ``finished``: ids whose
    shadow requests the workers drop. Only JSON types inside: ``to_bytes``/``from_bytes``
    round-trip exactly."""

    kind: str
    step_id: int = 0
    new_requests: list[NewRequest] = field(default_factory=list)
    rows: list[StepRow] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    start: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        data = dataclasses.asdict(self)
        data["rows"] = [_without_defaults(row) for row in data["rows"]]  # ``from_bytes`` puts them back
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMessage:
        raw = json.loads(data)
        raw["new_requests"] = [NewRequest(**r) for r in raw["new_requests"]]
        raw["rows"] = [StepRow(**r) for r in raw["rows"]]
        return cls(**raw)


_ROW_DEFAULTS = {
    f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(StepRow)
    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
}


def _without_defaults(row: dict) -> dict:
    """A row's JSON data less the fields at their defaults: a decode row is little more than its
    id and counts (no new tables, proposals or checkpoint), and the step's message is per row."""
    return {name: value for name, value in row.items() if name not in _ROW_DEFAULTS or value != _ROW_DEFAULTS[name]}


def sampling_dict(params: SamplingParams) -> dict:
    """``params`` as JSON data (constraints dropped: see ``NewRequest.sampling``)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "structured_outputs"}


@dataclass
class _Sent:
    """What the workers know of a live request: its output tokens up to ``num_output_tokens``
    and its block tables as of its last row (None before its first)."""

    request: Request
    num_output_tokens: int = 0
    tables: list[list[int]] | None = None


class StepEncoder:
    """Rank 0's side: turns ``SchedulerOutput``s into ``StepMessage``s, remembering what each
    live request's shadow on the workers holds (its output tokens and block tables)."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, output: SchedulerOutput) -> StepMessage:
        message = StepMessage("step", output.step_id, finished=self._drop_finished())
        for item in output.scheduled:
            request = item.request
            if request.request_id not in self._sent:
                message.new_requests.append(NewRequest(
                    request.request_id, list(request.prompt_token_ids), sampling_dict(request.sampling_params),
                    sorted(request.eos_token_ids), request.sampling_params.structured_outputs is not None,
                ))  # fmt: skip
                self._sent[request.request_id] = _Sent(request)
            message.rows.append(self._row(item, self._sent[request.request_id]))
        return message

    def _row(self, item: ScheduledRequest, sent: _Sent) -> StepRow:
        """``item`` as a row, the request's tables as deltas where they only grew; ``sent``
        becomes what the workers will hold after it."""
        request = item.request
        new_tokens = request.output_token_ids[sent.num_output_tokens :]
        tables = [list(t) for t in item.block_tables] if item.block_tables is not None else [list(item.block_ids)]
        delta = table_delta(sent.tables, tables)
        sent.num_output_tokens, sent.tables = request.num_output_tokens, tables
        sending = tables if delta is None else delta
        return StepRow(
            request.request_id, item.num_computed_tokens, item.num_new_tokens, sending[0], new_tokens,
            item.state_slot, item.state_read_slot, item.checkpoint_slot,
            sending if item.block_tables is not None else None, delta is None, list(item.spec_token_ids),
        )  # fmt: skip

    def _drop_finished(self) -> list[str]:
        done = [rid for rid, sent in self._sent.items() if sent.request.is_finished]
        for rid in done:
            del self._sent[rid]
        return done


# ---- broadcast ------------------------------------------------------------------------------


def broadcast_bytes(group: mx.distributed.Group, data: bytes | None) -> bytes:
    """Rank 0 passes ``data``, the others None; every rank returns rank 0's bytes. Two
    ``all_sum``s (length, then payload) where the other ranks add zeros: exact, any rank count."""
    length = mx.array([len(data) if data is not None else 0], dtype=mx.int32)
    length = mx.distributed.all_sum(length, group=group).item()
    payload = np.frombuffer(data, np.uint8) if data is not None else np.zeros(length, np.uint8)
    summed = mx.distributed.all_sum(mx.array(payload), group=group)
    mx.eval(summed)
    return bytes(np.array(summed))


def send_message(group: mx.distributed.Group, message: StepMessage) -> None:
    """Rank 0's broadcast. It only communicates, so any failure means a rank is gone (the
    ring backend raises when a peer's socket closes): ``RankLostError``."""
    try:
        broadcast_bytes(group, message.to_bytes())
    except Exception as exc:
        raise RankLostError(
            f"a tensor-parallel rank is gone: sending the {message.kind!r} message of step "
            f"{message.step_id} to {group.size() - 1} other ranks failed ({exc})"
        ) from exc


def receive_message(group: mx.distributed.Group) -> StepMessage:
    """A worker's wait for rank 0's next message; ``RankLostError`` when the group broke."""
    try:
        data = broadcast_bytes(group, None)
    except Exception as exc:
        raise RankLostError(f"rank {group.rank()}: rank 0 or a peer is gone ({exc})") from exc
    return StepMessage.from_bytes(data)
