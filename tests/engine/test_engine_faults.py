"""No request can end the engine: faults injected into one request's work fail that request
alone (the batch goes on, its outputs unchanged, no block leaks); a fault of the engine itself
ends the engine loudly: logged with its traceback, every waiter told, the server exits non-zero.

Faults are injected into the real engine (tiny random-weight llama on real MLX) by wrapping one
of its parts for one request id; nothing is mocked.
"""

from __future__ import annotations

import logging

import pytest
from factories import run_to_end
from test_engine import GREEDY, PROMPTS, solo_tokens

from vllm_mlx import SamplingParams
from vllm_mlx.engine.async_engine import AsyncEngineCore, EngineDeadError

SECRET = "/private/secret/path"  # must never reach a caller


def fail_for(request_id: str, original):
    """Wrap a runner/cache method so that it raises whenever ``request_id`` is part of the call."""

    def wrapped(arg, *args, **kwargs):
        ids = [s.request_id for s in arg.scheduled] if hasattr(arg, "scheduled") else [arg.request_id]
        if request_id in ids:
            raise RuntimeError(f"injected fault reading {SECRET}")
        return original(arg, *args, **kwargs)

    return wrapped


def assert_failed_alone(final, bad: str, good_ids: list[str], expected: list[list[int]]) -> None:
    assert final[bad].finish_reason == "error"
    assert "RuntimeError" in final[bad].error and SECRET not in final[bad].error
    assert [final[rid].outputs[0].token_ids for rid in good_ids] == expected


def test_a_fault_in_the_forward_pass_fails_only_its_request(engine_factory):
    expected = solo_tokens(engine_factory, PROMPTS[:3])
    engine = engine_factory(max_num_batched_tokens=32)
    engine.runner.execute_model = fail_for("bad", engine.runner.execute_model)
    ids = [engine.add_request(p, GREEDY, f"good-{i}") for i, p in enumerate(PROMPTS[:3])]
    engine.step()  # the bad request joins a running batch, mid-prefill of the others
    engine.add_request(PROMPTS[4], GREEDY, "bad")
    final = run_to_end(engine)
    assert_failed_alone(final, "bad", ids, expected)
    assert engine.kv_cache.stats().num_used_blocks == 0
    again = engine.add_request(PROMPTS[0], GREEDY)  # and the engine goes on serving
    assert run_to_end(engine)[again].outputs[0].token_ids == expected[0]


def test_a_fault_in_the_step_update_fails_only_its_request(engine_factory):
    expected = solo_tokens(engine_factory, PROMPTS[:2])
    engine = engine_factory()
    cache = engine.scheduler.kv.prefix_cache
    cache.cache_computed_blocks = fail_for("bad", cache.cache_computed_blocks)
    ids = [engine.add_request(p, GREEDY, f"good-{i}") for i, p in enumerate(PROMPTS[:2])]
    engine.add_request(PROMPTS[2], GREEDY, "bad")
    final = run_to_end(engine)
    assert_failed_alone(final, "bad", ids, expected)
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_a_fault_in_the_output_processing_fails_only_its_request(engine_factory):
    expected = solo_tokens(engine_factory, PROMPTS[:2])
    engine = engine_factory()
    ids = [engine.add_request(p, GREEDY, f"good-{i}") for i, p in enumerate(PROMPTS[:2])]
    engine.add_request(PROMPTS[2], GREEDY, "bad")

    def broken(token_ids):
        raise RuntimeError(f"injected fault reading {SECRET}")

    engine.output_processor._completion_of["bad"].detokenizer.add_tokens = broken
    final = run_to_end(engine)
    assert_failed_alone(final, "bad", ids, expected)
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_the_engine_survives_the_requests_that_used_to_kill_it(engine_factory):
    engine = engine_factory()
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("Hi", SamplingParams(stop_token_ids=[2**63], min_tokens=2))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("Hi", SamplingParams(stop_token_ids=[vocab], min_tokens=2))
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("word " * 40, GREEDY, cache_salt="\ud800")
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("lone \udfff surrogate", GREEDY)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["\ud800"])
    rid = engine.add_request("word " * 40, GREEDY, cache_salt="tenant-\u00e9")
    assert run_to_end(engine)[rid].finish_reason == "length"
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_a_broken_model_ends_the_engine(engine_factory):
    engine = engine_factory()
    engine.add_request(PROMPTS[0], GREEDY)
    engine.add_request(PROMPTS[1], GREEDY)
    engine.runner.attention = None  # every forward fails, the probe too: the engine's fault
    with pytest.raises(AttributeError):
        engine.step()


