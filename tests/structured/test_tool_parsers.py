"""Tool-call and reasoning parsers on outputs written as the models write them.

For every case: the non-streamed result is the expected one, and streaming the same text in
random chunkings (hypothesis), one character at a time, and whole, reassembles to exactly it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import split_at
from vllm_mlx.tool_parsers import (
    TOOL_PARSERS,
    ReasoningParser,
    StreamDelta,
    ToolCallResult,
    reassemble,
    select_reasoning_parser,
    select_tool_parser,
    tool_parser_name,
)


def tool(name: str, **properties: dict) -> dict:
    schema = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    tool("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
    tool("get_time", tz={"type": "string"}),
    tool(
        "write_file",
        path={"type": "string"},
        content={"type": "string"},
        mode={"type": ["integer", "null"]},
        ratio={"type": "number"},
        tags={"type": "array"},
        options={"type": "object"},
        flag={"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    ),
]


@dataclass
class Case:
    id: str
    parser: str
    text: str
    content: str | None
    calls: list[tuple[str, dict]] = field(default_factory=list)
    tools: list[dict] | None = None


def counter_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def make_parser(case: Case):
    return TOOL_PARSERS[case.parser](case.tools, counter_ids())


HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
HERMES_TWO = HERMES_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Berlin"}}\n</tool_call>'
HERMES_UNKNOWN = '<tool_call>\n{"name": "book_flight", "arguments": {"to": "Rome"}}\n</tool_call>'
PARIS = ("get_weather", {"city": "Paris", "days": 3})
BERLIN_TIME = ("get_time", {"tz": "Europe/Berlin"})

CODER_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)
CODER_FILE = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n</parameter>\n"
    "<parameter=content>\ndef main():\n    print(\"héllo <world>\")\n\n</parameter>\n"
    "<parameter=mode>\n420\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=options>\n{"force": true}\n</parameter>\n'
    "<parameter=flag>\nnull\n</parameter>\n</function>\n</tool_call>"
)

LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {"tz": "Europe/Berlin"}}'

CASES = [
    # Hermes / Qwen2.5 / Qwen3
    Case("hermes-one", "hermes", HERMES_ONE, None, [PARIS]),
    Case("hermes-two", "hermes", HERMES_TWO, None, [PARIS, BERLIN_TIME], TOOLS),
    Case(
        "hermes-text-before", "hermes",
        "I'll check the weather in Paris and the time in Berlin.\n\n" + HERMES_TWO,
        "I'll check the weather in Paris and the time in Berlin.", [PARIS, BERLIN_TIME],
    ),  # fmt: skip
    Case(
        "hermes-text-between", "hermes", "First Paris.\n\n" + HERMES_ONE + "\nThen Berlin:\n" + HERMES_TWO[len(HERMES_ONE) :] + "\n",
        "First Paris.\n\nThen Berlin:", [PARIS, BERLIN_TIME],
    ),  # fmt: skip
    Case("hermes-text-after", "hermes", HERMES_ONE + "\n\nI'll report back.  ", "I'll report back.  ", [PARIS]),
    Case(
        "hermes-unicode-and-string-arguments", "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}\n</tool_call>',
        None, [("get_weather", {"city": "Zürich"})],
    ),  # fmt: skip
    Case(
        "hermes-parameters-key", "hermes", '<tool_call>{"name": "get_time", "parameters": {"tz": "Europe/Berlin"}}</tool_call>',
        None, [BERLIN_TIME],
    ),  # fmt: skip
    Case("hermes-no-call", "hermes", "The capital of France is Paris.\n", "The capital of France is Paris.\n"),
    Case("hermes-marker-prefix-in-text", "hermes", "Wrap it in <tool> or <tool_", "Wrap it in <tool> or <tool_"),
    Case("hermes-broken-json", "hermes", HERMES_ONE.replace("3}}", "3}"), HERMES_ONE.replace("3}}", "3}")),
    Case("hermes-unclosed", "hermes", "Sure.\n" + HERMES_ONE[:-12], "Sure.\n" + HERMES_ONE[:-12]),
    Case("hermes-no-name", "hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
    Case("hermes-unknown-function", "hermes", HERMES_UNKNOWN, HERMES_UNKNOWN, [], TOOLS),
    Case("hermes-valid-then-unknown", "hermes", HERMES_ONE + "\n" + HERMES_UNKNOWN, HERMES_UNKNOWN, [PARIS], TOOLS),
    Case("hermes-empty", "hermes", "", None),
    # Qwen3-Coder XML
    Case(
        "coder-typed", "qwen3_coder", CODER_WEATHER, None,
        [("get_weather", {"city": "Paris", "days": 3, "metric": True})], TOOLS,
    ),  # fmt: skip
    Case(
        "coder-untyped", "qwen3_coder", CODER_WEATHER, None,
        [("get_weather", {"city": "Paris", "days": "3", "metric": "true"})],
    ),  # fmt: skip
    Case(
        "coder-file-text-before", "qwen3_coder", "I'll create the file.\n" + CODER_FILE, "I'll create the file.",
        [("write_file", {
            "path": "src/app.py", "content": 'def main():\n    print("héllo <world>")\n', "mode": 420,
            "ratio": 0.5, "tags": ["a", "b"], "options": {"force": True}, "flag": None,
        })], TOOLS,
    ),  # fmt: skip
    Case(
        "coder-two-calls", "qwen3_coder", CODER_WEATHER + "\n" + CODER_WEATHER.replace("Paris", "Lyon"), None,
        [("get_weather", {"city": c, "days": 3, "metric": True}) for c in ("Paris", "Lyon")], TOOLS,
    ),  # fmt: skip
    Case(
        "coder-unconvertible-stays-string", "qwen3_coder", CODER_WEATHER.replace("\n3\n", "\nthree\n"), None,
        [("get_weather", {"city": "Paris", "days": "three", "metric": True})], TOOLS,
    ),  # fmt: skip
    Case("coder-unknown-function", "qwen3_coder", CODER_WEATHER.replace("get_weather", "get_news"),
         CODER_WEATHER.replace("get_weather", "get_news"), [], TOOLS),  # fmt: skip
    Case("coder-no-function-close", "qwen3_coder", CODER_WEATHER.replace("</function>", ""),
         CODER_WEATHER.replace("</function>", "")),  # fmt: skip
    Case("coder-unclosed", "qwen3_coder", CODER_WEATHER[:-20], CODER_WEATHER[:-20]),
    # Llama 3.x JSON
    Case("llama-python-tag", "llama3_json", "<|python_tag|>" + LLAMA_WEATHER, None, [PARIS]),
    Case("llama-bare", "llama3_json", " " + LLAMA_WEATHER + "\n", None, [PARIS]),
    Case(
        "llama-3.2-type-function", "llama3_json",
        '{"type": "function", "name": "get_time", "parameters": {"tz": "Europe/Berlin"}}', None, [BERLIN_TIME],
    ),  # fmt: skip
    Case("llama-two", "llama3_json", LLAMA_WEATHER + "; " + LLAMA_TIME, None, [PARIS, BERLIN_TIME], TOOLS),
    Case("llama-text-before-tag", "llama3_json", "Let me look.\n<|python_tag|>" + LLAMA_WEATHER, "Let me look.", [PARIS]),
    Case(
        "llama-partial-list-keeps-valid", "llama3_json",
        LLAMA_WEATHER + ";" + LLAMA_TIME.replace("get_time", "get_stock"), None, [PARIS], TOOLS,
    ),  # fmt: skip
    Case("llama-broken", "llama3_json", LLAMA_WEATHER[:-3], LLAMA_WEATHER[:-3]),
    Case("llama-json-answer", "llama3_json", '{"answer": 42}', '{"answer": 42}'),
    Case("llama-code-not-json", "llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)"),
    Case("llama-plain", "llama3_json", "Paris is the capital. {Not JSON}", "Paris is the capital. {Not JSON}"),
    Case("llama-brace-text", "llama3_json", "{curly} braces", "{curly} braces"),
    # Mistral
    Case(
        "mistral-list", "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Berlin"}}]', None, [PARIS, BERLIN_TIME],
    ),  # fmt: skip
    Case(
        "mistral-list-partial", "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_stock"}, 7]',
        None, [PARIS], TOOLS,
    ),  # fmt: skip
    Case("mistral-list-broken", "mistral", '[TOOL_CALLS] [{"name": "get_weather", "argu',
         '[TOOL_CALLS] [{"name": "get_weather", "argu'),  # fmt: skip
    Case(
        "mistral-args-form", "mistral",
        'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Berlin"}', "Checking both.", [PARIS, BERLIN_TIME], TOOLS,
    ),  # fmt: skip
    Case("mistral-call-id-form", "mistral", '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Europe/Berlin"}',
         None, [BERLIN_TIME]),  # fmt: skip
    Case(
        "mistral-args-second-broken", "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"tz": ',
        '[TOOL_CALLS]get_time[ARGS]{"tz": ', [PARIS],
    ),  # fmt: skip
    Case("mistral-no-call", "mistral", "Bonjour ! [TOOL] n'est pas [TOOL_CALL", "Bonjour ! [TOOL] n'est pas [TOOL_CALL"),
]


def expected_result(case: Case) -> tuple[str | None, list[tuple[str, dict]]]:
    return case.content, case.calls


def observed(result: ToolCallResult) -> tuple[str | None, list[tuple[str, dict]]]:
    return result.content, [(call.name, json.loads(call.arguments)) for call in result.tool_calls]


def stream_chunks(case: Case, chunks: list[str]) -> list[StreamDelta]:
    stream = make_parser(case).stream()
    deltas = [d for chunk in chunks for d in stream.feed(chunk)]
    return deltas + stream.finish()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_whole_output(case):
    result = make_parser(case).extract(case.text)
    assert observed(result) == expected_result(case)
    assert [call.id for call in result.tool_calls] == [f"call_{i}" for i in range(len(case.calls))]
    for call in result.tool_calls:  # OpenAI's shape: a JSON object as a string
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_character_at_a_time(case):
    deltas = stream_chunks(case, list(case.text))
    assert reassemble(deltas) == make_parser(case).extract(case.text)
    check_delta_shape(deltas)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_random_chunkings(case, cuts):
    deltas = stream_chunks(case, split_at(case.text, cuts))
    assert reassemble(deltas) == make_parser(case).extract(case.text)
    check_delta_shape(deltas)


def check_delta_shape(deltas: list[StreamDelta]) -> None:
    """Each call: one delta with index, id and name, then argument fragments; indices in order."""
    seen: list[int] = []
    for delta in deltas:
        assert (delta.content is None) != (delta.tool_call is None)
        assert delta.content != ""
        if delta.tool_call is None:
            continue
        piece = delta.tool_call
        if piece.index not in seen:
            assert piece.index == len(seen) and piece.id and piece.name and piece.arguments == ""
            seen.append(piece.index)
        else:
            assert piece.index == seen[-1] and piece.id is None and piece.name is None


def test_content_streams_before_the_output_ends():
    """Content goes out as it comes; only a possible marker start and trailing spaces wait."""
    stream = TOOL_PARSERS["hermes"]().stream()
    assert [d.content for d in stream.feed("Let me check ")] == ["Let me check"]
    assert [d.content for d in stream.feed("the weather.\n<tool_")] == [" the weather."]
    assert stream.feed('call>{"name": "get_weather", "arguments": {}}') == []
    [first, arguments] = stream.feed("</tool_call>")
    assert (first.tool_call.index, first.tool_call.name) == (0, "get_weather")
    assert arguments.tool_call.arguments == "{}"
    assert stream.finish() == []


def test_mistral_ids_are_nine_alphanumerics():
    [call] = TOOL_PARSERS["mistral"]().extract('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}').tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_default_ids_are_unique_openai_style():
    calls = TOOL_PARSERS["hermes"]().extract(HERMES_TWO).tool_calls
    assert all(call.id.startswith("call_") for call in calls) and calls[0].id != calls[1].id


# -- selection ----------------------------------------------------------------------------------

QWEN25_TEMPLATE = (
    "{%- if tools %}# Tools\n<tools>{{ tool | tojson }}</tools>\nFor each function call, return a json object "
    'with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>{%- endif %}'
)
QWEN3_CODER_TEMPLATE = (
    "<tools>{{ tool }}</tools>\nIf you choose to call a function ONLY reply in the following format:\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call>"
)
MISTRAL_TEMPLATE = "[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' + calls|tojson }}"
LLAMA31_TEMPLATE = "{{- 'Environment: ipython\\n' }}{{- '<|python_tag|>' + tool_call.name }}<|eom_id|>"
LLAMA32_TEMPLATE = "<|start_header_id|>ipython<|end_header_id|>\\n\\n{{ message.content | tojson }}<|eot_id|>"
CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    ("template", "name"),
    [
        (QWEN25_TEMPLATE, "hermes"),
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
        (MISTRAL_TEMPLATE, "mistral"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_TEMPLATE, "llama3_json"),
        (CHATML_TEMPLATE, None),
        (None, None),
    ],
)
def test_select_from_template(template, name):
    assert tool_parser_name(template) == name
    parser = select_tool_parser(template)
    assert (parser.name if parser else None) == name


def test_select_by_name_overrides_template_and_takes_tools():
    parser = select_tool_parser(QWEN25_TEMPLATE, "mistral", tools=TOOLS)
    assert parser.name == "mistral"
    assert parser.extract("[TOOL_CALLS]get_news[ARGS]{}").tool_calls == []
    assert select_tool_parser(None, "qwen").name == "hermes"


def test_unknown_name_is_an_error_that_lists_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        select_tool_parser(QWEN25_TEMPLATE, "hermess")


# -- reasoning ----------------------------------------------------------------------------------


@dataclass
class ReasoningCase:
    id: str
    text: str
    reasoning: str | None
    content: str | None
    starts_in_reasoning: bool = False


REASONING_CASES = [
    ReasoningCase("qwen3", "<think>\nThe user asks for France's capital.\n</think>\n\nParis.",
                  "\nThe user asks for France's capital.\n", "Paris."),  # fmt: skip
    ReasoningCase("r1-prompt-opened", "Okay, the capital is Paris.\n</think>\n\nParis.",
                  "Okay, the capital is Paris.\n", "Paris.", True),  # fmt: skip
    ReasoningCase("prompt-opened-tag-repeated", "<think>\nhm\n</think>Paris.", "\nhm\n", "Paris.", True),
    ReasoningCase("cut-while-thinking", "<think>\nLet me think about thi", "\nLet me think about thi", None),
    ReasoningCase("prompt-opened-cut", "Let me think", "Let me think", None, True),
    ReasoningCase("no-reasoning", "Paris is the capital.", None, "Paris is the capital."),
    ReasoningCase("stray-end-tag-is-content", "Use </think> to stop.", None, "Use </think> to stop."),
    ReasoningCase("empty-thoughts", "<think>\n\n</think>\n\nParis.", "\n\n", "Paris."),
    ReasoningCase("tag-prefix-only", "<thi", None, "<thi"),
    ReasoningCase("empty", "", None, None, True),
    ReasoningCase(
        "then-tool-call", "<think>\nNeed weather.\n</think>\n\n" + HERMES_ONE, "\nNeed weather.\n", HERMES_ONE,
    ),  # fmt: skip
]


def reasoning_stream(case: ReasoningCase, chunks: list[str]) -> tuple[str | None, str | None]:
    stream = ReasoningParser(case.starts_in_reasoning).stream()
    deltas = [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()
    assert all((d.reasoning_content is None) != (d.content is None) for d in deltas)
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning or None, content or None


@pytest.mark.parametrize("case", REASONING_CASES, ids=lambda c: c.id)
def test_reasoning_whole_and_streamed(case):
    result = ReasoningParser(case.starts_in_reasoning).extract(case.text)
    assert (result.reasoning_content, result.content) == (case.reasoning, case.content)
    assert reasoning_stream(case, list(case.text)) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", REASONING_CASES, ids=lambda c: c.id)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_reasoning_random_chunkings(case, cuts):
    assert reasoning_stream(case, split_at(case.text, cuts)) == (case.reasoning, case.content)


def test_reasoning_then_tool_calls_streamed():
    """The server's order: reasoning first, its content deltas then go through the tool parser."""
    text = "<think>\nI need both.\n</think>\n\nOn it.\n" + HERMES_TWO
    reasoning = ReasoningParser().stream()
    tools = TOOL_PARSERS["hermes"](TOOLS, counter_ids()).stream()
    thoughts, deltas = "", []
    for char in text:
        for piece in reasoning.feed(char):
            thoughts += piece.reasoning_content or ""
            deltas += tools.feed(piece.content or "")
    for piece in reasoning.finish():
        deltas += tools.feed(piece.content or "")
    result = reassemble(deltas + tools.finish())
    assert thoughts == "\nI need both.\n"
    assert observed(result) == ("On it.", [PARIS, BERLIN_TIME])


