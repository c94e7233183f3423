"""Tool calling and reasoning through the OpenAI server, live on 127.0.0.1, with the official client.

The model is a tiny random-weight llama whose chat template renders tools Hermes/Qwen style
(``<tools>`` in the system turn, ``<tool_call>`` JSON for calls, ``<tool_response>`` for results).
A random model never calls a tool by itself, which is the point for ``required`` and named
functions: the calls must come from the constraint, not from luck. ``auto`` parsing is exercised
by forcing the model's native markup with a regex (``structured_outputs``), so the real parser
runs on real engine output; reasoning likewise with a ``<think>`` template.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import jsonschema  # noqa: E402

from tool_models import HERMES_CALL, MODEL, SCHEMAS, TOOLS, WEATHER, openai_client, serving, with_template  # noqa: E402

from vllm_mlx.engine.chat import template_token_ids  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(tools_model_dir):
    with serving(tools_model_dir) as (_, live):
        yield openai_client(live)


def ask(client, content: str = "What is the weather in Oslo?", **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 64, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kwargs):
    """Reassemble a streamed answer as a client does: content, reasoning and tool calls."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in ask(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def as_dicts(calls) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


def test_the_template_renders_tools_and_earlier_calls_as_objects(tools_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tools_model_dir)
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}},
        ]},  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    text = tokenizer.decode(template_token_ids(tokenizer, messages, tools=TOOLS))
    assert '"name": "get_weather"' in text and '"description": "The weather in a city."' in text
    assert '"arguments": {"city": "Rome", "days": 1}' in text  # an object, not a quoted string
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text


def test_required_is_enforced_and_every_call_validates(client):
    response = ask(client, tool_choice="required", tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        check_call(call)


def test_required_without_parallel_calls_makes_exactly_one(client):
    response = ask(client, tool_choice="required", tools=TOOLS, parallel_tool_calls=False)
    [call] = response.choices[0].message.tool_calls
    check_call(call)


def test_a_named_function_is_called_with_valid_arguments(client):
    for name in ("get_time", "get_weather"):
        response = ask(client, tool_choice={"type": "function", "function": {"name": name}}, tools=TOOLS)
        choice = response.choices[0]
        [call] = choice.message.tool_calls
        assert call.function.name == name and choice.finish_reason == "stop"
        check_call(call)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(client, tool_choice):
    whole = ask(client, tool_choice=tool_choice, tools=TOOLS).choices[0]
    content, _, calls, finish = streamed(client, tool_choice=tool_choice, tools=TOOLS)
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == as_dicts(whole.message.tool_calls)
    assert all(c["id"].startswith("call_") for c in calls)
    assert content == "" and finish == whole.finish_reason


def test_auto_parses_the_models_own_call_markup(client):
    force = {"structured_outputs": {"regex": "Let me check\\.\n\n" + HERMES_CALL.replace("{", "\\{").replace("}", "\\}")}}
    whole = ask(client, tools=TOOLS, extra_body=force).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Let me check."
    assert as_dicts(whole.message.tool_calls) == [
        {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}
    ]
    content, _, calls, finish = streamed(client, tools=TOOLS, extra_body=force)
    assert content == "Let me check." and finish == "tool_calls"
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == as_dicts(whole.message.tool_calls)


def test_tool_choice_none_answers_with_text_and_leaves_markup_alone(client):
    force = {"structured_outputs": {"regex": HERMES_CALL.replace("{", "\\{").replace("}", "\\}")}}
    choice = ask(client, tools=TOOLS, tool_choice="none", extra_body=force).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == HERMES_CALL
    assert choice.finish_reason == "stop"


def test_a_conversation_with_tool_results_goes_on(client):
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}},
        ]},  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice", "not in tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice", "must be one of"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400s_that_say_why(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, **kwargs)
    error = info.value.body
    assert error["param"] == param and message in error["message"]


def test_a_template_without_tools_gets_them_in_the_system_message(tiny_model_dir, tmp_path):
    """SmolLM2's own template renders no tools: they are described in the system message,
    ``auto`` (what a client that omits ``tool_choice`` gets) reads the calls in that format, and a
    conversation with an earlier call and its result renders, with or without tools on the
    turn. A template that renders tools in a format not known here still says how to fix it."""
    import httpx

    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with serving(tiny_model_dir) as (_, live):
        client = openai_client(live)
        counts = [httpx.post(live.url + "/tokenize", json={"messages": question, **extra}).json()["count"]
                  for extra in ({}, {"tools": TOOLS})]  # fmt: skip
        assert counts[1] > counts[0] + 50  # the tools reached the prompt
        force = {"structured_outputs": {"regex": re.escape(HERMES_CALL)}}
        [call] = ask(client, tools=TOOLS, extra_body=force).choices[0].message.tool_calls
        check_call(call)
        history = [
            *question,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "-3 C and snow"},
        ]
        for extra in ({"tools": TOOLS}, {}):
            answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, **extra)
            assert answer.choices[0].finish_reason in ("stop", "length")
        [call] = ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0].message.tool_calls
        check_call(call)  # forced calls work on any model
    template = "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with serving(with_template(tiny_model_dir, tmp_path / "unknown", template)) as (_, live):
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
            ask(openai_client(live), tools=TOOLS)


def test_reasoning_is_split_from_the_answer_whole_and_streamed(thinking_model_dir):
    with serving(thinking_model_dir) as (_, live):
        client = openai_client(live)
        force = {"structured_outputs": {"regex": "Oslo is cold\\.\n</think>\n\nIt is cold\\."}}
        message = ask(client, extra_body=force).choices[0].message
        assert message.reasoning_content == "Oslo is cold.\n" and message.content == "It is cold."
        content, reasoning, calls, finish = streamed(client, extra_body=force)
        assert (content, reasoning, calls, finish) == ("It is cold.", "Oslo is cold.\n", [], "stop")


def test_harmony_output_is_split_into_reasoning_content_and_calls(harmony_model_dir):
    """A gpt-oss style template: the output is parsed as Harmony, whole and streamed (the stop
    token the server now decodes is not content)."""
    with serving(harmony_model_dir) as (_, live):
        client = openai_client(live)
        analysis = "<|channel|>analysis<|message|>Oslo is cold.<|end|><|start|>assistant"
        answer = {"structured_outputs": {"regex": re.escape(analysis + "<|channel|>final<|message|>It is cold.<|return|>")}}
        message = ask(client, max_tokens=200, extra_body=answer).choices[0].message
        assert (message.reasoning_content, message.content, message.tool_calls) == ("Oslo is cold.", "It is cold.", None)
        assert streamed(client, max_tokens=200, extra_body=answer) == ("It is cold.", "Oslo is cold.", [], "stop")

        call = ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Oslo","days":2}<|call|>'
        force = {"structured_outputs": {"regex": re.escape(analysis + call)}}
        whole = ask(client, tools=TOOLS, max_tokens=200, extra_body=force).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert whole.message.reasoning_content == "Oslo is cold."
        expected = [{"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}]
        assert as_dicts(whole.message.tool_calls) == expected
        check_call(whole.message.tool_calls[0])
        content, reasoning, calls, finish = streamed(client, tools=TOOLS, max_tokens=200, extra_body=force)
        assert (content, reasoning, finish) == ("", "Oslo is cold.", "tool_calls")
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected

