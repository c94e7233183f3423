"""Fuzzing the live server: random and adversarial bodies against ``/v1/completions`` and
``/v1/chat/completions`` on 127.0.0.1 (hypothesis, bounded in examples and time), and a lone
surrogate in any string field of any API (Responses and Anthropic Messages too).

After every example: no 5xx (the engine never dies of a request, so not even a 503), every error
is OpenAI's shape, the engine answers ``/health``, and no KV block is held. At the end a normal
request still gives the same tokens as before the fuzzing. Streams are also read by clients that
pause or stop reading (small socket buffers, so the server's sends block): one that resumes gets
what a non-streamed request gets; one that leaves frees its blocks.

Then what clients read of the cache: guesses of another tenant's prompt read alike whatever they
share with it, any ``request_id`` in the blocks view lists nothing of others, and with
``--api-key`` every path but ``/health`` and ``/version`` needs the key.
"""

from __future__ import annotations

import json
import math
import re
import socket
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cache_observer import after_guess, differences  # noqa: E402
from live_server import LiveServer, raw_request, read_response  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.middleware import OPEN_PATHS  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402

MAX_MODEL_LEN = 96  # every accepted request is short, so many examples fit in the time bound
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples in CI and here
)
NORMAL = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncEngineCore(
        model=str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4, max_num_batched_tokens=32, force_model_takeover=True,
    ).start()  # fmt: skip
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def http(engine):
    live = LiveServer(build_app(engine, served_model_name="tiny", max_body_bytes=256 * 1024))
    with httpx.Client(base_url=live.url, timeout=60) as client:
        baseline = client.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]
        yield client
        after = client.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]
        assert after == baseline, "the fuzzing changed what a normal request generates"
    live.stop()


# -- values ---------------------------------------------------------------------------------------

surrogate_text = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
nasty_text = st.one_of(
    st.text(max_size=40),
    surrogate_text,
    st.just(""),
    st.just("x" * 5000),
    st.builds(lambda a, b: a + b, st.text(max_size=5), surrogate_text),
    st.sampled_from(["/etc/passwd", "http://127.0.0.1:1/", "<img src=x onerror=alert(1)>", "{}", "\x00"]),
)
big_ints = st.one_of(
    st.integers(-5, 70),
    st.sampled_from([2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 49151, 49152]),
)
numbers = st.one_of(
    big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, 0.5, 2.5]),
)
json_leaf = st.one_of(st.none(), st.booleans(), numbers, nasty_text)
json_value = st.recursive(
    json_leaf,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)


