"""gpt-oss's Harmony output -> reasoning, content and tool calls, on outputs written as the model
writes them (the openai/harmony format docs): whole, one character at a time and in random
chunkings (hypothesis), which must all give the same result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from factories import split_at
from test_tool_parsers import TOOLS, counter_ids

from vllm_mlx.tool_parsers.base import ChatDelta, assemble
from vllm_mlx.tool_parsers.chat_output import NO_TOOLS, ToolPlan, plan_chat_output
from vllm_mlx.tool_parsers.harmony import HarmonyParser
from vllm_mlx.tool_parsers.registry import select_tool_parser, tool_parser_name, uses_harmony
from vllm_mlx.tool_parsers.tool_choice import ForcedCallStream

ANALYSIS = "<|channel|>analysis<|message|>The user asks about Paris. I should check the weather.<|end|>"
REASONING = "The user asks about Paris. I should check the weather."
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 24 °C.<|return|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}<|call|>'
CALL_FIRST = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
RECIPIENT_FIRST = ' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "Europe/Berlin"}<|call|>'
TIME_CALL = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "Europe/Berlin"}<|call|>'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check the weather first.<|end|>"
PARIS = ("get_weather", {"city": "Paris", "days": 3})
BERLIN_TIME = ("get_time", {"tz": "Europe/Berlin"})


@dataclass
class Case:
    id: str
    text: str
    content: str | None
    reasoning: str | None = None
    calls: list[tuple[str, dict]] = field(default_factory=list)
    tools: list[dict] | None = field(default_factory=lambda: TOOLS)


def unknown(call: str) -> str:
    """A call's text as content: as written, less the marker that ended it."""
    return call.removesuffix("<|call|>")


CASES = [
    Case("analysis-then-final", ANALYSIS + FINAL, "It is sunny in Paris, 24 °C.", REASONING),
    Case("analysis-then-call", ANALYSIS + CALL, None, REASONING, [PARIS]),
    Case("call-first", CALL_FIRST, None, None, [PARIS]),
    Case("recipient-before-channel", RECIPIENT_FIRST, None, None, [BERLIN_TIME]),
    Case("two-calls", ANALYSIS + CALL + TIME_CALL, None, REASONING, [PARIS, BERLIN_TIME]),
    Case("preamble-then-call", ANALYSIS + PREAMBLE + CALL, "Let me check the weather first.", REASONING, [PARIS]),
    Case("final-only", "<|channel|>final<|message|>Hi!<|return|>", "Hi!"),
    Case("final-without-return", "<|channel|>final<|message|>Hi!", "Hi!"),
    Case("cut-off-mid-analysis", "<|channel|>analysis<|message|>Let me think about <b>", None, "Let me think about <b>"),
    Case("cut-off-in-a-header", ANALYSIS + "<|start|>assistant<|channel|>fin", "<|start|>assistant<|channel|>fin", REASONING),
    Case("call-ends-with-end", CALL.replace("<|call|>", "<|end|>"), None, None, [PARIS]),
    Case("any-function-without-tools", CALL_FIRST.replace("get_weather", "book_flight"), None, None,
         [("book_flight", {"city": "Paris", "days": 3})], None),  # fmt: skip
    Case("no-channel", "The capital of France is Paris.\n", "The capital of France is Paris.\n"),
    Case("no-channel-stop-token-at-the-end", "Paris.<|return|>", "Paris."),
    Case("no-channel-marker-like-text", "a <| b <|en and to=x", "a <| b <|en and to=x"),
    Case("markers-dropped-by-the-tokenizer", "analysisThinking.assistantfinalHi.", "analysisThinking.assistantfinalHi."),
    Case("empty", "", None),
    # malformed: content, byte for byte
    Case("unclosed-call", ANALYSIS + CALL[:-12], unknown(CALL[:-12]), REASONING),
    Case("call-cut-by-start", CALL_FIRST[:-8] + FINAL, CALL_FIRST[:-8] + "It is sunny in Paris, 24 °C."),
    Case("bad-json", CALL_FIRST.replace("3}", "3"), unknown(CALL_FIRST.replace("3}", "3"))),
    Case("arguments-not-an-object", CALL_FIRST.replace('{"city": "Paris", "days": 3}', "[1, 2]"),
         unknown(CALL_FIRST.replace('{"city": "Paris", "days": 3}', "[1, 2]"))),  # fmt: skip
    Case("non-finite-number", CALL_FIRST.replace("3}", "NaN}"), unknown(CALL_FIRST.replace("3}", "NaN}"))),
    Case("unknown-function", CALL_FIRST.replace("get_weather", "book_flight"),
         unknown(CALL_FIRST.replace("get_weather", "book_flight"))),  # fmt: skip
    Case("built-in-tool", "<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>",
         '<|channel|>analysis to=browser.search<|message|>{"query": "x"}'),  # fmt: skip
    Case("unknown-channel", "<|channel|>thoughts<|message|>hmm<|end|>", "<|channel|>thoughts<|message|>hmm"),
    Case("text-before-the-channel", "Sure!<|channel|>final<|message|>Hi.<|return|>", "Sure!Hi."),
    Case("stray-markers", "<|end|><|message|>x<|constrain|><|channel|>final<|message|>ok<|end|><|end|>",
         "<|end|><|message|>x<|constrain|>ok"),  # fmt: skip
    Case("no-start-between-messages", ANALYSIS + "<|channel|>final<|message|>Hi.<|return|>", "Hi.", REASONING),
    Case("valid-then-unknown", CALL_FIRST + TIME_CALL.replace("get_time", "nope"),
         unknown(TIME_CALL.replace("get_time", "nope")), None, [PARIS]),  # fmt: skip
    Case("header-with-a-newline", "<|channel|>final\nHi<|message|>x", "<|channel|>final\nHi<|message|>x"),
]


