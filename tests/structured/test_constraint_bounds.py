"""Constraints whose bounds would cost unbounded memory or time are refused before they compile.

A ~200-byte schema (``maxItems: 1000000000``) used to make llguidance allocate ~1 KB per item
while it built the matcher, in the server's process: 21 GB, and the kernel killed the server.
Here: the walk (``structured/bounds.py``) with exact messages; the compiler refusing it in well
under a second with no memory growth, and its worker guard (``compile_guard.py``) containing a
blow-up the walk was told to let through; every API path of the live server (real llguidance,
the tiny tools model, real clients) answering 400 and serving the next request; the Python API.
"""

from __future__ import annotations

import json
import resource
import time

import pytest

from vllm_mlx.structured.bounds import DEFAULT_MAX_CONSTRAINT_BOUND, BoundExceeded, check_bounds
from vllm_mlx.structured.params import StructuredOutputsParams

HUGE_ARRAY = {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000_000}
MILLION_ARRAY = {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}
"""Before the walk: 9 s and 1.2 GB in the caller's process, then llguidance's "too big"."""
SMALL_ARRAY = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
RSS_GROWTH_LIMIT = 64 << 20
"""Refusing a schema allocates next to nothing; compiling MILLION_ARRAY adds ~1.2 GB."""


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- the walk (pure Python) -------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        ({"json": HUGE_ARRAY}, "maxItems is 1000000000, over the limit of 10000"),
        ({"json": {"type": "array", "minItems": 1e9}}, "minItems is 1000000000"),
        ({"json": {"type": "string", "maxLength": 10**12}}, "maxLength is 1000000000000"),
        ({"json": {"type": "object", "properties": {"a": {"type": "object", "maxProperties": 20000}}}}, "maxProperties is 20000"),
        ({"json": {"type": "array", "prefixItems": [{"type": "integer"}] * 10001}}, "prefixItems (length) is 10001"),
        ({"json": {"$defs": {"x": {"type": "array", "maxItems": 20000}}, "$ref": "#/$defs/x"}}, "maxItems is 20000"),
        ({"json": {"type": "string", "pattern": "^a{5,1000000}$"}}, "a {n,m} count in pattern is 1000000"),
        ({"json": {"type": "object", "patternProperties": {"^k{20000}$": {}}}}, "a {n,m} count in patternProperties is 20000"),
        ({"json": json.dumps(HUGE_ARRAY)}, "maxItems is 1000000000"),
        ({"regex": "(ab){100000}"}, "a {n,m} count in regex is 100000"),
        ({"grammar": 'start: x{0,99999}\nx: "a"'}, "a {n,m} count in grammar is 99999"),
        ({"grammar": f"start: %json {json.dumps(HUGE_ARRAY)}"}, "maxItems is 1000000000"),
        ({"grammar": "start: %json " + json.dumps({"type": "string", "pattern": "a{20000}"})}, "count in pattern is 20000"),
        ({"json_object": True, "whitespace_pattern": "[ ]{0,100000}"}, "count in whitespace_pattern is 100000"),
        (
            {"json": {"type": "object", "properties": {f"p{i}": {"type": "array", "maxItems": 9000} for i in range(12)}}},
            "add up to more than 100000 (10 x --max-constraint-bound=10000",
        ),
    ],
)
def test_bounds_over_the_limit_are_refused_naming_the_bound_and_the_flag(params, message):
    with pytest.raises(BoundExceeded) as info:
        check_bounds(StructuredOutputsParams(**params))
    assert message in str(info.value)
    assert "--max-constraint-bound" in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        {"json": SMALL_ARRAY},
        {"json": {"type": "array", "maxItems": DEFAULT_MAX_CONSTRAINT_BOUND}},
        {"json": {"enum": [{"maxItems": 10**9}], "default": {"minItems": 10**9}}},  # data, not schemas
        {"json": {"type": "object", "properties": {"maxItems": {"type": "integer"}}}},  # a property name
        {"json": {"type": "string", "pattern": r"^\{1000000\}$"}},  # an escaped brace is a literal
        {"regex": r"[0-9]{1,4}-\d{2}"},
        {"grammar": 'start: "a"{1,3} %json {"type": "array", "maxItems": 9999}'},
        {"choice": ["x{1000000}"]},  # a literal string, not a regex
        {"json": True},
    ],
)
def test_bounds_within_the_limit_pass(params):
    check_bounds(StructuredOutputsParams(**params))


