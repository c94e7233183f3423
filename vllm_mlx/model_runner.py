"""MLXModelRunner: executes a ``SchedulerOutput`` with batched MLX forwards, then samples.

Runs on the engine thread only (MLX streams are thread-local). Rows of one step are grouped into
as few forward calls as padding allows: all decodes (one new token each) share one call, and
prefill chunks join a call when padding them to its longest row wastes little compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from vllm_mlx.attention import KVPool, MLXAttentionBackend, RowSpec
from vllm_mlx.sampling import SamplingRow, sample
from vllm_mlx.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

# A group accepts a row while padded tokens stay within this factor of real tokens.
MAX_PADDING_FACTOR = 1.25


@dataclass
class StepRecord:
    """What one step ran (observers and tests read these; cheap plain data)."""

    step_id: int
    request_ids: list[str]
    num_new_tokens: list[int]
    num_forward_calls: int


def group_for_padding(scheduled: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """Split rows into forward calls, longest first, keeping padding waste bounded."""
    groups: list[list[ScheduledRequest]] = []
    for item in sorted(scheduled, key=lambda s: s.num_new_tokens, reverse=True):
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * group[0].num_new_tokens
            real = sum(s.num_new_tokens for s in group) + item.num_new_tokens
            if padded <= MAX_PADDING_FACTOR * real:
                group.append(item)
                continue
        groups.append([item])
    return groups


class SplitModel:
    """A model as backbone (hidden states) + head (logits), when that split is exact.

    A prefill chunk needs logits at one position only; projecting every position onto the
    vocabulary wastes ~15% of a prefill step. mlx-lm models keep their transformer in ``.model``
    and their head in ``lm_head`` (or tie it to the embedding); some scale or cap logits in
    ``__call__``. So the split is probed once against the model's own ``__call__`` and used only
    if it reproduces the logits exactly.
    """

    def __init__(self, backbone, head) -> None:
        self.backbone = backbone
        self.head = head

    @classmethod
    def probe(cls, model) -> SplitModel | None:
        backbone = getattr(model, "model", None)
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(backbone, "embed_tokens", None)
        head = lm_head if lm_head is not None else getattr(embed, "as_linear", None)
        if not callable(backbone) or head is None:
            return None
        tokens = mx.array([[1, 2, 3, 4]])
        try:
            same = mx.array_equal(model(tokens), head(backbone(tokens))).item()
        except Exception:  # any other signature or structure: use the model as it is
            return None
        return cls(backbone, head) if same else None


class MLXModelRunner:
    """Owns the model and the KV pool; turns scheduled work into sampled tokens."""

    def __init__(self, model, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.split = SplitModel.probe(model)
        self.num_layers = len(model.layers)
        self.pool = KVPool(self.num_layers, num_blocks, block_size)
        self.attention = MLXAttentionBackend(self.pool, self.num_layers)
        self.last_step: StepRecord | None = None

    def release(self) -> None:
        """Drop the model and the KV pool (MLX arrays), on the thread that made them. MLX
        arrays still alive at interpreter exit after being used on another thread abort the
        process ("terminate called without an active exception")."""
        self.model = self.split = None
        self.pool.keys = [None] * self.num_layers
        self.pool.values = [None] * self.num_layers

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        groups = group_for_padding(scheduler_output.scheduled)
        sampled: list[ScheduledRequest] = []
        logits: list[mx.array] = []
        for group in groups:
            group_logits = self._forward(group)
            for item, row_logits in zip(group, group_logits):
                if row_logits is not None:
                    sampled.append(item)
                    logits.append(row_logits)
        self.last_step = StepRecord(
            scheduler_output.step_id,
            [s.request_id for s in scheduler_output.scheduled],
            [s.num_new_tokens for s in scheduler_output.scheduled],
            len(groups),
        )
        if not sampled:
            return ModelRunnerOutput()
        result = sample(mx.stack(logits), [sampling_row(s) for s in sampled])
        output = ModelRunnerOutput()
        for item, token_id, logprobs in zip(sampled, result.token_ids, result.logprobs):
            output.sampled_token_ids[item.request_id] = token_id
            if logprobs is not None:
                output.logprobs[item.request_id] = logprobs
        return output

    def _forward(self, group: list[ScheduledRequest]) -> list[mx.array | None]:
        """One padded forward; the logits at each sampling row's last position (else None)."""
        rows = [row_spec(s) for s in group]
        width = max(len(r.tokens) for r in rows)
        inputs = mx.array([r.tokens + [0] * (width - len(r.tokens)) for r in rows])
        caches = self.attention.make_caches(rows)
        wanted = [i for i, s in enumerate(group) if s.samples]
        where = (mx.array(wanted), mx.array([len(rows[i].tokens) - 1 for i in wanted]))
        if self.split is not None:  # project only the positions that sample
            hidden = self.split.backbone(inputs, cache=caches)
            picked = self.split.head(hidden[where]) if wanted else None
        else:
            out = self.model(inputs, cache=caches)
            picked = out[where] if wanted else None
        # Evaluate now: the pool's next scatter can then update its buffers in place.
        mx.eval([picked] if picked is not None else [], self.pool.arrays())
        per_row: list[mx.array | None] = [None] * len(group)
        for n, i in enumerate(wanted):
            per_row[i] = picked[n]
        return per_row


def row_spec(item: ScheduledRequest) -> RowSpec:
    start = item.num_computed_tokens
    tokens = item.request.all_token_ids[start : start + item.num_new_tokens]
    return RowSpec(tokens=tokens, num_computed=start, block_ids=item.block_ids)


def sampling_row(item: ScheduledRequest) -> SamplingRow:
    request = item.request
    params = request.sampling_params
    banned: list[int] = []
    if request.num_output_tokens < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
    if params.seed is None:
        raise ValueError(f"request {request.request_id} has no seed (the engine draws one for every request)")
    return SamplingRow(
        params=params,
        seed=params.seed,
        step=request.num_output_tokens,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        banned_token_ids=banned,
    )
