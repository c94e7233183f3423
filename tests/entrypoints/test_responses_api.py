"""OpenAI's Responses API (``/v1/responses``), live on 127.0.0.1, with the official ``openai`` client.

The tiny random-weight tools model of tests/tool_models.py: forced tool choices come from the
constraint; streamed events must reassemble (``client.responses.stream``) to the whole response.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import jsonschema  # noqa: E402
from tool_models import MODEL, SCHEMAS, TOOLS, openai_client, serving  # noqa: E402

pytestmark = pytest.mark.e2e
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = "What is the weather in Oslo?"


@pytest.fixture(scope="module")
def client(tools_model_dir):
    with serving(tools_model_dir) as (_, live):
        yield openai_client(live)


def create_response(client, **kwargs):
    return client.responses.create(**response_request(**kwargs))


def response_request(**kwargs) -> dict:
    return {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 48, **kwargs}


def calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def items_without_ids(response) -> list[dict]:
    """The output items as dicts, minus the ids (fresh in every response) and the nulls
    (the streaming helper adds `parsed_arguments: None`)."""
    return [item.model_dump(exclude={"id", "call_id"}, exclude_none=True) for item in response.output]


def test_a_string_input_with_instructions(client):
    response = create_response(client, instructions="You are terse.", max_output_tokens=5)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    assert response.usage.total_tokens == response.usage.input_tokens + 5
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    [part] = message.content
    assert part.type == "output_text" and part.text == response.output_text != ""
    shorter = create_response(client, max_output_tokens=5)
    assert shorter.usage.input_tokens < response.usage.input_tokens  # the instructions are in the prompt


def test_required_function_tools_give_calls_that_validate(client):
    response = create_response(client, tools=FUNCTIONS, tool_choice="required")
    assert response.status == "completed" and calls(response)
    for call in calls(response):
        assert call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    named = create_response(client, tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_time"})
    assert [c.name for c in calls(named)] == ["get_time"]


def test_a_function_call_output_turn_continues(client):
    first = create_response(client, tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_weather"})
    [call] = calls(first)
    conversation = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
    ]
    reply = create_response(client, input=conversation, tools=FUNCTIONS, max_output_tokens=4)
    assert reply.status in ("completed", "incomplete")
    assert reply.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tools": FUNCTIONS, "tool_choice": "required"},
        {"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "get_weather"}},
    ],
    ids=["required", "named"],
)
def test_the_stream_reassembles_to_the_whole_response(client, kwargs):
    whole = create_response(client, **kwargs)
    with client.responses.stream(**response_request(**kwargs)) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert items_without_ids(streamed) == items_without_ids(whole)
    assert streamed.usage.model_dump() == whole.usage.model_dump()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(c.arguments for c in calls(whole))


def test_a_streamed_text_answer_cut_short_is_incomplete(client):
    whole = create_response(client, max_output_tokens=6)
    events = list(create_response(client, max_output_tokens=6, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.output_text == whole.output_text
    assert final.response.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_is_enforced(client):
    schema = {"enum": ["Oslo", "Rome", "Paris"]}  # small: a random model pads objects with whitespace
    text = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    response = create_response(client, text=text, max_output_tokens=16)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_previous_response_id_is_refused_with_a_reason(client):
    with pytest.raises(openai.BadRequestError) as info:
        create_response(client, previous_response_id="resp_123")
    error = info.value.body
    assert error["param"] == "previous_response_id" and "no conversation state" in error["message"]


def test_reasoning_is_a_reasoning_item(thinking_model_dir):
    with serving(thinking_model_dir) as (_, live):
        client = openai_client(live)
        force = {"structured_outputs": {"regex": "Oslo is cold\\.\n</think>\n\nIt is cold\\."}}
        response = client.responses.create(model=MODEL, input=QUESTION, extra_body=force)
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Oslo is cold.\n"
        assert response.output_text == "It is cold." and message.type == "message"
        with client.responses.stream(model=MODEL, input=QUESTION, extra_body=force) as stream:
            assert items_without_ids(stream.get_final_response()) == items_without_ids(response)
