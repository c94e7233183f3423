"""Tensor parallelism: one engine over several ranks (``mx.distributed``), each rank holding a
shard of the weights and of the KV pool.

Every rank loads the whole model and keeps its slice (``shard_model``: mlx-lm's
``model.shard(group)``, which splits attention heads, KV heads and the MLP; the embedding and
the head stay whole). Sharded layers end in an ``all_sum``, so every rank computes the same
hidden states and the same logits. Each rank's KV pool holds its own KV heads for the same
blocks: rank 0's block tables are valid on every rank.

Rank 0 is the engine (``EngineCore`` with ``tensor_parallel=True``): scheduler, prefix cache,
detokenizing, sampling that counts. Before each forward it broadcasts the step as a
``StepMessage`` (plain data, JSON) and every other rank runs ``worker_loop``
(``engine/rank_worker.py``): it rebuilds the
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
import logging
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_mlx.core.kv.sizing import MemoryNeeds
from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.distributed.ring_formation import form_group
from vllm_mlx.distributed.watchdog import RankLostError, is_collective_failure

logger = logging.getLogger(__name__)


class TensorParallelError(ValueError):
    """The model cannot be split over the ranks (or the ranks disagree about it)."""


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
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMessage:
        raw = json.loads(data)
        raw["new_requests"] = [NewRequest(**r) for r in raw["new_requests"]]
        raw["rows"] = [StepRow(**r) for r in raw["rows"]]
        return cls(**raw)


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
            sending if item.block_tables is not None else None, delta is None,
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


# ---- the cost model ---------------------------------------------------------------------------


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


# ---- sharding -------------------------------------------------------------------------------


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


def combine_memory_needs(group: mx.distributed.Group, mine: MemoryNeeds) -> MemoryNeeds:
    """Every rank's ``MemoryNeeds`` combined (collectively: every rank must call it): the most
    any rank needs per KV token and per request state, the least memory any rank has."""
    fields = (mine.kv_bytes_per_token, mine.state_bytes_per_request, mine.available_bytes)
    gathered = mx.distributed.all_gather(mx.array([fields], dtype=mx.int64), group=group)
    rows = np.array(gathered).reshape(group.size(), len(fields))
    return MemoryNeeds(int(rows[:, 0].max()), int(rows[:, 1].max()), int(rows[:, 2].min()))


def shard_model(model, config: dict, model_path: Path, group: mx.distributed.Group) -> None:
    """Check (collectively: every rank must call it), then keep this rank's shard in place."""
    from vllm_mlx.models.digest import model_digest

    check_same_model(group, model_digest(model_path), model_path)
    check_shardable(model, config, group.size())
    model.shard(group)
    mx.eval(model.parameters())


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


# ---- ranks > 0 --------------------------------------------------------------------------------


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
            if rid not in self.unchecked:
                self.sampled[rid] = (self.requests[rid].num_output_tokens, token)

    def _scheduled(self, row: StepRow) -> ScheduledRequest:
        request = self.requests[row.request_id]
        self._compare(request, row.new_output_token_ids)
        request.output_token_ids.extend(row.new_output_token_ids)
        request.num_computed_tokens = row.num_computed_tokens
        tables = self.tables[row.request_id] = row_tables(row, self.tables.get(row.request_id))
        return ScheduledRequest(
            request, row.num_computed_tokens, row.num_new_tokens, tables[0], row.state_slot,
            row.state_read_slot, row.checkpoint_slot, tables if row.block_tables is not None else None,
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