def test_the_limit_can_be_raised():
    check_bounds(StructuredOutputsParams(json=MILLION_ARRAY), max_bound=1_000_000)
    with pytest.raises(BoundExceeded, match="over the limit of 999999"):
        check_bounds(StructuredOutputsParams(json=MILLION_ARRAY), max_bound=999_999)


# -- the compiler and its guard (real llguidance, the default model's tokenizer) ---------------


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def warm_compiler(tokenizer):
    from vllm_mlx.structured.grammar import GrammarCompiler

    warm_compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids)
    warm_compiler.compile(StructuredOutputsParams(json=SMALL_ARRAY))  # the tokenizer and a worker, built once
    yield warm_compiler
    warm_compiler.close()


@pytest.mark.parametrize("schema", [HUGE_ARRAY, MILLION_ARRAY], ids=["1e9", "1e6"])
def test_the_compiler_refuses_a_huge_bound_at_once_without_allocating(warm_compiler, schema):
    from vllm_mlx.structured.grammar import ConstraintTooLarge

    before, started = resident_bytes(), time.monotonic()
    with pytest.raises(ConstraintTooLarge, match="maxItems is 1000000"):
        warm_compiler.compile(StructuredOutputsParams(json=schema))
    assert time.monotonic() - started < 1.0
    assert resident_bytes() - before < RSS_GROWTH_LIMIT


def test_the_guard_contains_a_blow_up_the_walk_lets_through(tokenizer):
    """The walk told to allow 1e9: the worker hits its memory cap, the caller's process does not
    grow, the request gets a ConstraintTooLarge, and the next compile (a new worker) works."""
    from vllm_mlx.structured.compile_guard import CompileGuard
    from vllm_mlx.structured.grammar import ConstraintTooLarge, GrammarCompiler

    warm_compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, max_bound=10**12)
    warm_compiler.ll_tokenizer  # noqa: B018 -- builds the tokenizer text the guard hands its workers
    warm_compiler._guard = CompileGuard(warm_compiler._tokenizer_json, warm_compiler.eos_token_ids, memory_bytes=128 << 20)
    try:
        before = resident_bytes()
        with pytest.raises(ConstraintTooLarge, match=r"too costly to compile: compiling it needed more than 128 MiB"):
            warm_compiler.compile(StructuredOutputsParams(json=HUGE_ARRAY))
        assert resident_bytes() - before < RSS_GROWTH_LIMIT
        assert warm_compiler.compile(StructuredOutputsParams(json=SMALL_ARRAY)).kind == "json"
        assert warm_compiler.stats() == {"cached": 1, "hits": 0, "misses": 1}
        warm_compiler.compile(StructuredOutputsParams(json=SMALL_ARRAY))  # the cache still answers
        assert warm_compiler.stats()["hits"] == 1
    finally:
        warm_compiler.close()


def test_the_guard_stops_a_compile_that_takes_too_long(tokenizer):
    from vllm_mlx.structured.compile_guard import CompileGuard, CompileRefused
    from vllm_mlx.structured.grammar import GrammarCompiler, grammar_text

    warm_compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids)
    warm_compiler.ll_tokenizer  # noqa: B018
    guard = CompileGuard(warm_compiler._tokenizer_json, warm_compiler.eos_token_ids, timeout_s=0.05, max_workers=1)
    slow = grammar_text(StructuredOutputsParams(json=MILLION_ARRAY))  # ~9 s, far over 0.05 s
    try:
        with pytest.raises(CompileRefused, match="took longer than 0.05 s"):
            with guard.checked(slow):
                pytest.fail("a compile past the timeout must not be handed to the caller")
        guard.timeout_s = 60
        with guard.checked(grammar_text(StructuredOutputsParams(json=SMALL_ARRAY))) as error:
            assert error is None  # the one slot was given back, with a new worker
        with guard.checked("start: nothere") as error:
            assert 'unknown name: "nothere"' in error  # llguidance's own message, for the caller
    finally:
        guard.close()


