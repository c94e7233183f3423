"""JSON constraints are compact by default, so a sampling model finishes its document.

With free whitespace between tokens a model at temperature 0.8 can fill ``max_tokens`` with
newlines and spaces and never close the object (the issue: ``parse()`` with a three-field
Pydantic model hit ``max_tokens=80`` in 2 of 3 tries on the default model). Tool calls were
already compact; now ``response_format`` and vLLM's ``structured_outputs`` json are too, unless
the request sets ``disable_any_whitespace: false`` (or a ``whitespace_pattern``) or the operator
passes ``--allow-json-whitespace``. The Python API's ``response_format`` is compact; a
``StructuredOutputsParams`` made by hand keeps vLLM's default (whitespace allowed).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
from tool_models import MODEL, live_app  # noqa: E402

from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402
from vllm_mlx.structured.params import StructuredOutputsParams  # noqa: E402
from vllm_mlx.structured.response_format import ResponseFormat  # noqa: E402

pytestmark = pytest.mark.e2e
INTEGERS = {"type": "array", "items": {"type": "integer"}}
"""No strings: any whitespace in the output is whitespace between tokens."""
SEEDS = range(4)
WHITESPACE = re.compile(r"\s")


def sampled(live, **extra) -> list[str]:
    """The random-weight model's outputs at temperature 1 for a few seeds."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    texts = []
    for seed in SEEDS:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Numbers?"}], max_tokens=24, temperature=1.0, seed=seed,
            **extra,
        )  # fmt: skip
        texts.append(answer.choices[0].message.content)
    return texts


RESPONSE_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "xs", "schema": INTEGERS}}}
STRUCTURED = {"extra_body": {"structured_outputs": {"json": INTEGERS}}}


@pytest.mark.parametrize("request_fields", [RESPONSE_FORMAT, STRUCTURED], ids=["response_format", "structured_outputs"])
def test_json_constraints_are_compact_by_default(engine_and_live, request_fields):
    texts = sampled(engine_and_live[1], **request_fields)
    assert all(text.startswith("[") and not WHITESPACE.search(text) for text in texts), texts


def test_whitespace_when_the_request_or_the_operator_allows_it(engine_and_live):
    """The contrast that shows the test above can fail: the same requests with whitespace allowed."""
    engine, live = engine_and_live
    allowed = {"extra_body": {"structured_outputs": {"json": INTEGERS, "disable_any_whitespace": False}}}
    assert any(WHITESPACE.search(text) for text in sampled(live, **allowed))
    permissive = live_app(engine, options=ServingOptions(allow_json_whitespace=True))
    try:
        assert any(WHITESPACE.search(text) for text in sampled(permissive, **RESPONSE_FORMAT))
    finally:
        permissive.stop()


def test_the_python_api_response_format_is_compact_and_hand_made_params_keep_vllms_default():
    class City(pydantic.BaseModel):
        name: str

    assert ResponseFormat.of(City).params.disable_any_whitespace
    assert ResponseFormat.of({"type": "json_object"}).params.disable_any_whitespace
    assert ResponseFormat.of(INTEGERS).params.disable_any_whitespace
    assert not StructuredOutputsParams(json=INTEGERS).disable_any_whitespace


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


def test_openai_parse_with_a_three_field_model_finishes_at_temperature_0_8():
    """The issue's case on the default model: every try (fixed seeds) closes its object within
    ``max_tokens=80`` and parses."""
    from live_server import LiveServer

    from vllm_mlx.engine.async_engine import AsyncEngineCore
    from vllm_mlx.entrypoints.openai.server import build_app

    engine = AsyncEngineCore(max_num_seqs=4).start()
    live = LiveServer(build_app(engine, served_model_name="smollm2"))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for seed in (3, 5):
            completion = client.chat.completions.parse(
                model="smollm2", messages=[{"role": "user", "content": "Who is a famous scientist?"}],
                response_format=Person, temperature=0.8, max_tokens=80, seed=seed,
            )  # fmt: skip
            choice = completion.choices[0]
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice
    finally:
        live.stop()
        engine.stop()