def mostly(valid, invalid=json_value):
    """``valid`` nine times in ten, else an adversarial value: most bodies reach the engine."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i == 0 else valid)


# Values the server accepts, at the edges of what it accepts: these reach the engine.
vocab_ids = st.one_of(st.integers(0, 60), st.sampled_from([49150, 49151]))
token_lists = st.lists(vocab_ids, min_size=1, max_size=20)
prompts = mostly(
    st.one_of(
        st.text(min_size=1, max_size=60),
        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=4),
        token_lists,
        st.lists(token_lists, min_size=1, max_size=3),
    ),
    st.one_of(nasty_text, st.lists(nasty_text, max_size=6), st.lists(big_ints, max_size=8), st.just([]), st.just([[]])),
)
small_floats = st.floats(0, 2, allow_nan=False)
stop_texts = st.text(min_size=1, max_size=12)
common_fields = {
    "model": mostly(st.just("tiny")),
    "max_tokens": mostly(st.integers(1, 12)),
    "temperature": mostly(st.one_of(small_floats, st.sampled_from([0, 1e-300, 1e-6, 100.0]))),
    "top_p": mostly(st.one_of(st.floats(1e-9, 1), st.just(1))),
    "top_k": mostly(st.one_of(st.integers(-1, 100), st.sampled_from([49151, 49152, 10**9]))),
    "min_p": mostly(st.floats(0, 1)),
    "n": mostly(st.integers(1, 4)),
    "seed": mostly(st.one_of(st.integers(-(2**63), 2**64), st.sampled_from([0, -1, 10**30]))),
    "stop": mostly(st.one_of(stop_texts, st.lists(stop_texts, max_size=32))),
    "stop_token_ids": mostly(st.lists(vocab_ids, max_size=8)),
    "min_tokens": mostly(st.integers(0, 3)),
    "presence_penalty": mostly(st.floats(-2, 2)),
    "frequency_penalty": mostly(st.floats(-2, 2)),
    "repetition_penalty": mostly(st.one_of(st.floats(1e-3, 5), st.sampled_from([1e-300, 1e300]))),
    "logit_bias": mostly(st.none()),
    "logprobs": mostly(st.integers(0, 20)),
    "ignore_eos": mostly(st.booleans()),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "cache_salt": mostly(st.text(max_size=20), nasty_text),
    "skip_special_tokens": mostly(st.booleans()),
    "user": mostly(st.text(max_size=20)),
}


def bodies(required: dict):
    optional = st.fixed_dictionaries({}, optional=common_fields)
    return st.builds(lambda fixed, extra: {**extra, **fixed}, st.fixed_dictionaries(required), optional)


parts = mostly(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40)}),
    st.one_of(
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": nasty_text})}),
        st.fixed_dictionaries({"type": st.just("text"), "text": nasty_text}),
        json_value,
    ),
)
messages = mostly(
    st.lists(
        st.fixed_dictionaries(
            {"role": mostly(st.sampled_from(["system", "user", "assistant", "user"])),
             "content": mostly(st.one_of(st.text(max_size=60), st.lists(parts, min_size=1, max_size=3)))}
        ),
        min_size=1, max_size=4,
    ),
)  # fmt: skip


# -- checks ---------------------------------------------------------------------------------------


def send(http, path: str, body) -> httpx.Response:
    text = json.dumps(body, allow_nan=True)  # NaN/Infinity are not JSON: the server must say 400
    with http.stream("POST", path, content=text.encode(), headers={"content-type": "application/json"}) as response:
        response.read()
    return response


def check(http, response: httpx.Response) -> None:
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text[:2000]
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for data in events[:-1]:
            payload = json.loads(data)
            assert payload.get("error", {}).get("type") != "server_error", payload
    assert_idle(http)


def assert_idle(http) -> None:
    """The engine answers ``/health`` and holds no KV block (within 5 s)."""
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 5
    while http.get("/v1/cache/stats").json()["stats"]["num_used_blocks"]:
        assert time.monotonic() < deadline, "KV blocks held after the response"
        time.sleep(0.02)


@FUZZ
@given(body=bodies({"prompt": prompts}))
def test_fuzz_completions(http, body):
    check(http, send(http, "/v1/completions", body))


@FUZZ
@given(body=bodies({"messages": messages}))
def test_fuzz_chat(http, body):
    check(http, send(http, "/v1/chat/completions", body))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw=st.one_of(st.binary(max_size=200), json_value.map(json.dumps)))
def test_fuzz_raw_bodies(http, path, raw):
    if isinstance(raw, str):
        raw = raw.encode()
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    check(http, response)


def test_numbers_json_cannot_carry_are_400s(http):
    for value in (math.nan, math.inf, -math.inf):
        response = send(http, "/v1/completions", {"prompt": "Hi", "temperature": value})
        assert response.status_code == 400, response.text


# -- a lone surrogate in any field of any API -----------------------------------------------------

TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "A city."}}}
ECHOING_BODIES = {
    "/v1/chat/completions": {
        "model": "tiny", "max_tokens": 2, "user": "u", "cache_salt": "s", "stop": ["x"],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": TOOL_SCHEMA}}],
        "tool_choice": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "description": "d", "schema": TOOL_SCHEMA}},
    },
    "/v1/completions": {"model": "tiny", "prompt": ["Hi", "there"], "max_tokens": 2, "stop": "x", "user": "u"},
    "/v1/responses": {
        "model": "tiny", "max_output_tokens": 2, "instructions": "Be brief.", "user": "u", "metadata": {"k": "v"},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": TOOL_SCHEMA}],
        "tool_choice": {"type": "function", "name": "f", "extra": "e"},
        "text": {"format": {"type": "json_schema", "name": "n", "description": "d", "schema": TOOL_SCHEMA}},
    },
    "/v1/messages": {
        "model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["x"], "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]}]},
        ],
        "tools": [{"name": "f", "description": "d", "input_schema": TOOL_SCHEMA}],
        "tool_choice": {"type": "tool", "name": "f"},
    },
}  # fmt: skip


def string_paths(value, path: tuple = ()) -> list[tuple]:
    """The path of every string in a JSON value."""
    if isinstance(value, str):
        return [path]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    return [found for key, item in items for found in string_paths(item, (*path, key))]


@st.composite
def lone_surrogate_bodies(draw):
    """``(route, body, dotted path)``: a valid body of some API with one string, anywhere in it,
    holding a lone surrogate."""
    route = draw(st.sampled_from(sorted(ECHOING_BODIES)))
    body = json.loads(json.dumps(ECHOING_BODIES[route]))  # no shared parts (deepcopy keeps them shared)
    path = draw(st.sampled_from(string_paths(body)))
    holder = body
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = draw(st.text(max_size=4)) + draw(surrogate_text) + draw(st.text(max_size=4))
    body["stream"] = draw(st.booleans())
    return route, body, ".".join(map(str, path))


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=lone_surrogate_bodies())
def test_fuzz_a_lone_surrogate_in_any_field_of_any_api(http, case):
    route, body, where = case
    response = send(http, route, body)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    if route == "/v1/messages":
        assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "invalid_request_error" and error["param"] == where.split(".")[0]
    assert where in error["message"] and "Unicode" in error["message"], error


# -- constraints with large bounds (structured/bounds.py): refused at once, or compiled ------------

LIMIT = 10_000  # RequestLimits.max_constraint_bound's default
bounds = st.one_of(st.integers(0, 50), st.integers(LIMIT - 1, LIMIT + 1), st.sampled_from([10**6, 10**9, 2**63, 1e9, 1e300]))
BOUND_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
bound_keys = st.sampled_from(BOUND_KEYS)
schemas = st.recursive(
    st.sampled_from([{"type": "integer"}, {"type": "string"}, {"type": "boolean"}]),
    lambda inner: st.one_of(
        st.builds(lambda items, key, n: {"type": "array", "items": items, key: n}, inner, bound_keys, bounds),
        st.builds(lambda props: {"type": "object", "properties": props}, st.dictionaries(st.sampled_from("abc"), inner, max_size=3)),
        st.builds(lambda n: {"type": "string", "pattern": f"^a{{{n}}}$"}, bounds),
        st.builds(lambda items, n: {"type": "array", "prefixItems": [items] * n}, inner, st.sampled_from([1, 3, LIMIT + 1])),
    ),
    max_leaves=5,
)
constraints = st.one_of(
    schemas.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
    schemas.map(lambda s: {"structured_outputs": {"json": s}}),
    schemas.map(lambda s: {"structured_outputs": {"grammar": f"start: %json {json.dumps(s)}"}}),
    bounds.map(lambda n: {"structured_outputs": {"regex": f"(ab){{{n}}}"}}),
)


def largest_bound(value) -> float:
    """The largest bound the generators above put in ``value`` (an oracle independent of the
    server's walk)."""
    if isinstance(value, list):
        return max(map(largest_bound, value), default=0)
    if not isinstance(value, dict):
        return 0
    found = [0.0]
    for key, item in value.items():
        if key in BOUND_KEYS:
            found.append(item)
        elif key == "prefixItems":
            found.append(len(item))
        elif key in ("pattern", "regex"):
            found += [int(n) for n in re.findall(r"\{(\d+)\}", item)]
        elif key == "grammar":
            found.append(largest_bound(json.loads(item.removeprefix("start: %json "))))
        found.append(largest_bound(item))
    return max(found)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(constraint=constraints, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_constraint_bounds(http, constraint, path):
    """A bound over the limit is a 400 ``constraint_too_large`` at once; the rest compile or are
    400s; the server stays healthy (``check``)."""
    body = {"model": "tiny", "max_tokens": 4, **constraint}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
    started = time.monotonic()
    response = send(http, path, body)
    check(http, response)
    if largest_bound(constraint) > LIMIT:
        event("a bound over the limit")
        assert response.status_code == 400 and response.json()["error"]["code"] == "constraint_too_large", response.text[:500]
        assert time.monotonic() - started < 10  # refused before compiling (a 1e6 compile alone took 9 s)


# -- what a client reads of the cache, and who may read it -----------------------------------------

BLOCK = 4  # the engine's block size
secret_blocks = st.lists(st.lists(st.integers(100, 400), min_size=BLOCK, max_size=BLOCK), min_size=2, max_size=4)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=secret_blocks, shared=st.integers(0, 4), tail=st.lists(st.integers(1, 60), min_size=1, max_size=5))
def test_fuzz_prefix_guesses_read_alike(http, blocks, shared, tail):
    """A guess sharing ``shared`` blocks with another tenant's prompt changes what a client reads
    exactly as a guess sharing none (the same lengths) does."""
    secret = [t for block in blocks for t in block] + [61, 62]
    shared = min(shared, len(blocks))
    guess = secret[: shared * BLOCK] + [t + 500 for t in secret[shared * BLOCK : len(blocks) * BLOCK]] + tail
    unrelated = [t + 1000 for t in secret[: len(blocks) * BLOCK]] + tail
    event(f"{shared} shared blocks")
    assert differences(after_guess(http, secret, guess), after_guess(http, secret, unrelated)) == {}


query_ids = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), max_size=5)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=query_ids)
def test_fuzz_block_view_request_ids(http, ids):
    """Any ids a client names: a 200 listing none of them (none is live), never a 5xx."""
    response = http.get("/v1/cache/blocks", params={"request_id": ids})
    assert response.status_code == 200, response.text
    assert response.json()["requests"] == {} and response.json()["blocks"] == {}