# -- every API path of the live server, and the Python API (the tiny tools model) ---------------

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
from tool_models import MODEL, live_app  # noqa: E402

from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402
from vllm_mlx.platform.validation import RequestLimits  # noqa: E402

HUGE_TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"xs": HUGE_ARRAY}, "required": ["xs"]}},
}
HUGE_LARK = f"start: %json {json.dumps(HUGE_ARRAY)}"
QUESTION_MESSAGES = [{"role": "user", "content": "Add some numbers."}]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=QUESTION_MESSAGES, max_tokens=4, temperature=0, **kwargs)


def refused_fast(call, param: str | None) -> None:
    """``call`` raises a 400 naming the flag, in well under the seconds a compile would take,
    and the process holding the server does not grow."""
    before, started = resident_bytes(), time.monotonic()
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as info:
        call()
    assert time.monotonic() - started < 5.0  # a busy machine's HTTP round trip; the compile alone was 9 s at 1e6
    assert resident_bytes() - before < RSS_GROWTH_LIMIT
    message = str(info.value)
    assert "maxItems is 1000000000" in message and "--max-constraint-bound" in message, message
    if param is not None:
        assert info.value.body["param"] == param and info.value.body["code"] == "constraint_too_large", info.value.body


API_PATHS = {
    "chat response_format": (
        lambda c, a: chat(c, response_format={"type": "json_schema", "json_schema": {"name": "xs", "schema": HUGE_ARRAY}}),
        "response_format",
    ),
    "chat structured_outputs json": (lambda c, a: chat(c, extra_body={"structured_outputs": {"json": HUGE_ARRAY}}), "structured_outputs"),
    "chat grammar with %json": (lambda c, a: chat(c, extra_body={"structured_outputs": {"grammar": HUGE_LARK}}), "structured_outputs"),
    "chat forced tool call": (lambda c, a: chat(c, tools=[HUGE_TOOL], tool_choice="required"), "tools"),
    "completions structured_outputs": (
        lambda c, a: c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"structured_outputs": {"json": HUGE_ARRAY}}),
        "structured_outputs",
    ),
    "responses text.format": (
        lambda c, a: c.responses.create(
            model=MODEL, input="Hi", max_output_tokens=4,
            text={"format": {"type": "json_schema", "name": "xs", "schema": HUGE_ARRAY}},
        ),  # fmt: skip
        None,
    ),
    "messages forced tool": (
        lambda c, a: a.messages.create(
            model=MODEL, max_tokens=4, messages=QUESTION_MESSAGES,
            tools=[{"name": "add", "input_schema": HUGE_TOOL["function"]["parameters"]}],
            tool_choice={"type": "tool", "name": "add"},
        ),  # fmt: skip
        None,
    ),
}


@pytest.mark.parametrize("path", list(API_PATHS))
def test_every_api_path_refuses_a_huge_bound_and_serves_the_next_request(live, client, path):
    call, param = API_PATHS[path]
    messages_client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
    refused_fast(lambda: call(client, messages_client), param)
    after = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "xs", "schema": SMALL_ARRAY}})
    assert after.choices[0].finish_reason in ("stop", "length")


def test_the_flag_raises_the_limit(engine_and_live):
    """``--max-constraint-bound 20000``: a 20000-item bound compiles; 20001 is refused."""
    bound = {"type": "array", "items": {"type": "integer"}, "maxItems": 20_000}
    live = live_app(engine_and_live[0], options=ServingOptions(limits=RequestLimits(max_constraint_bound=20_000)))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = chat(client, extra_body={"structured_outputs": {"json": bound}})
        assert answer.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="maxItems is 20001, over the limit of 20000"):
            chat(client, extra_body={"structured_outputs": {"json": {**bound, "maxItems": 20_001}}})
    finally:
        live.stop()


