"""One validator for every request body, and answers instead of 500s: the hardening findings of
``/v1/messages``, ``/v1/responses`` and chat completions, live on 127.0.0.1 with the official
clients (``anthropic``, ``openai``) and httpx for raw bodies.

- A lone surrogate in any field a response echoes is a 400 naming the field, streamed or not
  (the Responses stream used to drop the connection before its first event).
- A forced call cut by ``max_tokens`` is answered as each API answers it (Anthropic: a
  ``tool_use`` with ``input: {}``; it used to be a 500).
- A tool's schema must describe an object.
- A prompt too long for the context is refused from its length, before it is tokenized, and
  four such prompts at once do not hold up a one-token request.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from tool_models import MODEL, TOOLS, openai_client  # noqa: E402

pytestmark = pytest.mark.e2e
WEATHER = TOOLS[0]["function"]
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
ANTHROPIC_TOOL = {"name": WEATHER["name"], "description": "The weather.", "input_schema": WEATHER["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": WEATHER["name"], "parameters": WEATHER["parameters"]}


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(live):
    return openai_client(live)


def post_json_text(http, path: str, body: dict) -> httpx.Response:
    """``body`` as JSON text (json.dumps writes a lone surrogate as ``\\ud800``, legal JSON);
    the whole response is read, so a dropped connection raises."""
    text = json.dumps(body)
    with http.stream("POST", path, content=text.encode(), headers={"content-type": "application/json"}) as response:
        response.read()
    return response


def error_message(path: str, response: httpx.Response) -> str:
    """The 400's message, after checking the error is in the shape of the API at ``path``."""
    assert response.status_code == 400, response.text[:500]
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


# -- lone surrogates in what the responses echo ---------------------------------------------------

ECHOED = [
    ("/v1/responses", {"text": {"format": {"type": "json_object", "name": "\ud800"}}}, "text.format.name"),
    ("/v1/responses", {"text": {"format": {"type": "json_object", "description": "\udc00"}}}, "text.format.description"),
    ("/v1/responses", {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": WEATHER["name"], "x": "\ud800"}}, "tool_choice.x"),
    ("/v1/responses", {"tools": [{**RESPONSES_TOOL, "description": "a\udfff"}]}, "tools.0.description"),
    ("/v1/responses", {"instructions": "\ud800"}, "instructions"),
    ("/v1/messages", {"system": [{"type": "text", "text": "\ud800"}]}, "system.0.text"),
    ("/v1/messages", {"tools": [{**ANTHROPIC_TOOL, "description": "\ud800"}]}, "tools.0.description"),
    ("/v1/messages", {"stop_sequences": ["\udc00"]}, "stop_sequences.0"),
    ("/v1/messages/count_tokens", {"tools": [{**ANTHROPIC_TOOL, "name": "\ud800"}]}, "tools.0.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {**WEATHER, "description": "\ud800"}}]}, "tools.0.function.description"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "\ud800", "schema": {}}}}, "response_format.json_schema.name"),
]  # fmt: skip
BASE = {
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": QUESTION, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": QUESTION},
    "/v1/chat/completions": {"model": MODEL, "messages": QUESTION, "max_tokens": 2},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("path", "fields", "where"), ECHOED, ids=[f"{p[4:]}:{w}" for p, _, w in ECHOED])
def test_a_lone_surrogate_in_an_echoed_field_is_a_400_naming_it(http, path, fields, where, stream):
    body = {**BASE[path], **fields}
    if path != "/v1/messages/count_tokens":
        body["stream"] = stream
    message = error_message(path, post_json_text(http, path, body))
    assert where in message and "Unicode" in message, message


# -- a forced call cut short ----------------------------------------------------------------------


def test_anthropic_answers_a_cut_forced_call_with_an_empty_input(claude):
    kwargs = {
        "model": MODEL, "max_tokens": 3, "messages": QUESTION, "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "tool", "name": WEATHER["name"]},
    }  # fmt: skip
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    [use] = message.content
    assert (use.type, use.name, use.input) == ("tool_use", WEATHER["name"], {})
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
    assert events[-1].type == "message_stop"
    assert stream.get_final_message().stop_reason == "max_tokens"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert partial and partial.startswith("{")


def test_chat_gives_a_cut_forced_call_its_partial_arguments(oai):
    named = {"type": "function", "function": {"name": WEATHER["name"]}}
    response = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=3)
    [choice] = response.choices
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls
    assert call.function.name == WEATHER["name"] and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: OpenAI sends what was written


def test_responses_marks_a_cut_forced_call_incomplete(oai):
    kwargs = {
        "model": MODEL, "input": "Weather?", "max_output_tokens": 3, "tools": [RESPONSES_TOOL],
        "tool_choice": {"type": "function", "name": WEATHER["name"]},
    }  # fmt: skip
    response = oai.responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [call] = response.output
    assert call.type == "function_call" and call.status == "incomplete" and call.arguments.startswith("{")
    events = list(oai.responses.create(**kwargs, stream=True))
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


# -- tool schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schema_type", ["string", "array"])
def test_a_tool_schema_that_is_not_an_object_is_a_400(claude, oai, schema_type):
    schema = {"type": schema_type}
    with pytest.raises(anthropic.BadRequestError, match="input_schema"):
        claude.messages.create(
            model=MODEL, max_tokens=8, messages=QUESTION, tools=[{**ANTHROPIC_TOOL, "input_schema": schema}],
            tool_choice={"type": "any"},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="parameters"):
        tool = {"type": "function", "function": {**WEATHER, "parameters": schema}}
        oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[tool], tool_choice="required", max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="parameters"):
        tools = [{**RESPONSES_TOOL, "parameters": schema}]
        oai.responses.create(model=MODEL, input="Hi", tools=tools, max_output_tokens=8)


