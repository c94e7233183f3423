"""A draft model for speculative decoding: a smaller model with the target's tokenizer decodes a
few tokens ahead of the target, greedily, and the target verifies them in its next step.

The draft runs in the engine, on the engine thread, with its own ``MLXModelRunner`` and its own
paged KV pool and prefix cache (``KVCacheManager``), batched across every request that
speculates. Each such request has a shadow ``Request`` here (same id and salt, greedy) whose
tokens are the target's known tokens: the prompt, the accepted output and the last sampled token.

One ``draft`` call, for the requests and lengths the policy chose:

1. *Catch up.* A shadow's tokens become its target's; its computed count falls back to what is
   still true: the positions it computed before, and of the proposals it computed last time, the
   leading ones the target accepted (their KV holds exactly those tokens). A new shadow starts
   from its longest hit in the draft's prefix cache.
2. One forward over every shadow's uncomputed tokens (a new request's prompt, else the accepted
   tokens and the target's new sampled one) samples each first proposal.
3. One single-token forward per further proposal, over the rows that want more.

Proposals are written to KV slots past the known tokens but are never counted as computed, so
they never reach the prefix cache: a block is published only once it is full of known tokens.
The draft is refused when its tokenizer differs from the target's, when it has recurrent layers
(their state cannot step back over a rejected proposal without checkpoints of its own) or when it
is a vision-language model; requests with images do not use it. A draft forward that fails drops
the draft's state and proposes nothing that step: speculation is an optimisation, never a reason
for a request to fail.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_mlx.core.kv.manager import KVCacheManager
from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.spec import BlockGroups, KVLayout, is_recurrent
from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
from vllm_mlx.core.request import Request, SamplingParams

if TYPE_CHECKING:
    from vllm_mlx.models import LoadedModel

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0, max_tokens=1, seed=0)
"""The shadows' sampling: proposals are the draft's argmax (rejection sampling then keeps the
target's distribution for sampled requests: a greedy proposal is a one-hot draft distribution)."""


class DraftModelError(ValueError):
    """The draft model cannot serve this target (tokenizer, architecture)."""


@dataclass
class LoadedDraft:
    """The draft model loaded and measured, before its pool is sized."""

    loaded: LoadedModel
    kv_layout: KVLayout
    block_groups: BlockGroups
    weight_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_layout.bytes_per_block_token(self.block_groups)


def load_draft(source: str, target: LoadedModel, weight_format: str, trust_remote_code: bool) -> LoadedDraft:
    """Load the draft model ``source`` in the target's weight format and check it can propose
    for ``target``.

    Raises:
        DraftModelError: Another tokenizer, a vision-language or recurrent draft.
        ModelSourceError: The draft cannot be found or loaded.
    """
    from vllm_mlx.executor.attention import check_supported
    from vllm_mlx.executor.model_runner import measure_kv_layout
    from vllm_mlx.models import load_model
    from vllm_mlx.platform.cpu_backend import prepare_model_weights

    loaded = load_model(source, trust_remote_code=trust_remote_code)
    if loaded.vision is not None:
        raise DraftModelError(f"draft model {source!r}: a vision-language model cannot be a draft")
    specs = check_supported(loaded.model, loaded.config.get("model_type", "?"))
    if any(map(is_recurrent, specs)):
        raise DraftModelError(
            f"draft model {source!r} has recurrent layers; a draft model must be attention-only "
            "(its state would have to step back over rejected proposals)"
        )
    if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise DraftModelError(f"draft model {source!r} has another tokenizer than the target; they must be the same")
    prepare_model_weights(loaded.model, weight_format)
    kv_layout = measure_kv_layout(loaded.model)
    return LoadedDraft(loaded, kv_layout, kv_layout.block_groups(specs), parameter_bytes(loaded.model))


def parameter_bytes(model) -> int:
    """What a model's weights take (the bytes a decode step reads)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@dataclass
class Shadow:
    """The draft's copy of one target request: ``request.prompt_token_ids`` are the target's
    known tokens as of the last call (proposals are appended as output only while drafting)."""

    request: Request
    published: int
    """The computed count at the last publication to the draft's prefix cache."""
    proposals: list[int] = field(default_factory=list)
    """The last call's proposals; all but the last were computed, at the positions after the
    known tokens."""


class DraftModel:
    """Greedy proposals from a draft model for the requests that speculate (a ``Drafter``).

    ``num_blocks`` and ``block_size``: the draft's pool, the target's counts (so that whatever
    the target holds, the draft can too). ``cost_ratio``: the draft's weight bytes over the
    target's, since a decode step reads every weight once (the policy prices proposals by it).
    """

    def __init__(
        self, draft: LoadedDraft, num_blocks: int, block_size: int, cost_ratio: float, enable_caching: bool = True
    ) -> None:
        from vllm_mlx.executor.model_runner import MLXModelRunner

        self.runner = MLXModelRunner(draft.loaded.model, num_blocks, block_size, block_groups=draft.block_groups)
        coordinator = PagedCacheManager(num_blocks, block_size, enable_caching, group_windows=draft.block_groups.windows)
        self.kv = KVCacheManager(coordinator, namespace=f"draft:{draft.loaded.path}", enable_caching=enable_caching)
        self.cost_ratio = cost_ratio
        self.shadows: dict[str, Shadow] = {}
        self._step_ids = itertools.count()

    def draft(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        wanted = {r.request_id: n for r, n in zip(requests, lengths) if n > 0 and r.mm_input is None}
        if not wanted:
            return [[] for _ in requests]
        try:
            proposals = self._propose([r for r in requests if r.request_id in wanted], wanted)
        except Exception:  # the draft's failure costs speculation this step, never a request
            logger.exception("the draft model failed; proposing nothing this step")
            self.keep_only(set())
            return [[] for _ in requests]
        return [proposals.get(r.request_id, []) for r in requests]

    def keep_only(self, request_ids: set[str]) -> None:
        for request_id in [rid for rid in self.shadows if rid not in request_ids]:
            self._drop(request_id)

    def release(self) -> None:
        """Free every shadow and drop the model and pool (on the engine thread)."""
        self.keep_only(set())
        self.runner.release()

    # ---- one call -------------------------------------------------------------------------------

    def _propose(self, requests: list[Request], wanted: dict[str, int]) -> dict[str, list[int]]:
        """Catch every shadow up and decode ``wanted`` tokens for each, one batched forward per
        position; a shadow the pool cannot hold proposes nothing."""
        shadows = [s for r in requests if (s := self._catch_up(r, wanted[r.request_id])) is not None]
        proposals: dict[str, list[int]] = {s.request.request_id: [] for s in shadows}
        drafting = shadows
        while drafting:
            rows = [self._row(s, proposals[s.request.request_id]) for s in drafting]
            output = self.runner.execute_model(SchedulerOutput(next(self._step_ids), rows))
            for shadow in drafting:
                proposals[shadow.request.request_id].append(output.sampled_token_ids[shadow.request.request_id])
            if drafting is shadows:  # the catch-up forward: the known tokens are computed now
                for shadow in shadows:
                    self._publish(shadow)
            drafting = [s for s in drafting if len(proposals[s.request.request_id]) < wanted[s.request.request_id]]
        for shadow in shadows:
            shadow.request.output_token_ids.clear()
            shadow.proposals = proposals[shadow.request.request_id]
        return proposals

    def _catch_up(self, target: Request, num_proposals: int) -> Shadow | None:
        """The target's shadow, its known tokens the target's and its computed count what is
        still true, with slots for the known tokens and ``num_proposals - 1`` computed proposals."""
        known = target.all_token_ids
        shadow = self.shadows.get(target.request_id)
        if shadow is None:
            request = Request(target.request_id, known, GREEDY, cache_salt=target.cache_salt)
            hits = self.kv.get_computed_blocks(request)
            if not self.kv.allocate_slots(request, len(known) + num_proposals - 1, hits):
                return None
            request.num_computed_tokens = len(hits) * self.kv.block_size
            self.kv.record_admission(request, request.num_computed_tokens)
            shadow = self.shadows[target.request_id] = Shadow(request, request.num_computed_tokens)
            return shadow
        request = shadow.request
        computed = request.num_computed_tokens
        if computed == request.num_tokens:  # its last proposals' KV follows: keep the accepted ones
            for proposal, token in zip(shadow.proposals[:-1], known[computed:]):
                if proposal != token:
                    break
                computed += 1
        request.prompt_token_ids = known
        request.num_computed_tokens = min(computed, len(known) - 1)  # the last token is always computed
        shadow.proposals = []
        if not self.kv.allocate_slots(request, len(known) + num_proposals - 1):
            self._drop(target.request_id)
            return None
        return shadow

    def _drop(self, request_id: str) -> None:
        self.kv.free(self.shadows.pop(request_id).request, finished=True)

    def _row(self, shadow: Shadow, drafted: list[int]) -> ScheduledRequest:
        """The forward row that yields the next proposal: the uncomputed known tokens for the
        first, else the last proposal (after the known tokens and the proposals before it)."""
        request = shadow.request
        if not drafted:
            start, count = request.num_computed_tokens, request.num_tokens - request.num_computed_tokens
        else:
            request.output_token_ids.append(drafted[-1])
            start, count = request.num_tokens - 1, 1
        cache = self.kv.assign(request, count)
        return ScheduledRequest(request, start, count, cache.block_ids, block_tables=cache.block_tables)

    def _publish(self, shadow: Shadow) -> None:
        """The known tokens are computed: publish the blocks they filled."""
        request = shadow.request
        request.num_computed_tokens = request.num_tokens
        self.kv.complete_step(request, shadow.published, checkpointed=False, succeeded=True)
        shadow.published = request.num_computed_tokens
