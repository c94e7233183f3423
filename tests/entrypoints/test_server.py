"""The OpenAI-compatible server, live on loopback: the official ``openai`` client (sync and
async, streaming and not), raw HTTP for the error cases, concurrency, disconnects, metrics.

One tiny-model engine serves the module; two apps share it (one with an API key and a small
body limit), each run by uvicorn on a free 127.0.0.1 port in a background thread.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vllm_mlx import SamplingParams  # noqa: E402
from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.cli import build_parser  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402
from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402
from live_server import LiveServer, wait_for_health  # noqa: E402

MODEL = "tiny"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 1024
GREEDY = {"temperature": 0, "max_tokens": 12}
NO_EOS = {"ignore_eos": True}  # vLLM's extension, through the openai client's extra_body
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps running.",
    "One two three four five six",
    "Why?",
    "A long time ago in a galaxy far, far away",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncEngineCore(model=str(tiny_model_dir), num_kv_blocks=256, max_model_len=MAX_MODEL_LEN).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def server(engine):
    # The operator's disclosure switches on (their defaults are tested in test_server_hardening).
    options = ServingOptions(enable_prompt_tokens_details=True, cache_stats_per_request=True)
    live = LiveServer(build_app(engine, served_model_name=MODEL, options=options))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def auth_server(engine):
    live = LiveServer(build_app(engine, served_model_name=MODEL, api_key=API_KEY, max_body_bytes=64 * 1024))
    yield live
    live.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def wait_blocks_freed(http, timeout: float = 10.0) -> dict:
    """Poll /v1/cache/stats until no request holds blocks; return the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/v1/cache/stats").json()
        if not stats["request_states"] and stats["stats"]["num_used_blocks"] == 0:
            return stats
        assert time.monotonic() < deadline, f"blocks still held: {stats}"
        time.sleep(0.05)


def assert_error(response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


# -- plain endpoints --------------------------------------------------------------------------


def test_models_health_version(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_one_model_tokenize_and_detokenize(http, engine):
    """``GET /v1/models/{id}``, vLLM's ``/tokenize`` (a prompt, or chat messages rendered as a chat
    completion renders them) and ``/detokenize``: the engine's own tokenizer."""
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(http.get("/v1/models/other"), 404, "model")
    tokenizer = engine.call(lambda e: e.tokenizer)
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[1]}).json()
    assert tokens["tokens"] == list(tokenizer.encode(PROMPTS[1])) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == tokenizer.decode(tokens["tokens"])
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": messages}), 400)


def test_what_is_not_served_says_so(http):
    """Fields and paths this server does not serve are refused with a message that says what is
    not supported, never ignored: ``prompt_logprobs`` (a 400), ``/v1/embeddings`` (a 404 naming
    what is served)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1}
    assert "prompt_logprobs" in assert_error(http.post("/v1/completions", json=body), 400, "prompt_logprobs")["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "prompt_logprobs")
    missing = assert_error(http.post("/v1/embeddings", json={"model": MODEL, "input": "x"}), 404)
    assert "embeddings are not supported" in missing["message"] and "/v1/chat/completions" in missing["message"]
    assert "/v1/nowhere is not served" in assert_error(http.get("/v1/nowhere"), 404)["message"]


def test_serve_cli_parses():
    args = build_parser().parse_args(
        ["serve", "some/model", "--port", "9001", "--api-key", "k", "--max-body-size", "1M"]
    )
    assert (args.model_arg, args.host, args.port, args.api_key, args.max_body_size) == (
        "some/model",
        "127.0.0.1",
        9001,
        "k",
        1 << 20,
    )


# -- the openai client ------------------------------------------------------------------------


def test_chat_matches_engine_and_streams_the_same(client, engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = engine.call(lambda e: e.tokenizer)
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    solo = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).result()

    reply = client.chat.completions.create(model=MODEL, messages=messages, extra_body=NO_EOS, **GREEDY)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == solo.text
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 12)
    assert reply.usage.total_tokens == len(prompt) + 12

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            extra_body=NO_EOS,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == solo.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # the same prompt again: its full blocks come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16


def test_stop_string_and_finish_reason(client):
    base = client.completions.create(model=MODEL, prompt="One two three", extra_body=NO_EOS, **GREEDY).choices[0].text
    stop = base[len(base) // 2 :][:3]
    cut = client.completions.create(model=MODEL, prompt="One two three", stop=[stop], extra_body=NO_EOS, **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[: base.index(stop)]


def test_completions_batch_and_n(client):
    reply = client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], n=2, seed=7, temperature=0.8, max_tokens=6, extra_body=NO_EOS
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and c.text for c in reply.choices)
    assert reply.usage.completion_tokens == 4 * 6
    again = client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], n=2, seed=7, temperature=0.8, max_tokens=6, extra_body=NO_EOS
    )
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # seeded


def test_completions_token_ids_prompt(client, engine):
    ids = engine.call(lambda e: e.tokenizer.encode("Hello there", add_special_tokens=True))
    by_ids = client.completions.create(model=MODEL, prompt=list(ids), extra_body=NO_EOS, **GREEDY)
    by_text = client.completions.create(model=MODEL, prompt="Hello there", extra_body=NO_EOS, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_async_client_streaming_n_choices(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story"}],
            n=3,
            seed=1,
            temperature=1.0,
            max_tokens=8,
            extra_body=NO_EOS,
        )
        full = await client.chat.completions.create(**kwargs)
        texts = {i: "" for i in range(3)}
        finishes = {}
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        await client.close()
        return full, texts, finishes

    full, texts, finishes = asyncio.run(run())
    assert {c.index: c.message.content for c in full.choices} == texts  # same seed, same samples
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_logprobs_shapes(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the top token
        assert bytes(token.bytes).decode() == token.token

    comp = client.completions.create(model=MODEL, prompt="Hello", logprobs=2, extra_body=NO_EOS, **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_concurrent_streams_match_solo(server, engine):
    """Several clients stream at once (one continuous batch); each gets its own solo text."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    solo = [engine.add_request(p, params).result().text for p in PROMPTS]

    async def one(prompt: str) -> str:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        text = ""
        async for chunk in await client.completions.create(
            model=MODEL, prompt=prompt, stream=True, max_tokens=16, temperature=0, extra_body=NO_EOS
        ):
            text += chunk.choices[0].text
        await client.close()
        return text

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(all_at_once()) == solo


