"""Anthropic's Messages API (``/v1/messages``), live on 127.0.0.1, with the official ``anthropic`` client.

The tiny random-weight tools model of tests/tool_models.py: forced tool choices (``any``, a named
tool) must come from the constraint; text is made deterministic with a regex (vLLM's
``structured_outputs`` through ``extra_body``), so stop sequences and reasoning are exact.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
import jsonschema  # noqa: E402
from tool_models import MODEL, SCHEMAS, TOOLS, live_app, serving  # noqa: E402

pytestmark = pytest.mark.e2e
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"].get("description", ""), "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


def create_message(client, **kwargs):
    return client.messages.create(**message_request(**kwargs))


def message_request(**kwargs) -> dict:
    """A request; greedy (the current client has no ``temperature`` argument: ``extra_body``)."""
    kwargs = {"model": MODEL, "max_tokens": 48, "messages": QUESTION, **kwargs}
    kwargs["extra_body"] = {"temperature": 0, **kwargs.get("extra_body", {})}
    return kwargs


def forced(regex: str) -> dict:
    return {"structured_outputs": {"regex": regex}}


def tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def blocks_without_ids(blocks) -> list[dict]:
    """The blocks as dicts; a tool_use id is fresh in every answer."""
    return [b.model_dump(exclude={"id"}) for b in blocks]


def check_tool_use(block) -> None:
    assert block.id and isinstance(block.input, dict)
    jsonschema.validate(block.input, SCHEMAS[block.name])


def test_plain_text_with_usage_and_max_tokens(client):
    message = create_message(client, max_tokens=5, system="You are terse.")
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
    [block] = message.content
    assert block.type == "text" and block.text


def test_system_blocks_and_a_stop_sequence_name_the_matched_string(client):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in one word."}]
    message = create_message(client, system=system, stop_sequences=["END", "cold"], extra_body=forced("It is cold here"))
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "cold"
    assert [b.text for b in message.content] == ["It is "]
    ended = create_message(client, extra_body=forced("Sunny\\."))
    assert ended.stop_reason == "end_turn" and ended.stop_sequence is None


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "named"])
def test_forced_tool_choice_gives_tool_use_blocks_that_validate(client, tool_choice):
    message = create_message(client, tools=ANTHROPIC_TOOLS, tool_choice=tool_choice)
    assert message.stop_reason == "tool_use"
    uses = tool_uses(message)
    assert uses
    for block in uses:
        check_tool_use(block)
    if tool_choice["type"] == "tool":
        assert [b.name for b in uses] == ["get_time"]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "named"])
def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_use(client, tool_choice):
    """``max_tokens`` cuts the forced call: a ``tool_use`` with ``input: {}`` all the same (for
    ``any`` once its name is written), ``stop_reason`` ``max_tokens``."""
    tools = ANTHROPIC_TOOLS[:1]  # one function: the cut output's first tokens name it
    whole = create_message(client, tools=tools, tool_choice=tool_choice)
    cut = create_message(client, tools=tools, tool_choice=tool_choice, max_tokens=whole.usage.output_tokens - 5)
    [use] = tool_uses(cut)
    assert cut.stop_reason == "max_tokens" and use.input == {} and use.name == "get_weather"


def test_a_tool_result_turn_continues_the_conversation(client):
    first = create_message(client, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    [use] = tool_uses(first)
    messages = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny, 24 C"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},  # fmt: skip
    ]
    reply = create_message(client, messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=4)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    # The SDK's tool runner: a later turn sends the history (and its thread) without the tools.
    runner_turn = create_message(client, messages=messages, max_tokens=2, extra_body={"thread": {"id": "t"}})
    assert runner_turn.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens > first.usage.input_tokens
    failed = [{**messages[2], "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "timeout", "is_error": True}]}]
    assert create_message(client, messages=[*messages[:2], *failed], tools=ANTHROPIC_TOOLS, max_tokens=2).usage.output_tokens == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}},
        {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}},
        {"tools": ANTHROPIC_TOOLS, "extra_body": forced("Let me check\\.")},
    ],
    ids=["any", "named", "text"],
)
def test_the_stream_reassembles_to_the_whole_message(client, kwargs):
    whole = create_message(client, **kwargs)
    with client.messages.stream(**message_request(**kwargs)) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert blocks_without_ids(streamed.content) == blocks_without_ids(whole.content)
    assert all(b.id.startswith("call_") for b in tool_uses(streamed))
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert streamed.usage.model_dump() == whole.usage.model_dump()


def test_reasoning_becomes_thinking_blocks_whole_and_streamed(thinking_model_dir):
    with serving(thinking_model_dir) as (_, live):
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
        force = forced("Oslo is cold\\.\n</think>\n\nIt is cold\\.")
        whole = create_message(client, extra_body=force)
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in whole.content] == [
            ("thinking", "Oslo is cold.\n"),
            ("text", "It is cold."),
        ]
        with client.messages.stream(**message_request(extra_body=force)) as stream:
            assert [b.model_dump() for b in stream.get_final_message().content] == [b.model_dump() for b in whole.content]


def test_count_tokens_equals_the_input_tokens_of_the_same_request(client):
    message_request = {"model": MODEL, "messages": QUESTION, "system": "Be brief.", "tools": ANTHROPIC_TOOLS}
    counted = client.messages.count_tokens(**message_request)
    message = client.messages.create(max_tokens=1, **message_request)
    assert counted.input_tokens == message.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens < counted.input_tokens


def check_error(response: httpx.Response, status: int, kind: str, words: str) -> None:
    body = response.json()
    assert response.status_code == status and body["type"] == "error", body
    assert body["error"]["type"] == kind and words in body["error"]["message"], body


def test_errors_are_in_anthropics_shape(live, client):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        check_error(http.post("/v1/messages", json={"model": MODEL, "messages": QUESTION}), 400, "invalid_request_error", "max_tokens")
        bad_choice = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "tools": ANTHROPIC_TOOLS}
        check_error(http.post("/v1/messages", json={**bad_choice, "tool_choice": {"type": "sometimes"}}), 400, "invalid_request_error", "tool_choice")
        check_error(http.post("/v1/messages", json={**bad_choice, "tool_choice": {"type": "tool", "name": "nope"}}), 400, "invalid_request_error", "not in tools")
        check_error(http.post("/v1/messages", json={**bad_choice, "model": "claude-x"}), 404, "not_found_error", "claude-x")
        check_error(http.post("/v1/messages/count_tokens", json={"model": MODEL}), 400, "invalid_request_error", "messages")
        openai_shape = http.post("/v1/chat/completions", json={"model": MODEL}).json()
        assert set(openai_shape) == {"error"} and openai_shape["error"]["param"] == "messages"  # unchanged
    with pytest.raises(anthropic.NotFoundError) as info:
        create_message(client, model="claude-x")
    assert info.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_is_accepted_as_x_api_key(engine_and_live):
    live = live_app(engine_and_live[0], api_key="sekret")
    try:
        good = anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0, timeout=120)
        assert create_message(good, max_tokens=1).usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError) as info:
            create_message(anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0), max_tokens=1)
        assert info.value.body["error"]["type"] == "authentication_error"
        with httpx.Client(base_url=live.url) as http:
            assert http.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
            assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            assert http.get("/v1/models", headers={"x-api-key": "wrong"}).json()["error"]["code"] == "invalid_api_key"
            check_error(http.post("/v1/messages", json={}), 401, "authentication_error", "Missing API key")
    finally:
        live.stop()
