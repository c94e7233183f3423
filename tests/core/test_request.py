"""SamplingParams validation, RequestStatus, Request bookkeeping, RequestOutput."""

import dataclasses
import time

import pytest

from vllm_mlx.core.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)

# ---------------------------------------------------------------------------
# SamplingParams


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert (sp.max_tokens, sp.min_tokens, sp.n) == (16, 0, 1)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1.0, 1.0, 0, 0.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert sp.seed is None and sp.logprobs is None
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.ignore_eos is False and sp.skip_special_tokens is True
    assert not sp.greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("temperature", -0.01),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "0.7"),
        ("temperature", None),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", 2),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", True),
        ("max_tokens", 10.0),
        ("min_tokens", -1),
        ("n", 0),
        ("n", False),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("presence_penalty", 3),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("seed", 1.5),
        ("seed", True),
        ("stop", [""]),
        ("stop", ""),
        ("stop", ["ok", 3]),
        ("stop", 42),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 7),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_error_message_names_value_and_range():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(top_p=1e-6),
        dict(top_k=1),
        dict(min_p=1),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(seed=0),
        dict(seed=2**40),
        dict(max_tokens=1),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalisation():
    sp = SamplingParams(stop="###", stop_token_ids=(5, 7), top_k=-1, temperature=0)
    assert sp.stop == ["###"]
    assert sp.stop_token_ids == [5, 7]
    assert sp.top_k == 0
    assert sp.greedy
    assert isinstance(sp.temperature, float)
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_clone_and_replace_validate_and_copy():
    sp = SamplingParams(stop=["x"], seed=3)
    copy = sp.clone(max_tokens=32)
    assert copy.max_tokens == 32 and copy.seed == 3
    assert copy.stop == ["x"] and copy.stop is not sp.stop
    assert dataclasses.replace(sp) == sp
    with pytest.raises(ValueError, match="temperature"):
        sp.clone(temperature=-1)


# ---------------------------------------------------------------------------
# RequestStatus


@pytest.mark.parametrize(
    "status, finished, reason",
    [
        (RequestStatus.WAITING, False, None),
        (RequestStatus.RUNNING, False, None),
        (RequestStatus.PREEMPTED, False, None),
        (RequestStatus.FINISHED_STOPPED, True, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, True, "length"),
        (RequestStatus.FINISHED_ABORTED, True, "abort"),
        (RequestStatus.FINISHED_ERROR, True, "error"),
    ],
)
def test_request_status(status, finished, reason):
    assert status.is_finished is finished
    assert status.finish_reason == reason


# ---------------------------------------------------------------------------
# Request


def plain_request(**kwargs) -> Request:
    return Request(request_id="r1", prompt_token_ids=[1, 2, 3], **kwargs)


def test_request_counters():
    req = plain_request(eos_token_ids={0})
    assert req.status is RequestStatus.WAITING
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 0, 3)
    assert req.eos_token_ids == frozenset({0})
    assert req.first_token_time is None

    req.append_output_token(7)
    req.append_output_token(8)
    assert req.output_token_ids == [7, 8]
    assert (req.num_output_tokens, req.num_tokens) == (2, 5)
    assert req.all_token_ids == [1, 2, 3, 7, 8]
    assert req.first_token_time is not None and req.first_token_time >= req.arrival_time
    assert req.num_computed_tokens == 0  # the scheduler advances it, not append


def test_request_copies_its_prompt():
    prompt = [1, 2]
    req = Request(request_id="r", prompt_token_ids=prompt)
    prompt.append(3)
    assert req.prompt_token_ids == [1, 2]
    req.all_token_ids.append(9)
    assert req.num_tokens == 2


def test_request_rejects_empty_prompt_and_id():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request(request_id="r", prompt_token_ids=[])
    with pytest.raises(ValueError, match="request_id"):
        Request(request_id="", prompt_token_ids=[1])


def test_requests_compare_by_identity():
    a, b = plain_request(), plain_request()
    assert a != b
    assert len({a, b}) == 2


def test_finish_sets_status_reason_and_time():
    req = plain_request()
    before = time.monotonic()
    req.finish(RequestStatus.FINISHED_STOPPED, reason="###")
    assert req.is_finished
    assert req.finish_reason == "stop"
    assert req.stop_reason == "###"
    assert req.finish_time >= before


def test_first_finish_wins():
    req = plain_request()
    req.finish(RequestStatus.FINISHED_LENGTH_CAPPED)
    finish_time = req.finish_time
    req.finish(RequestStatus.FINISHED_ABORTED)
    req.error("late")
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.finish_time == finish_time
    assert req.error_message is None


def test_finish_requires_a_final_status():
    with pytest.raises(ValueError, match="RUNNING"):
        plain_request().finish(RequestStatus.RUNNING)


def test_error_shortcut():
    req = plain_request()
    req.error("prompt too long: 5000 > 4096")
    assert req.status is RequestStatus.FINISHED_ERROR
    assert req.finish_reason == "error"
    assert req.error_message == "prompt too long: 5000 > 4096"
    assert req.finish_time is not None


def test_preempt_resets_computed_tokens():
    req = plain_request()
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 3
    req.append_output_token(4)
    req.preempt()
    assert req.status is RequestStatus.PREEMPTED
    assert req.num_computed_tokens == 0
    assert req.num_preemptions == 1
    assert req.output_token_ids == [4]  # kept: recomputed with the prompt later
    assert not req.is_finished


# ---------------------------------------------------------------------------
# RequestOutput


def test_request_output_convenience():
    completion = CompletionOutput(
        index=0,
        text="Paris.",
        token_ids=[11, 12],
        cumulative_logprob=-0.5,
        logprobs=[{11: -0.2, 5: -2.0}, {12: -0.3}],
        finish_reason="stop",
        stop_reason=2,
    )
    out = RequestOutput(
        request_id="r1",
        prompt="Capital of France?",
        prompt_token_ids=[1, 2, 3],
        outputs=[completion, CompletionOutput(index=1, text="Lyon", token_ids=[13])],
        finished=True,
        new_token_ids=[12],
        new_text=".",
        num_cached_tokens=2,
        arrival_time=10.0,
        first_token_time=10.25,
        finish_time=11.0,
    )
    assert out.text == "Paris."
    assert out.token_ids == [11, 12]
    assert out.finish_reason == "stop"
    assert out.num_prompt_tokens == 3
    assert out.num_completion_tokens == 3
    assert out.ttft == pytest.approx(0.25)
    assert out.latency == pytest.approx(1.0)
    assert out.error is None
    assert completion.finished and not out.outputs[1].finished


def test_request_output_while_running_and_on_error():
    empty = CompletionOutput(index=0, text="", token_ids=[])
    running = RequestOutput("r", None, [1], [empty], finished=False, arrival_time=1.0)
    assert running.ttft is None and running.latency is None
    assert running.finish_reason is None
    assert running.new_token_ids == [] and running.new_text == ""

    failed = RequestOutput("r", None, [1] * 9, outputs=[], finished=True, error="prompt too long")
    assert (failed.text, failed.token_ids, failed.finish_reason) == ("", [], None)
    assert failed.num_completion_tokens == 0