def parser(case: Case) -> HarmonyParser:
    return HarmonyParser(case.tools, counter_ids())


def harmony_deltas(case: Case, chunks: list[str]) -> list[ChatDelta]:
    stream = parser(case).stream()
    return [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_whole_output(case):
    result = parser(case).extract(case.text)
    calls = [(c.name, json.loads(c.arguments)) for c in result.tool_calls]
    assert (result.content, result.reasoning_content, calls) == (case.content, case.reasoning, case.calls)
    assert [c.id for c in result.tool_calls] == [f"call_{i}" for i in range(len(case.calls))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_streamed_in_any_chunking_as_whole(case, cuts):
    """Random chunkings, and one character at a time."""
    whole = parser(case).extract(case.text)
    for chunks in (split_at(case.text, cuts), list(case.text)):
        deltas = harmony_deltas(case, chunks)
        assert assemble(deltas) == whole
        check_harmony_delta_shape(deltas)


def check_harmony_delta_shape(deltas: list[ChatDelta]) -> None:
    """One kind per delta, none empty; a call's first delta has its id and name."""
    seen: list[int] = []
    for delta in deltas:
        parts = [delta.content, delta.reasoning_content, delta.tool_call]
        assert sum(p is not None for p in parts) == 1 and "" not in parts
        if (piece := delta.tool_call) is not None and piece.index not in seen:
            assert piece.index == len(seen) and piece.id and piece.name and piece.arguments == ""
            seen.append(piece.index)


def test_reasoning_and_answer_stream_as_they_come():
    """Only a suffix that could begin a marker waits; a call waits for its end."""
    stream = HarmonyParser(TOOLS).stream()
    assert stream.feed("<|channel|>analysis<|message|>Think") == [ChatDelta(reasoning_content="Think")]
    assert stream.feed("ing <|") == [ChatDelta(reasoning_content="ing ")]
    assert stream.feed("end|><|start|>assistant<|channel|>final<|message|>It is") == [ChatDelta(content="It is")]
    assert stream.feed(" sunny.<|ret") == [ChatDelta(content=" sunny.")]
    assert stream.feed("urn|>") == [] and stream.finish() == []
    stream = HarmonyParser(TOOLS).stream()
    assert stream.feed(CALL_FIRST[:-1]) == []
    assert [d.tool_call.name for d in stream.feed(CALL_FIRST[-1])] == ["get_weather", None]
    assert HarmonyParser().stream().feed("Plain text, no markers ") == [ChatDelta(content="Plain text, no markers ")]


# -- anything a model may write -------------------------------------------------------------------

PIECES = [
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>",
    "<|endoftext|>", "<|", "<|st", "assistant", " to=functions.get_weather", " to=functions.nope", "to=",
    "analysis", "commentary", "final", " json", '{"city": "Paris"}', "[1]", "{", "}", "NaN", "\n", " ", "ok", "é",
]  # fmt: skip
MESSAGES = [ANALYSIS, FINAL, CALL, CALL_FIRST]
OUTPUTS = st.lists(st.one_of(st.sampled_from(PIECES), st.sampled_from(MESSAGES)), max_size=16)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@settings(max_examples=80, deadline=None, derandomize=True)
@given(pieces=OUTPUTS, cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_any_output_parses_without_error_and_streams_the_same(tools, pieces, cuts):
    """Never raises; arguments are strict JSON objects; no ``<|channel|>`` => the text unchanged
    (less a stop token at its end)."""
    text = "".join(pieces)
    case = Case("fuzz", text, None, tools=tools)
    result = parser(case).extract(text)
    for call in result.tool_calls:
        assert isinstance(json.loads(call.arguments, parse_constant=pytest.fail), dict)
    if "<|channel|>" not in text:
        stop_token = pieces and pieces[-1] in ("<|end|>", "<|call|>", "<|return|>", "<|endoftext|>")
        stripped = text.removesuffix(pieces[-1]) if stop_token else text
        assert (result.content, result.reasoning_content, result.tool_calls) == (stripped or None, None, [])
    assert assemble(harmony_deltas(case, split_at(text, cuts))) == result
    assert assemble(harmony_deltas(case, list(text))) == result


# -- choosing Harmony -------------------------------------------------------------------------------

GPT_OSS_TEMPLATE = (
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
    "{#- calls: <|start|>assistant to=functions.x<|channel|>commentary json<|message|>... #}"
)


def test_harmony_is_chosen_from_the_template_or_by_name():
    assert tool_parser_name(GPT_OSS_TEMPLATE) == "harmony" and uses_harmony(GPT_OSS_TEMPLATE)
    assert select_tool_parser(GPT_OSS_TEMPLATE) is None  # no tool parser: a stream of its own
    assert uses_harmony(None, "openai") and uses_harmony(None, "harmony")
    assert not uses_harmony(GPT_OSS_TEMPLATE, "hermes")
    with pytest.raises(ValueError, match="harmony"):
        uses_harmony(None, "harmon")


@pytest.mark.parametrize("tool_choice", [None, "none"])
def test_the_plan_parses_harmony_with_or_without_tools(tool_choice):
    plan = ToolPlan.of(TOOLS, tool_choice)
    chat = plan_chat_output(plan, GPT_OSS_TEMPLATE, "<|start|>assistant", id_factory=counter_ids())
    assert chat.harmony is not None and chat.needs_special_tokens and chat.parses_anything
    result = chat.extract(ANALYSIS + CALL)
    assert result.reasoning_content == REASONING
    if tool_choice == "none":  # the tools were not rendered: a call is content
        assert result.tool_calls == [] and result.content == unknown(CALL)
    else:
        assert [(c.name, c.id) for c in result.tool_calls] == [("get_weather", "call_0")]
    plain = plan_chat_output(NO_TOOLS, GPT_OSS_TEMPLATE, "<|start|>assistant")
    assert plain.extract(ANALYSIS + FINAL).content == "It is sunny in Paris, 24 °C."


def test_forced_calls_keep_the_constrained_stream():
    plan = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    chat = plan_chat_output(plan, GPT_OSS_TEMPLATE, "<|start|>assistant", id_factory=counter_ids())
    assert chat.harmony is None and chat.reasoning is None and not chat.needs_special_tokens
    assert isinstance(chat.stream().calls, ForcedCallStream)
    [call] = chat.extract('{"tz": "UTC"}').tool_calls
    assert (call.name, call.arguments) == ("get_time", '{"tz": "UTC"}')


def test_mistral_needs_special_tokens_and_hermes_does_not():
    plan = ToolPlan.of(TOOLS)
    assert plan_chat_output(plan, None, "", "mistral").needs_special_tokens
    assert not plan_chat_output(plan, None, "", "hermes").needs_special_tokens
