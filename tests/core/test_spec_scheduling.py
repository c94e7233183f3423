"""The scheduler with speculative decoding: proposed tokens verified inside the batch.

The runner is ``test_scheduler``'s KV-store stand-in, extended to verify proposals: every
position it computes (known tokens and proposed ones) writes its token into the slot the block
table gives, and each sampled position reads its whole context back through the table. So a
rejected proposal whose slot were ever read as computed KV, a block hashed before its tokens were
verified, or a rollback that loses an accepted token changes the output, and the output must
equal the request run alone without speculation.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_scheduler import (
    PROP_EOS,
    FakeRunner,
    make_request,
    make_scheduler,
    natural_token,
    reference_output,
    reference_output_eos,
    used_blocks,
)

from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.outputs import ModelRunnerOutput, SchedulerOutput
from vllm_mlx.core.request import Request, RequestStatus, SamplingParams
from vllm_mlx.core.sched.scheduler import Scheduler, SchedulerConfig
from vllm_mlx.executor.verification import verify_proposals


class VerifyingRunner(FakeRunner):
    """Writes every computed position (proposals included) into the KV store; samples each
    verified position from the context read back through the block table."""

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for s in out.scheduled:
            self._write_row(s)
        output = ModelRunnerOutput()
        for s in out.scheduled:
            if not s.samples:
                continue
            known = s.request.num_tokens
            tokens = [natural_token(self._context(s, known + j)) for j in range(len(s.spec_token_ids) + 1)]
            verdict = verify_proposals(s.spec_token_ids, tokens, [None] * len(tokens)) if s.spec_token_ids else None
            output.sampled_token_ids[s.request_id] = tokens[verdict.num_accepted if verdict else 0]
            if verdict is not None:
                output.drafts[s.request_id] = verdict
        return output

    def _write_row(self, s) -> None:
        assert s.num_computed_tokens == s.request.num_computed_tokens
        end = s.num_computed_tokens + s.num_new_tokens
        assert len(s.block_ids) * self.kv_cache.block_size >= end, "table too short"
        for pos, token in zip(range(s.num_computed_tokens, end), s.token_ids):
            block = self.kv_cache.blocks[s.block_ids[pos // self.kv_cache.block_size]]
            assert block.ref_cnt == 1 and block.block_hash is None, "write into a shared block"
            self.slots[self._slot(s.block_ids, pos)] = token

    def _context(self, s, length: int) -> list[int]:
        return [self.slots[self._slot(s.block_ids, p)] for p in range(length)]


def continuation(tokens: list[int], n: int) -> list[int]:
    """The next ``n`` tokens the stand-in model produces after ``tokens``."""
    tokens, out = list(tokens), []
    for _ in range(n):
        out.append(natural_token(tokens))
        tokens.append(out[-1])
    return out


def propose(request: Request, num_right: int, num_wrong: int) -> None:
    """``num_right`` correct tokens, then ``num_wrong`` wrong ones."""
    right = continuation(request.all_token_ids, num_right + num_wrong)
    request.spec_token_ids = right[:num_right] + [t + 1 for t in right[num_right:]]


def spec_step(sched: Scheduler, runner: VerifyingRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, runner(out))
    sched.check_invariants()
    sched.kv.coordinator.check_invariants()
    return out


def test_accepted_tokens_and_the_sampled_one_are_appended_and_computed():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = VerifyingRunner(sched.kv.coordinator)
    request = make_request("a", 10, max_tokens=20, ignore_eos=True)
    sched.add_request(request)
    spec_step(sched, runner)  # the prompt, and the first token
    propose(request, num_right=2, num_wrong=2)
    out = spec_step(sched, runner)
    [row] = out.scheduled
    assert (row.num_computed_tokens, row.num_new_tokens, len(row.spec_token_ids)) == (10, 5, 4)
    assert request.num_output_tokens == 1 + 2 + 1  # first token, two kept, the one sampled after them
    assert request.num_computed_tokens == request.num_tokens - 1
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (4, 2)
    assert request.spec_token_ids == []
    run_with_proposals(sched, runner, random.Random(0))
    assert request.output_token_ids == reference_output(request, sched.max_model_len)[0]


def test_proposals_fit_the_budget_and_the_context():
    sched = make_scheduler(max_num_batched_tokens=4, max_model_len=16)
    runner = VerifyingRunner(sched.kv.coordinator)
    request = make_request("a", 3, max_tokens=20, ignore_eos=True)
    sched.add_request(request)
    spec_step(sched, runner)
    propose(request, num_right=8, num_wrong=0)
    [row] = spec_step(sched, runner).scheduled
    assert len(row.spec_token_ids) == 3  # the budget: the row's own token and three proposals
    while request.num_tokens < 14:
        request.spec_token_ids = []
        spec_step(sched, runner)
    propose(request, num_right=8, num_wrong=0)
    [row] = spec_step(sched, runner).scheduled
    assert len(row.spec_token_ids) == 16 - 14  # room below max_model_len
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == reference_output(request, sched.max_model_len)[0]


def test_a_short_pool_drops_the_proposals_rather_than_preempting():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    runner = VerifyingRunner(sched.kv.coordinator)
    a, b = make_request("a", 3, max_tokens=6, ignore_eos=True), make_request("b", 3, max_tokens=6, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    spec_step(sched, runner)  # each holds one of the three usable blocks
    propose(a, num_right=8, num_wrong=0)  # would need two more blocks
    out = spec_step(sched, runner)
    assert out.preempted_ids == [] and all(not s.spec_token_ids for s in out.scheduled)
    assert a.num_draft_tokens == 0
    run_with_proposals(sched, runner, random.Random(1))
    assert a.output_token_ids == reference_output(a, sched.max_model_len)[0]


def test_a_stop_inside_the_accepted_tokens_ends_the_request_there():
    sched = make_scheduler()
    runner = VerifyingRunner(sched.kv.coordinator)
    request = make_request("a", 5, max_tokens=30, ignore_eos=True)
    sched.add_request(request)
    spec_step(sched, runner)
    ahead = continuation(request.all_token_ids, 6)
    request.sampling_params.stop_token_ids = [ahead[2]]
    request.spec_token_ids = ahead
    spec_step(sched, runner)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids[1:] == ahead[: ahead.index(ahead[2]) + 1]
    assert used_blocks(sched) == 0


def test_recurrent_layers_recompute_from_the_step_start_after_a_rejection():
    kv = PagedCacheManager(64, 4, num_state_slots=4)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), kv)
    runner = VerifyingRunner(kv)
    request = make_request("a", 6, max_tokens=12, ignore_eos=True)
    sched.add_request(request)
    spec_step(sched, runner)
    start = request.num_computed_tokens
    propose(request, num_right=1, num_wrong=2)
    spec_step(sched, runner)
    assert request.num_computed_tokens == start  # the state saw the rejected tokens: recompute
    assert request.num_output_tokens == 1 + 1 + 1
    [row] = spec_step(sched, runner).scheduled
    assert (row.num_computed_tokens, row.num_new_tokens) == (start, 3)  # last known, kept, sampled
    propose(request, num_right=2, num_wrong=0)
    spec_step(sched, runner)
    assert request.num_computed_tokens == request.num_tokens - 1  # all kept: nothing to redo
    run_with_proposals(sched, runner, random.Random(2))
    assert request.output_token_ids == reference_output(request, sched.max_model_len)[0]


def run_with_proposals(sched: Scheduler, runner: VerifyingRunner, rng: random.Random, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        for request in sched.running:
            if request.num_computed_tokens == request.num_tokens - 1:
                propose(request, rng.randint(0, 4), rng.randint(0, 2))
        spec_step(sched, runner)
    raise AssertionError("the scheduler made no progress")


class SpeculatingMachine(RuleBasedStateMachine):
    """Random joins, proposals (right, wrong, none) and steps on 12 blocks of 4 tokens, with
    prefix caching and preemption: no leaks, and every request that ends on its own generated
    exactly what it generates alone without speculation."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = PagedCacheManager(13, 4)
        self.sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=4), self.kv)
        self.runner = VerifyingRunner(self.kv)
        self.added: list[Request] = []

    @rule(length=st.integers(1, 40), data=st.data(), max_tokens=st.integers(1, 12))
    def add(self, length, data, max_tokens):
        prompt = data.draw(st.lists(st.sampled_from([3, 4, 5]), min_size=length, max_size=length))
        request = Request(f"r{len(self.added)}", prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids={PROP_EOS})
        self.sched.add_request(request)
        self.added.append(request)

    @rule(data=st.data())
    def step(self, data):
        for request in self.sched.running:
            if request.num_computed_tokens == request.num_tokens - 1:
                propose(request, data.draw(st.integers(0, 5)), data.draw(st.integers(0, 2)))
        spec_step(self.sched, self.runner)

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        self.sched.check_invariants()

    def teardown(self):
        run_with_proposals(self.sched, self.runner, random.Random(len(self.added)), max_steps=2000)
        assert self.kv.stats().num_used_blocks == 0, "blocks leaked"
        for r in self.added:
            assert r.is_finished, f"{r.request_id} lost"
            if r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                expected, status = reference_output_eos(r, self.sched.max_model_len)
                assert (r.output_token_ids, r.status) == (expected, status), r.request_id


TestSpeculatingMachine = SpeculatingMachine.TestCase
TestSpeculatingMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("num_right", [0, 3])
def test_rejected_positions_are_never_cached(num_right):
    """A request's rejected proposals wrote into its blocks; a later request with the same
    tokens hits only blocks whose every token was verified (the store would show otherwise)."""
    sched = make_scheduler(block_size=4)
    runner = VerifyingRunner(sched.kv.coordinator)
    first = make_request("a", 7, max_tokens=9, ignore_eos=True)
    sched.add_request(first)
    spec_step(sched, runner)
    propose(first, num_right=num_right, num_wrong=4)
    run_with_proposals(sched, runner, random.Random(3))
    second = Request("b", first.all_token_ids[:-1], SamplingParams(max_tokens=3), eos_token_ids=set())
    sched.add_request(second)
    run_with_proposals(sched, runner, random.Random(4))
    assert second.num_cached_tokens > 0
    assert second.output_token_ids == reference_output(second, sched.max_model_len)[0]
