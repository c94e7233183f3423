"""Structured outputs through the OpenAI server, live on 127.0.0.1, on the default model.

The official ``openai`` client's ``chat.completions.parse`` with a Pydantic model; two schemas
alternated on one server, concurrently, each output valid under its own schema (upstream's #784:
one request's grammar state leaking into the next); vLLM's ``structured_outputs`` on
completions; bad constraints as 400s with a message that says what is wrong.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
import jsonschema  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402
from live_server import LiveServer  # noqa: E402

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
ANIMAL = {
    "type": "object",
    "properties": {"animal": {"enum": ["cat", "dog", "horse"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["animal", "legs"],
    "additionalProperties": False,
}
NUMBERS = {
    "type": "object",
    "properties": {"primes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 4}},
    "required": ["primes"],
    "additionalProperties": False,
}


class Capital(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngineCore(max_num_seqs=8).start()
    live = LiveServer(build_app(engine, served_model_name=MODEL))
    yield live
    live.stop()
    engine.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def chat_body(question: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 48, **extra}


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_openai_client_parse_with_a_pydantic_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=40,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Capital) and message.parsed == Capital.model_validate_json(message.content)


def test_two_schemas_alternated_concurrently_each_get_their_own_constraint(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    asks = [
        ("Describe an animal as JSON.", ANIMAL),
        ("List a few prime numbers as JSON.", NUMBERS),
    ] * 2

    async def ask(question: str, schema: dict):
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            response_format=json_schema_format(schema),
            temperature=0,
            max_tokens=48,
        )

    async def run_all():
        return await asyncio.gather(*(ask(q, s) for q, s in asks))

    responses = asyncio.run(run_all())
    for response, (_, schema) in zip(responses, asks):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    # The same question under the same schema gives the same answer, batched either way.
    assert responses[0].choices[0].message.content == responses[2].choices[0].message.content


def test_json_object_in_a_stream_and_structured_outputs_on_completions(http):
    body = chat_body(
        "What is the capital of France? Answer in JSON.", stream=True, response_format={"type": "json_object"}, max_tokens=64
    )
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish == ["stop"], text
    assert isinstance(json.loads(text), dict)
    choices = ["Paris", "London", "Berlin"]
    body = {
        "model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8,
        "structured_outputs": {"choice": choices},
    }  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in choices


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"response_format": json_schema_format({"type": "foo"})}, "response_format", "invalid JSON schema: Invalid type: foo"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema is required"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "'structural_tag' is not supported"),
        ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs", "invalid regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list of strings"),
        ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "not both"),
    ],
)
def test_bad_constraints_are_400s_that_say_why(http, extra, param, message):
    response = http.post("/v1/chat/completions", json=chat_body("Hi", **extra))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_constraint_that_admits_nothing_is_a_400_and_the_server_goes_on(http):
    response = http.post("/v1/chat/completions", json=chat_body("Hi", structured_outputs={"regex": "[^\\s\\S]"}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "structured_output_failed" and "admits no complete output" in error["message"]
    ok = http.post("/v1/chat/completions", json=chat_body("Hi", structured_outputs={"choice": ["hello", "bye"]}))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("hello", "bye")


def test_anthropic_structured_output_is_enforced(server):
    """Anthropic's own structured output (``output_config.format``, which ``messages.parse``
    sends) constrains the answer: parsed by the SDK into the model it was given."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    message = client.messages.parse(
        model=MODEL, max_tokens=40, output_format=Capital,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
    )  # fmt: skip
    assert message.stop_reason == "end_turn" and isinstance(message.parsed_output, Capital)


def test_vllms_guided_fields_are_structured_outputs(http):
    """vLLM's older ``guided_choice``/``guided_json``/``guided_regex`` constrain as
    ``structured_outputs`` does; given beside it, a 400."""
    choice = http.post("/v1/chat/completions", json=chat_body("Cat or dog?", guided_choice=["cat", "dog"])).json()
    assert choice["choices"][0]["message"]["content"] in ("cat", "dog")
    answer = http.post("/v1/chat/completions", json=chat_body("Describe an animal.", guided_json=ANIMAL)).json()
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), ANIMAL)
    digits = http.post("/v1/completions", json={"model": MODEL, "prompt": "Year:", "max_tokens": 8, "guided_regex": "[0-9]{4}"})
    assert len(digits.json()["choices"][0]["text"]) == 4 and digits.json()["choices"][0]["text"].isdigit()
    both = http.post("/v1/chat/completions", json=chat_body("x", guided_regex="a", structured_outputs={"regex": "b"}))
    assert both.status_code == 400 and "guided" in both.json()["error"]["message"]
