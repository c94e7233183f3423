"""The server's safe defaults, one regression test per finding of the hardening review: a hostile
body gets a clear 4xx and fails alone, the engine keeps serving, and one client learns nothing of
another's prompts or of the host. (Media and model-code findings: test_media_policy.py and
test_model_trust.py.)

A tiny-model engine with the server's default options, live on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from live_server import LiveServer  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402
from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402
from vllm_mlx.platform.validation import RequestLimits  # noqa: E402

SECRET = "/private/secret/path"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several full blocks


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncEngineCore(
        model=str(tiny_model_dir), num_kv_blocks=256, max_model_len=1024, max_num_seqs=4, force_model_takeover=True
    ).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def http(engine):
    live = LiveServer(build_app(engine, served_model_name="tiny"))  # the defaults
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client
    live.stop()


@pytest.fixture(scope="module")
def raised(engine):
    """The same engine behind an operator who raised the caps."""
    limits = RequestLimits(max_prompts_per_request=64, max_n=8, max_stop_string_length=20_000)
    live = LiveServer(build_app(engine, served_model_name="tiny", options=ServingOptions(limits=limits)))
    with httpx.Client(base_url=live.url, timeout=120) as client:
        yield client
    live.stop()


def post_raw(http, path: str, body_text: str):
    """Send a JSON text as is (json.dumps escapes a lone surrogate as \\ud800, legal JSON)."""
    return http.post(path, content=body_text.encode(), headers={"content-type": "application/json"})


def assert_400(response, *needles: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    for needle in needles:
        assert needle in error["message"], error
    return error


def assert_serving(http) -> None:
    """The engine is alive, answers a normal request, and no KV block is held."""
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while http.get("/v1/cache/stats").json()["stats"]["num_used_blocks"]:
        assert time.monotonic() < deadline, "blocks leaked"
        time.sleep(0.05)


def test_a_huge_stop_token_id_is_a_400_not_a_dead_engine(http):
    body = {"prompt": "Hello", "max_tokens": 4, "stop_token_ids": [9223372036854775808], "min_tokens": 2}
    assert_400(http.post("/v1/completions", json=body), "stop_token_ids")
    body["stop_token_ids"] = [10**6]  # in int64, outside the vocabulary
    assert_400(http.post("/v1/completions", json=body), "stop_token_ids")
    assert_serving(http)


def test_unpaired_surrogates_are_400s_everywhere(http):
    cases = [
        ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 2, "cache_salt": "\ud800"}, "cache_salt"),
        ("/v1/completions", {"prompt": "lone \ud800 surrogate", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "bad \udfff"], "max_tokens": 2}, "prompt.1"),
        ("/v1/completions", {"prompt": "Hi", "model": "\ud800", "max_tokens": 2}, "model"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["\ud800"], "max_tokens": 2}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "text"),
    ]
    for path, body, where in cases:
        assert_400(post_raw(http, path, json.dumps(body)), where, "Unicode")
    assert_serving(http)


def test_malformed_image_parts_are_400s_on_a_text_model(http):
    for part in ({"type": "image_url", "image_url": {"url": ""}}, {"type": "image_url", "image_url": ""},
                 {"type": "image_url", "image_url": {"url": "/etc/passwd"}}):  # fmt: skip
        body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]}
        error = assert_400(http.post("/v1/chat/completions", json=body))
        assert "passwd" not in error["message"]
    assert_serving(http)


def test_stop_strings_and_n_are_capped_by_default(http, raised):
    long_stop = {"prompt": "Hi", "max_tokens": 8, "stop": ["x" * 16_000], "n": 64}
    error = assert_400(http.post("/v1/completions", json=long_stop), "--max-n")
    assert error["param"] == "n" and error["code"] == "limit_exceeded"
    long_stop["n"] = 2
    assert_400(http.post("/v1/completions", json=long_stop), "--max-stop-string-length")
    many = {"prompt": "Hi", "max_tokens": 8, "stop": [f"s{i}" for i in range(10_000)]}
    assert_400(http.post("/v1/completions", json=many), "--max-stop-strings")
    long_stop["n"] = 8  # an operator who raised the caps serves it, in bounded time
    started = time.monotonic()
    response = raised.post("/v1/completions", json=long_stop)
    assert response.status_code == 200 and len(response.json()["choices"]) == 8
    assert time.monotonic() - started < 30
    assert_serving(http)


def test_thousands_of_prompts_are_refused_before_any_work(http):
    body = {"prompt": [f"p{i}" for i in range(3000)], "max_tokens": 2}
    started = time.monotonic()
    assert_400(http.post("/v1/completions", json=body), "3000 prompts", "--max-prompts-per-request")
    assert time.monotonic() - started < 5
    assert_serving(http)


def test_a_small_request_is_not_starved_by_a_large_batch(raised, engine):
    big = {"prompt": [f"Story number {i}:" for i in range(48)], "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    done = {}

    def send_big() -> None:
        done["big_status"] = raised.post("/v1/completions", json=big).status_code
        done["big"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.stats().scheduler.waiting == 0:  # until the batch fills the 4 seats and queues
        assert time.monotonic() < deadline and thread.is_alive(), "the batch never queued"
        time.sleep(0.01)
    assert raised.post("/v1/chat/completions", json=small).status_code == 200
    done["small"] = time.monotonic()
    thread.join(120)
    assert done["big_status"] == 200
    assert done["small"] < done["big"], "the small request waited for the whole batch"


def test_no_tenant_detail_or_host_path_by_default(http, engine, tiny_model_dir):
    for _ in range(2):  # the second time the prompt's full blocks come from the prefix cache
        response = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["usage"].get("prompt_tokens_details") is None
    stats = http.get("/v1/cache/stats").json()
    assert "requests" not in stats and isinstance(stats["request_states"], dict)
    models = http.get("/v1/models").text
    assert str(tiny_model_dir) not in models and "/tmp" not in models


def test_an_internal_failure_is_a_500_without_details_and_fails_alone(http, engine):
    def inject(core) -> None:
        original = core.runner.execute_model

        def execute(scheduler_output):
            if any(s.request.prompt_token_ids[-1] == 999 for s in scheduler_output.scheduled):
                raise RuntimeError(f"cannot open {SECRET}")
            return original(scheduler_output)

        core.runner.execute_model = execute
        return original

    original = engine.call(inject)
    try:
        response = http.post("/v1/completions", json={"prompt": [5, 6, 999], "max_tokens": 2})
        assert response.status_code == 500, response.text
        assert SECRET not in response.text and "RuntimeError(" not in response.text
        assert_serving(http)
    finally:
        engine.call(lambda core: setattr(core.runner, "execute_model", original))
