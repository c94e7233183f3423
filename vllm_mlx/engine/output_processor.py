"""Output processing: each step's new tokens become the callers' ``RequestOutput``s.

``OutputProcessor`` owns the per-request output state: one ``_Group`` per caller's request, one
``_Completion`` per sequence of it (``n`` of them). Each step it detokenizes the completions that
advanced, applies stop strings, records logprobs, and builds one ``RequestOutput`` per group
that changed (the ``n`` completions fanned back into one output).

Invariants:

* a group lives from ``add`` until its final output (``finished=True``) is built, then is
  forgotten; every caller's request gets exactly one final output;
* a stop string ends its request in the scheduler at once (``finish_request``), in the step that
  produced it, so its blocks are freed before the next schedule;
* a failure while processing one completion's output ends that request alone with an error;
  the others, and the engine, go on.

Runs on the engine thread (it reads the requests the scheduler updates); no MLX.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_mlx.core.outputs import ModelRunnerOutput, TokenLogprobs
from vllm_mlx.core.request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus
from vllm_mlx.engine.detokenizer import IncrementalDetokenizer
from vllm_mlx.platform.errors import internal_error_message

if TYPE_CHECKING:
    from vllm_mlx.engine.input_processor import ProcessedRequest

logger = logging.getLogger(__name__)

FinishRequest = Callable[[str, RequestStatus, str | None], object]
"""``Scheduler.finish_request``: ends a request from outside and frees its blocks."""


@dataclass
class _Completion:
    """Engine-side state of one sequence (one of a request's ``n`` completions)."""

    group_id: str
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    num_detokenized: int = 0
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def completion_output(self) -> CompletionOutput:
        r = self.request
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(r.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
        )


@dataclass
class _Group:
    """A caller's request: ``n`` completions that share one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.completions)


class OutputProcessor:
    """Turns advanced requests into ``RequestOutput``s, one per caller's request.

    Args:
        tokenizer: Decodes the completions' tokens.
        finish_request: Ends a request in the scheduler (a stop string matched, or its output
            processing failed).
    """

    def __init__(self, tokenizer: Any, finish_request: FinishRequest) -> None:
        self.tokenizer = tokenizer
        self.finish_request = finish_request
        self._groups: dict[str, _Group] = {}
        self._completion_of: dict[str, _Completion] = {}  # by the completion's request id
        self._pending: list[RequestOutput] = []  # final outputs made between steps

    # -- groups in and out -------------------------------------------------------------------

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    @property
    def group_ids(self) -> list[str]:
        """The caller's requests that have not had their final output yet."""
        return list(self._groups)

    def add(self, processed: ProcessedRequest) -> None:
        """Track a caller's request: one completion (detokenizer, logprobs) per ``Request``."""
        params = processed.params
        group = _Group(processed.request_id, processed.prompt, processed.prompt_token_ids)
        for index, request in enumerate(processed.requests):
            completion = _Completion(
                processed.request_id, request, index,
                IncrementalDetokenizer(
                    self.tokenizer, processed.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )  # fmt: skip
            group.completions.append(completion)
            self._completion_of[request.request_id] = completion
        self._groups[processed.request_id] = group

    def requests(self, group_id: str) -> list[Request] | None:
        """The requests of a caller's request (leader first), or None when it is unknown."""
        group = self._groups.get(group_id)
        return None if group is None else [c.request for c in group.completions]

    def finish_if_done(self, group_id: str) -> None:
        """If every completion of the group has finished (e.g. refused at admission, aborted),
        queue its final output for the next ``take_pending``."""
        group = self._groups.get(group_id)
        if group is not None and group.finished:
            self._pending.append(self._finish_group(group))

    def take_pending(self) -> list[RequestOutput]:
        """The final outputs made between steps (refused or aborted requests), oldest first."""
        outputs, self._pending = self._pending, []
        return outputs

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    # -- one step ----------------------------------------------------------------------------

    def process(self, advanced: Iterable[Request], runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Absorb the step's new tokens of ``advanced`` (the scheduler's update result); one
        output per group that changed, in the order the groups first advanced."""
        touched: dict[str, None] = {}
        for request in advanced:
            completion = self._completion_of.get(request.request_id)
            if completion is None:
                continue
            try:
                self._absorb(completion, runner_output.new_logprobs(request.request_id))
            except Exception as exc:  # this completion's text processing failed: it ends alone
                self._fail_request(request, exc, "processing its output")
            touched[completion.group_id] = None
        outputs = []
        for group_id in touched:
            group = self._groups.get(group_id)
            if group is not None:
                outputs.append(self._finish_group(group) if group.finished else self._group_output(group))
        return outputs

    def _absorb(self, completion: _Completion, logprobs: list[TokenLogprobs | None]) -> None:
        """Detokenize the completion's new tokens, apply stop strings, record logprobs (one per
        new token: a step that kept proposed tokens brings several).

        The token that stopped the completion (EOS or one of ``stop_token_ids``) stays in
        ``token_ids`` but is not text, as in vLLM: with ``skip_special_tokens=False`` (tool-call
        formats whose markers are special tokens) it would otherwise end every answer."""
        request = completion.request
        new_tokens = request.output_token_ids[completion.num_detokenized :]
        self._record_logprobs(completion, logprobs[: len(new_tokens)])
        if new_tokens and _stopped_by_token(request):
            new_tokens = new_tokens[:-1]
        completion.detokenizer.add_tokens(new_tokens)
        completion.num_detokenized = request.num_output_tokens
        if completion.detokenizer.stop_string is not None and not request.is_finished:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, completion.detokenizer.stop_string)
        if request.is_finished and completion.detokenizer.stop_string is None:
            completion.detokenizer.finish()

    @staticmethod
    def _record_logprobs(completion: _Completion, logprobs: list[TokenLogprobs | None]) -> None:
        if completion.logprobs is None:
            return
        for record in logprobs:
            if record is not None:
                completion.logprobs.append({record.token_id: record.logprob, **record.top})
                completion.cumulative_logprob += record.logprob

    def _fail_request(self, request: Request, exc: Exception, doing: str) -> None:
        """End ``request`` with an error after an unexpected exception; log the traceback."""
        logger.error("request %s failed while %s", request.request_id, doing, exc_info=exc)
        if not request.is_finished:
            message = internal_error_message(exc)
            self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, message)

    # -- building outputs --------------------------------------------------------------------

    def _group_output(self, group: _Group) -> RequestOutput:
        first = group.completions[0]
        outputs = [c.completion_output() for c in group.completions]
        new_ids = first.request.output_token_ids[first.num_sent_tokens :]
        new_text = first.detokenizer.text[first.num_sent_chars :]
        for c in group.completions:
            c.num_sent_tokens = c.request.num_output_tokens
            c.num_sent_chars = len(c.detokenizer.text)
        r = first.request
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.finished,
            new_token_ids=new_ids,
            new_text=new_text,
            num_cached_tokens=r.num_cached_tokens,
            arrival_time=r.arrival_time,
            first_token_time=r.first_token_time,
            finish_time=max((c.request.finish_time or 0.0) for c in group.completions) or None,
            error=next((c.request.error_message for c in group.completions if c.request.error_message), None),
            metrics=RequestMetrics(
                num_draft_tokens=sum(c.request.num_draft_tokens for c in group.completions),
                num_accepted_tokens=sum(c.request.num_accepted_tokens for c in group.completions),
                num_disk_tokens=min(r.num_disk_tokens, r.num_cached_tokens),
            ),
        )

    def _finish_group(self, group: _Group) -> RequestOutput:
        """The final output of a group; forgets the group."""
        for completion in group.completions:
            if completion.detokenizer.stop_string is None:
                completion.detokenizer.finish()
            self._completion_of.pop(completion.request.request_id, None)
        self._groups.pop(group.request_id, None)
        return self._group_output(group)


def _stopped_by_token(request: Request) -> bool:
    """The request ended on its last token being EOS or a stop token id (not a stop string)."""
    return request.status == RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)