@pytest.fixture(scope="module")
def keyed_http(engine):
    live = LiveServer(build_app(engine, served_model_name="tiny", api_key="sk-fuzz"))
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client
    live.stop()


paths = st.one_of(
    st.sampled_from(["/metrics", "/docs", "/redoc", "/openapi.json", "/health", "/version", "/health/", "/v1/models"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="?#"), max_size=30).map(
        lambda text: "/" + text
    ),
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=paths, method=st.sampled_from(["GET", "POST", "DELETE"]))
def test_fuzz_paths_need_the_key(keyed_http, path, method):
    """With ``--api-key``, every path a client can send but the probes answers 401 without it."""
    response = keyed_http.request(method, path)
    sent = response.request.url.raw_path.decode()
    if sent in OPEN_PATHS:
        assert response.status_code in (200, 405), (sent, response.status_code)
    else:
        assert response.status_code == 401, (sent, response.status_code, response.text[:200])


# -- stalled readers ------------------------------------------------------------------------------

SMALL_BUFFER = 4096  # bytes, both ends: the server's sends block after a few KiB unread


@pytest.fixture(scope="module")
def stalling(engine, http):
    """The app again, its connections with a small send buffer (inherited from the listener)."""
    live = LiveServer(build_app(engine, served_model_name="tiny"))
    live.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    yield live.url
    live.stop()