def test_a_forced_call_is_an_object_even_when_the_schema_does_not_say_so(oai):
    """A schema without ``type`` is forced as an object: arguments are never a bare string."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {"enum": ["Oslo", {"city": "Oslo"}]}}}
    named = {"type": "function", "function": {"name": "pick"}}
    response = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[tool], tool_choice=named, max_tokens=16
    )
    [call] = response.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


# -- prompts too long to fit --------------------------------------------------------------------

HUGE = "The quick brown fox jumps over the lazy dog. " * 83_000  # ~3.75 MB: seconds of tokenizing


def test_a_huge_prompt_is_refused_before_tokenizing(http):
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}),
    ]:
        response = http.post(path, json=body)
        message = error_message(path, response)
        assert "at least" in message and "characters" in message, message  # from its length, untokenized


def test_huge_prompts_do_not_delay_a_one_token_request(http):
    """Four clients send ~3.75 MB each (each took seconds of tokenizing, one after the other,
    before the length check): one-token requests sent meanwhile still answer in about their
    own time. The margin is wide (seconds), for a busy machine."""
    small = {"messages": QUESTION, "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=small).status_code == 200  # warm
    started = time.monotonic()
    assert http.post("/v1/chat/completions", json=small).status_code == 200
    alone = time.monotonic() - started

    statuses: list[int] = []
    huge = {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}

    def send_huge() -> None:
        statuses.append(http.post("/v1/chat/completions", json=huge).status_code)

    threads = [threading.Thread(target=send_huge) for _ in range(4)]
    for thread in threads:
        thread.start()
    beside_huge = []
    while any(thread.is_alive() for thread in threads) or not beside_huge:
        started = time.monotonic()
        assert http.post("/v1/chat/completions", json=small).status_code == 200
        beside_huge.append(time.monotonic() - started)
    for thread in threads:
        thread.join(120)
    assert statuses == [400] * 4
    assert max(beside_huge) < 3 * alone + 2.0, (alone, beside_huge)