# -- errors -----------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL}, "messages"),  # missing field
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "temperature": "hot"}, "temperature"),  # wrong type
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "n": 1.5}, "n"),
        ({**CHAT, "temperature": -1}, "temperature"),  # out of range (SamplingParams' check)
        ({**CHAT, "top_p": 2}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({**CHAT, "presence_penalty": 3}, "presence_penalty"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({**CHAT, "max_tokens": 10_000}, "max_tokens"),  # prompt + max_tokens over the limit
    ],
)
def test_bad_chat_requests_are_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_unknown_model(http):
    error = assert_error(
        http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert "JSON" in error["message"]
    error = assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(http.post("/v1/completions", json={"model": "gpt-17", "prompt": "x"}), 404, "model")
    assert_error(http.get("/v1/nothing-here"), 404)


def test_prompt_over_the_limit_is_400_with_the_limits(http):
    long_text = " ".join(["word"] * (MAX_MODEL_LEN + 50))
    for path, body, param in (
        ("/v1/completions", {"model": MODEL, "prompt": long_text}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": long_text}]}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": long_text, "stream": True}, "prompt"),
    ):
        error = assert_error(http.post(path, json=body), 400, param)
        assert str(MAX_MODEL_LEN) in error["message"] and "limit" in error["message"]
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400, "prompt")


def test_image_parts_are_refused_clearly(http):
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    error = assert_error(
        http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": content}]}), 400
    )
    assert "image" in error["message"].lower() and error["param"] == "messages"
    text_parts = [{"type": "text", "text": "hello"}]
    assert (
        http.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": text_parts}]}
        ).status_code
        == 200
    )


def test_body_size_limit(http, auth_server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    assert_error(http.post("/v1/chat/completions", json=big), 413)  # the default 4 MiB limit

    def chunks():  # no Content-Length: the limit applies while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}]}'

    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=auth_server.url, timeout=30) as small:
        assert_error(small.post("/v1/chat/completions", content=chunks(), headers=headers), 413)


def test_api_key(auth_server):
    with httpx.Client(base_url=auth_server.url, timeout=30) as http:
        assert_error(http.get("/v1/models"), 401)
        assert_error(http.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer wrong"}), 401)
        assert http.get("/health").status_code == 200  # not under /v1
    good = openai.OpenAI(base_url=auth_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=auth_server.url + "/v1", api_key="nope", max_retries=0).models.list()


# -- disconnects, cache, metrics --------------------------------------------------------------

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def metric(http, family: str, sample: str) -> float:
    for f in text_string_to_metric_families(http.get("/metrics").text):
        if f.name == family:
            return sum(s.value for s in f.samples if s.name == sample)
    return 0.0


def aborted(http) -> float:
    return metric(http, "vllm:request_aborted", "vllm:request_aborted_total")


def test_disconnect_mid_stream_frees_blocks(http, server):
    wait_blocks_freed(http)
    before = aborted(http)
    with httpx.Client(base_url=server.url, timeout=30) as other:
        with other.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            running = http.get("/v1/cache/stats").json()
            assert received and len(running["requests"]) == 1
            assert next(iter(running["requests"].values()))["num_blocks"] >= 1
    stats = wait_blocks_freed(http)  # the server saw the disconnect and aborted the request
    assert stats["stats"]["num_used_blocks"] == 0
    assert aborted(http) == before + 1  # aborted, not finished by itself


def test_disconnect_while_waiting_for_a_full_response(http, server):
    wait_blocks_freed(http)
    before = aborted(http)
    with httpx.Client(base_url=server.url, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=LONG)
    wait_blocks_freed(http)
    assert aborted(http) == before + 1


def test_cache_stats_and_reset(http, client):
    client.completions.create(model=MODEL, prompt=" ".join(["cache"] * 40), **GREEDY)
    stats = wait_blocks_freed(http)
    assert stats["block_size"] == 16 and stats["stats"]["num_cached_blocks"] > 0
    assert sum(stats["block_states"].values()) == stats["stats"]["num_blocks"] + 1  # + the null block
    assert http.delete("/v1/cache").json() == {"reset": True}
    assert http.get("/v1/cache/stats").json()["stats"]["num_cached_blocks"] == 0


def test_metrics_parse(http, client):
    client.completions.create(model=MODEL, prompt="metrics please", **GREEDY)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hit_rate",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
    ):
        assert name in families, sorted(families)
    generated = [s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert generated and generated[0] >= 12
    ttft_count = [s.value for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0] >= 1


# -- end to end on the real model -------------------------------------------------------------


@pytest.mark.e2e
def test_vllm_mlx_serve_default_model(default_model_dir, tmp_path):
    """``vllm-mlx serve`` as a subprocess on the built-in model answers a chat request."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "vllm_mlx.entrypoints.cli",
        "serve",
        str(default_model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "smol",
        "--kv-cache-memory",
        "64M",
        "--log-level",
        "warning",
    ]
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(proc, port, tmp_path / "server.log", timeout=120, what="vllm-mlx serve")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )
        text = reply.choices[0].message.content
        assert text.strip() and reply.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