def test_engine_options_take_the_cli_forms(tiny_model_dir):
    from vllm_mlx.engine.core import EngineConfig
    from vllm_mlx.llm import LLM

    config = EngineConfig(kv_cache_memory="64M", mllm_cache_memory="16M")
    config.normalize()
    assert (config.kv_cache_memory, config.mllm_cache_memory) == (64 << 20, 16 << 20)
    config = EngineConfig(kv_cache_memory="0.25")
    config.normalize()
    assert config.kv_cache_memory == 0.25
    for bad in ({"kv_cache_memory": "lots"}, {"max_num_seqs": "32"}, {"block_size": 0}, {"enable_prefix_caching": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad).normalize()
    llm = LLM(str(tiny_model_dir), kv_cache_memory="8M", force_model_takeover=True)
    try:
        assert llm.engine.config.kv_cache_memory == 8 << 20
    finally:
        llm.engine.shutdown()


# -- the engine thread and the server ------------------------------------------------------------


def test_an_engine_failure_is_logged_at_once_and_reported(tiny_model_dir, caplog):
    engine = AsyncEngineCore(model=str(tiny_model_dir), force_model_takeover=True).start()
    try:
        outputs = iter(engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)))
        next(outputs)
        with caplog.at_level(logging.CRITICAL, logger="vllm_mlx.engine.async_engine"):
            engine.call(lambda core: setattr(core.runner, "attention", None))
            assert engine.wait_ended(30)
        with pytest.raises(EngineDeadError):
            list(outputs)
        assert isinstance(engine.error, AttributeError)
        [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
        assert record.exc_info and "engine failed" in record.getMessage()
    finally:
        engine.stop()


def test_the_server_reports_and_exits_nonzero_when_the_engine_fails(tiny_model_dir):
    import threading

    import httpx
    import uvicorn

    from live_server import free_socket
    from vllm_mlx.entrypoints.openai.server import build_app, serve_until_engine_ends

    engine = AsyncEngineCore(model=str(tiny_model_dir), force_model_takeover=True).start()
    sock, url = free_socket()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, owns_engine=True), log_level="warning"))
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=serve_until_engine_ends(server, engine, sockets=[sock])))
    thread.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not server.started:
                thread.join(0.05)
            assert http.get("/health").status_code == 200
            engine.call(lambda core: setattr(core.runner, "attention", None))
            dead = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert dead.status_code == 503, dead.text
            assert SECRET not in dead.text and "Error(" not in dead.text
    finally:
        thread.join(30)
    assert not thread.is_alive() and result["code"] == 1
    engine.stop()


def test_health_says_why_the_engine_is_down(tiny_model_dir):
    import httpx

    from live_server import LiveServer
    from vllm_mlx.entrypoints.openai.server import build_app

    engine = AsyncEngineCore(model=str(tiny_model_dir), force_model_takeover=True).start()
    live = LiveServer(build_app(engine))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            engine.call(lambda core: setattr(core.runner, "attention", None))
            engine.add_request("Hello", SamplingParams(max_tokens=2))
            assert engine.wait_ended(30)
            health = http.get("/health")
            assert health.status_code == 503
            assert "AttributeError" in health.json()["error"]["message"]
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                               ("/v1/completions", {"prompt": "Hi"})):  # fmt: skip
                response = http.post(path, json=body)
                assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
            assert http.get("/v1/cache/stats").status_code == 503
    finally:
        live.stop()
        engine.stop()