def test_select_reasoning_parser():
    template = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert select_reasoning_parser(CHATML_TEMPLATE) is None
    assert select_reasoning_parser(template, "<|im_start|>assistant\n").starts_in_reasoning is False
    assert select_reasoning_parser(template, "<|im_start|>assistant\n<think>\n").starts_in_reasoning is True


# -- anything a model may write -------------------------------------------------------------------

PIECES = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>",
    "<function=get_weather>", "<function=nope>", "</function>", "<parameter=days>", "<parameter=city>",
    "</parameter>", '{"name": "get_weather", "arguments": {"days": 3}}', '"parameters": {}}',
    '{"name": "get_time"', "{", "}", "[", "]", ":", ",", ";", '"', "NaN", "3", "true", "Paris",
    "\n", " ", "ok", "é", "<think>", "</think>",
]  # fmt: skip
WHOLE_CALLS = [
    HERMES_ONE, CODER_WEATHER, LLAMA_WEATHER, "<|python_tag|>" + LLAMA_TIME, '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "nope"}]',
]  # fmt: skip
OUTPUTS = st.lists(st.one_of(st.sampled_from(PIECES), st.sampled_from(WHOLE_CALLS)), max_size=16).map("".join)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@settings(max_examples=60, deadline=None, derandomize=True)
@given(text=OUTPUTS, cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_any_output_parses_without_error_and_streams_the_same(name, tools, text, cuts):
    """Never raises; arguments are strict JSON objects; no call => the text, unchanged."""
    case = Case("fuzz", name, text, None, tools=tools)
    result = make_parser(case).extract(text)
    for call in result.tool_calls:
        assert isinstance(json.loads(call.arguments, parse_constant=pytest.fail), dict)
    if not result.tool_calls:
        assert result.content == (text or None)
    assert reassemble(stream_chunks(case, split_at(text, cuts))) == result
    assert reassemble(stream_chunks(case, list(text))) == result


@settings(max_examples=60, deadline=None, derandomize=True)
@given(text=OUTPUTS, cuts=st.lists(st.integers(0, 10_000), max_size=8), opened=st.booleans())
def test_any_output_splits_into_reasoning_the_same_streamed(text, cuts, opened):
    case = ReasoningCase("fuzz", text, None, None, opened)
    result = ReasoningParser(opened).extract(text)
    expected_result = (result.reasoning_content, result.content)
    assert reasoning_stream(case, split_at(text, cuts)) == expected_result
    assert reasoning_stream(case, list(text)) == expected_result


def test_non_finite_numbers_are_not_arguments():
    text = '<tool_call>{"name": "get_weather", "arguments": {"days": NaN}}</tool_call>'
    assert TOOL_PARSERS["hermes"]().extract(text) == ToolCallResult(text, [])


def test_a_long_argument_streams_in_linear_time():
    """A region's end is searched only in new text: a 200 kB file a few characters at a time."""
    content = "x = 1\n" * 40_000
    text = f"<tool_call>\n<function=write_file>\n<parameter=content>\n{content}</parameter>\n</function>\n</tool_call>"
    stream = TOOL_PARSERS["qwen3_coder"](TOOLS).stream()
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])] + stream.finish()
    assert json.loads(reassemble(deltas).tool_calls[0].arguments) == {"content": content[:-1]}