short_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)
streamed = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.one_of(st.just(40), st.integers(1, 40)), "n": st.integers(1, 4),
     "temperature": st.sampled_from([0, 0.8]), "seed": st.integers(0, 1000), "ignore_eos": st.booleans()},
    optional={"stop": st.lists(stop_texts, max_size=2)},
)  # fmt: skip
streamed_requests = st.one_of(
    st.tuples(st.just("/v1/completions"), streamed, st.fixed_dictionaries(
        {"prompt": short_text}, optional={"logprobs": st.integers(0, 20)})),
    st.tuples(st.just("/v1/chat/completions"), streamed, st.fixed_dictionaries(
        {"messages": short_text.map(lambda t: [{"role": "user", "content": t}])},
        optional={"logprobs": st.just(True), "top_logprobs": st.integers(0, 20)})),
).map(lambda t: (t[0], {**t[1], **t[2]}))  # fmt: skip
readers = st.fixed_dictionaries(
    {"read_first": st.integers(0, 20_000), "pause": st.sampled_from([0.0, 0.05, 0.3]),
     "resume": st.sampled_from([True, True, False])}
)


def choices_of(path: str, response: dict) -> dict[int, tuple[str, list[str]]]:
    """choice index -> (text, logprob tokens) of a non-streamed response."""
    out = {}
    for c in response["choices"]:
        if path == "/v1/completions":
            out[c["index"]] = (c["text"], (c["logprobs"] or {}).get("tokens", []))
        else:
            tokens = [t["token"] for t in ((c["logprobs"] or {}).get("content") or [])]
            out[c["index"]] = (c["message"]["content"] or "", tokens)
    return out


def streamed_choices(path: str, events: list[dict]) -> dict[int, tuple[str, list[str]]]:
    """The same, joined from a stream's events."""
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for event in events:
        for c in event["choices"]:
            i = c["index"]
            logprobs = c.get("logprobs") or {}
            if path == "/v1/completions":
                piece, lp = c["text"], logprobs.get("tokens", [])
            else:
                piece, lp = c["delta"].get("content") or "", [t["token"] for t in logprobs.get("content") or []]
            texts[i] = texts.get(i, "") + piece
            tokens.setdefault(i, []).extend(lp)
    return {i: (texts[i], tokens[i]) for i in texts}


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=streamed_requests, reader=readers)
def test_fuzz_stalled_readers(http, stalling, request, reader):
    """A client pauses (or stops) reading its stream: if it comes back it gets everything a
    non-streamed request gets, whatever the server coalesced meanwhile; if it leaves, its blocks
    are freed."""
    path, body = request
    sock = raw_request(stalling, path, {**body, "stream": True}, SMALL_BUFFER)
    try:
        sock.settimeout(60)
        head = sock.recv(reader["read_first"]) if reader["read_first"] else b""
        time.sleep(reader["pause"])
        if not reader["resume"]:
            event("left")
            sock.close()
            assert_idle(http)
            return
        status, text, complete = read_response(sock, already=head)
    finally:
        sock.close()
    expected = http.post(path, json=body)
    event(f"status {status}")
    assert status == expected.status_code, (text[:2000], expected.text[:2000])
    if status != 200:
        assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
        return
    data = [line[6:] for line in text.decode().splitlines() if line.startswith("data: ")]
    assert complete and data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert not any("error" in e for e in events), events
    assert streamed_choices(path, events) == choices_of(path, expected.json())
    pieces = sum(len(e["choices"]) for e in events) - body["n"]  # less the role chunks (chat) or so
    event("fewer pieces than tokens" if pieces < expected.json()["usage"]["completion_tokens"] else "a piece per token")
    assert_idle(http)