def test_the_python_api_refuses_a_huge_bound(tiny_model_dir):
    from vllm_mlx import LLM, SamplingParams
    from vllm_mlx.structured.grammar import ConstraintTooLarge

    llm = LLM(str(tiny_model_dir), force_model_takeover=True)
    try:
        before, started = resident_bytes(), time.monotonic()
        with pytest.raises(ConstraintTooLarge, match="maxItems is 1000000000"):
            llm.generate("Hi", SamplingParams(max_tokens=4), response_format=HUGE_ARRAY)
        with pytest.raises(ConstraintTooLarge, match="maxItems is 1000000000"):
            llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(grammar=HUGE_LARK)))
        assert time.monotonic() - started < 2.0
        assert resident_bytes() - before < RSS_GROWTH_LIMIT
        [output] = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0), response_format=SMALL_ARRAY)
        assert output.outputs[0].text.startswith("[")
    finally:
        llm.shutdown()
    llm = LLM(str(tiny_model_dir), force_model_takeover=True, max_constraint_bound=20_000)
    try:  # the limit is an engine option too
        [output] = llm.generate("Hi", SamplingParams(max_tokens=4), response_format={**SMALL_ARRAY, "maxItems": 20_000})
        assert output.outputs[0].text.startswith("[")
        with pytest.raises(ConstraintTooLarge, match="maxItems is 20001, over the limit of 20000"):
            llm.generate("Hi", SamplingParams(max_tokens=4), response_format={**SMALL_ARRAY, "maxItems": 20_001})
    finally:
        llm.shutdown()


def test_compiles_run_at_most_max_workers_at_once_and_the_workers_end_with_the_engine(tokenizer):
    """Eight threads compiling distinct grammars through a one-worker guard: one worker process,
    every grammar compiled, and closing the compiler ends the worker."""
    import threading

    from vllm_mlx.structured.compile_guard import CompileGuard
    from vllm_mlx.structured.grammar import GrammarCompiler

    warm_compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids)
    warm_compiler.ll_tokenizer  # noqa: B018
    warm_compiler._guard = guard = CompileGuard(warm_compiler._tokenizer_json, warm_compiler.eos_token_ids, max_workers=1)
    inside, most = 0, 0
    lock = threading.Lock()
    original = warm_compiler._build_matcher

    def counting_build(text, kind):  # the in-process compile, which holds the worker's slot
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        try:
            time.sleep(0.01)
            return original(text, kind)
        finally:
            with lock:
                inside -= 1

    warm_compiler._build_matcher = counting_build
    threads = [
        threading.Thread(target=warm_compiler.compile, args=(StructuredOutputsParams(json={**SMALL_ARRAY, "maxItems": 2 + i}),))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert warm_compiler.stats()["misses"] == 8 and most == 1
    [worker] = guard.workers.started()
    warm_compiler.close()
    assert worker.process.wait(10) is not None


def test_a_blow_up_the_walk_lets_through_is_a_400_and_the_server_goes_on(engine_and_live, client):
    """The operator raised the limit past what compiles: the 1e9 bound reaches the compile, whose
    worker dies at its memory cap (1 GiB); the server's process does not grow, and it serves on."""
    live = live_app(engine_and_live[0], options=ServingOptions(limits=RequestLimits(max_constraint_bound=10**12)))
    try:
        permissive = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        chat(permissive, response_format={"type": "json_schema", "json_schema": {"name": "xs", "schema": SMALL_ARRAY}})
        before = resident_bytes()  # after the compiler's tokenizer and workers are built
        with pytest.raises(openai.BadRequestError, match="too costly to compile: compiling it needed more than 1024 MiB") as info:
            chat(permissive, response_format={"type": "json_schema", "json_schema": {"name": "xs", "schema": HUGE_ARRAY}})
        assert info.value.body["code"] == "constraint_too_large"
        assert resident_bytes() - before < RSS_GROWTH_LIMIT
    finally:
        live.stop()
    assert chat(client).choices[0].finish_reason in ("stop", "length")
