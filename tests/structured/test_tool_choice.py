"""``tool_choice`` planning and the parsing of forced calls (pure Python, no model).

The server tests (test_tool_calling_server.py) run these through the engine; here every
chunking of a forced output is checked against the whole, and every bad ``tools`` /
``tool_choice`` against its message.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import split_at
from vllm_mlx.tool_parsers.chat_output import ChatOutputParser, ToolPlan, assemble, plan_chat_output
from vllm_mlx.tool_parsers.tool_choice import ToolChoice, parse_tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
TOOLS = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

REQUIRED_OUTPUT = '[{"name":"get_weather","parameters":{"city":"Sa\\"o }{ ]["}},{"name":"get_time","parameters":{}}]'
NAMED_OUTPUT = '{"city":"Paris"}'


def parse_stream(parser: ChatOutputParser, chunks: list[str]):
    stream = parser.stream()
    return assemble([d for chunk in chunks for d in stream.feed(chunk)] + stream.finish())


def call_pairs(result) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


@pytest.mark.parametrize(
    "tool_choice, output, expected",
    [
        ("required", REQUIRED_OUTPUT, [("get_weather", {"city": 'Sa"o }{ ]['}), ("get_time", {})]),
        (NAMED, NAMED_OUTPUT, [("get_weather", {"city": "Paris"})]),
    ],
    ids=["required", "named"],
)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_forced_outputs_parse_the_same_in_any_chunking(tool_choice, output, expected, cuts):
    parser = plan_chat_output(ToolPlan.of(TOOLS, tool_choice), None, "")
    whole = parser.extract(output)
    assert call_pairs(whole) == expected and whole.content is None
    assert call_pairs(parse_stream(parser, split_at(output, cuts))) == expected
    assert call_pairs(parse_stream(parser, list(output))) == expected


def test_a_named_call_streams_its_arguments_as_they_are_written():
    stream = plan_chat_output(ToolPlan.of(TOOLS, NAMED), None, "").stream()
    first = stream.feed('{"ci')
    assert first[0].tool_call.name == "get_weather" and first[0].tool_call.id.startswith("call_")
    assert first[1].tool_call.arguments == '{"ci'


def test_required_sends_each_call_once_its_element_is_complete():
    stream = plan_chat_output(ToolPlan.of(TOOLS, "required"), None, "").stream()
    assert stream.feed('[{"name":"get_time","parameters":{') == []
    sent = stream.feed("}},")
    assert [d.tool_call.name for d in sent if d.tool_call.name] == ["get_time"]


def test_forced_constraints_validate_exactly_the_calls_they_should():
    required = ToolPlan.of(TOOLS, "required").constraint
    schema = required.json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = ToolPlan.of(TOOLS, "required", parallel_tool_calls=False).constraint.json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    assert ToolPlan.of(TOOLS, NAMED).constraint.json == {**WEATHER["function"]["parameters"], "additionalProperties": False}
    assert ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}).constraint.json == {"type": "object"}
    assert required.disable_any_whitespace  # a weak model cannot pad a forced call with newlines
    assert ToolPlan.of(TOOLS, "auto").constraint is None and ToolPlan.of(TOOLS, "none").template_tools is None


def test_a_required_call_cut_after_its_name_is_still_a_call():
    """``max_tokens`` cut a forced output: its first call, once named, is answered with what was
    written of its arguments (as a cut named call is); a later unfinished call is left out."""
    parser = plan_chat_output(ToolPlan.of(TOOLS, "required"), None, "")
    cut = '[{"name":"get_weather","parameters":{"ci'
    [call] = parser.extract(cut).tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"ci') and call.id.startswith("call_")
    assert [(c.name, c.arguments) for c in parse_stream(parser, list(cut)).tool_calls] == [("get_weather", '{"ci')]
    assert parser.extract('[{"name":"get_w').tool_calls == []  # not even a name
    done_then_cut = '[{"name":"get_time","parameters":{}},{"name":"get_weather","par'
    assert [c.name for c in parser.extract(done_then_cut).tool_calls] == ["get_time"]


def test_forced_calls_take_only_the_listed_properties_unless_the_schema_says_otherwise():
    """A schema that lists properties and is silent on others (LangChain's ``@tool``) is closed
    for a forced call; one that allows others keeps them."""
    closed = ToolPlan.of(TOOLS, NAMED).constraint.json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Oslo", "unit": "C"}, closed)
    parameters = {**WEATHER["function"]["parameters"], "additionalProperties": True}
    open_tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    assert ToolPlan.of([open_tool], NAMED).constraint.json["additionalProperties"] is True


def test_defaults_follow_openai():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    assert parse_tool_choice("none", None) == ToolChoice("none")


@pytest.mark.parametrize(
    "tools, tool_choice, message",
    [
        ({"type": "function"}, None, "must be a list"),
        ([{"type": "retrieval"}], None, "'type': 'function'"),
        ([{"type": "function", "function": {"name": ""}}], None, "non-empty string"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "JSON Schema object"),
        ([WEATHER, WEATHER], None, "given twice"),
        (TOOLS, "always", "must be one of"),
        (TOOLS, {"type": "function", "function": {}}, "non-empty string"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (None, "required", "needs tools"),
        (TOOLS, 3, "must be"),
    ],
)
def test_bad_tools_and_choices_say_what_is_wrong(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        ToolPlan.of(tools, tool_choice)


def test_auto_needs_a_known_format_and_finish_reasons_follow_openai():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        plan_chat_output(ToolPlan.of(TOOLS), chat_template="{{ messages }}", prompt_tail="")
    auto = plan_chat_output(ToolPlan.of(TOOLS), chat_template="<tool_call>", prompt_tail="")
    assert auto.finish_reason("stop", 1) == "tool_calls" and auto.finish_reason("length", 1) == "length"
    named = plan_chat_output(ToolPlan.of(TOOLS, NAMED), None, "")
    assert named.finish_reason("stop", 1) == "stop"


def test_reasoning_is_split_before_forced_calls_only_when_the_engine_gates_it():
    template = "<think>"
    gated = plan_chat_output(ToolPlan.of(TOOLS, NAMED), template, "<think>\n", constraints_follow_reasoning=True)
    result = gated.extract('Paris it is.</think>{"city":"Paris"}')
    assert result.reasoning_content == "Paris it is." and call_pairs(result) == [("get_weather", {"city": "Paris"})]
    ungated = plan_chat_output(ToolPlan.of(TOOLS, NAMED), template, "<think>\n")
    assert call_pairs(ungated.extract(NAMED_OUTPUT)) == [("get_weather", {"city": "Paris"})]
