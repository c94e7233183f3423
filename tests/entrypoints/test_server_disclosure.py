"""What the server's cache numbers disclose: no prefix-cache oracle by default, per-tenant counters
for an operator who turns disclosure on, the API key on every endpoint but the probes, and the
Anthropic and Responses ids findable in the blocks view.

The attack these close: a client guesses the start of another tenant's prompt (same
``cache_salt``, or none) one block at a time and reads, after each guess, how many of its tokens
came from the prefix cache (a right guess: one block more). One tiny-model engine serves every
app here, live on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import math
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cache_observer import after_guess, differences, wait_idle  # noqa: E402
from live_server import LiveServer  # noqa: E402

from vllm_mlx.core.kv.tenant_stats import TenantCacheCounters, tenant_label  # noqa: E402
from vllm_mlx.core.request import SamplingParams  # noqa: E402
from vllm_mlx.core.snapshot import CacheSnapshot  # noqa: E402
from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.cli import build_parser  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app, summarize_snapshot  # noqa: E402
from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402

BLOCK = 16
KEY = "sk-disclosure"
FIRST_BLOCK = list(range(100, 100 + BLOCK))  # the secret's first block: already guessed
SECRET_BLOCK = list(range(300, 300 + BLOCK))  # the block being guessed
WRONG_BLOCK = list(range(500, 500 + BLOCK))
LONG_OUTPUT = {"regex": "[a-z]{4000}"}  # no end of text before max_tokens: the request stays live


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncEngineCore(
        model=str(tiny_model_dir), num_kv_blocks=128, block_size=BLOCK, max_model_len=1024, force_model_takeover=True
    ).start()
    yield eng
    eng.stop()


def serve_with(engine, **kwargs):
    live = LiveServer(build_app(engine, served_model_name="tiny", **kwargs))
    return live, httpx.Client(base_url=live.url, timeout=60, headers={"authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def default(engine):
    live, http = serve_with(engine)  # the operator's defaults
    yield http
    http.close()
    live.stop()


@pytest.fixture(scope="module")
def disclosed(engine):
    live, http = serve_with(engine, options=ServingOptions(enable_cache_stats_disclosure=True))
    yield http
    http.close()
    live.stop()


def complete(http, prompt: list[int], max_tokens: int = 2, **extra) -> dict:
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True, **extra})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()


def guess(http, block: list[int]) -> dict[str, object]:
    """The attack's step: the victim's secret, then a guess of its second block."""
    return after_guess(http, FIRST_BLOCK + SECRET_BLOCK + [7, 8, 9, 10, 11], FIRST_BLOCK + block + [1, 2, 3])


def test_a_right_and_a_wrong_guess_look_the_same_by_default(default, disclosed):
    right, wrong = guess(default, SECRET_BLOCK), guess(default, WRONG_BLOCK)
    assert differences(right, wrong) == {}
    assert right["stats.stats.num_used_blocks"] == 0 and set(right["blocks.block_states"]) == {"n", "f"}
    assert not any("prefix" in key or "cached" in key or "hit" in key for key in right)  # nothing hit-derived at all
    assert right["stats.cache_stats_disclosed"] is False
    # The same attack where the operator disclosed the counters: the oracle the finding described.
    right, wrong = guess(disclosed, SECRET_BLOCK), guess(disclosed, WRONG_BLOCK)
    assert (right["stats.stats.prefix_cache.hit_tokens"], wrong["stats.stats.prefix_cache.hit_tokens"]) == (32, 16)
    assert right["metrics.vllm:prefix_cache_hits_total[('model_name', 'tiny')]"] == 32
    assert wrong["stats.stats.allocations"] == right["stats.stats.allocations"] + 1  # a hit takes no new block
    assert right["blocks.block_states"] != wrong["blocks.block_states"]  # one cached block more after a miss


def test_usage_counts_lengths_not_shared_blocks(engine):
    """While two requests share their prefix's blocks, the default stats count each request's
    own length in blocks: the shared blocks would tell that the prompts began alike."""
    prompt = FIRST_BLOCK + SECRET_BLOCK + [5, 6, 7]
    params = SamplingParams(max_tokens=400, min_tokens=400, temperature=0)
    first = engine.add_request(prompt, params, "sharer-1")
    try:
        _wait(lambda: engine.cache_snapshot()["requests"].get("sharer-1", {}).get("num_output_tokens"))
        second = engine.add_request(prompt, params, "sharer-2")
        _wait(lambda: engine.cache_snapshot()["requests"].get("sharer-2", {}).get("num_output_tokens"))
        snapshot = engine.cache_snapshot()  # one moment: lengths and blocks agree
        views = [snapshot["requests"][rid] for rid in ("sharer-1", "sharer-2")]
        own_blocks = sum(math.ceil((v["num_prompt_tokens"] + v["num_output_tokens"]) / BLOCK) for v in views)
        assert snapshot["stats"]["num_used_blocks"] < own_blocks  # they do share (the engine's view)
        public = summarize_snapshot(CacheSnapshot.from_dict(snapshot))
        assert public["stats"]["num_used_blocks"] == own_blocks
        free = snapshot["stats"]["num_blocks"] - own_blocks  # the pool less the null block
        assert public["block_states"] == {"null": 1, "used": own_blocks, "free": free}
        disclosed = summarize_snapshot(CacheSnapshot.from_dict(snapshot), ServingOptions(enable_cache_stats_disclosure=True))
        assert disclosed["stats"] == snapshot["stats"]
    finally:
        engine.abort("sharer-1")
        engine.abort("sharer-2")
    del first, second


def _wait(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_per_tenant_counters_when_disclosed(engine, disclosed):
    prompt = list(range(700, 700 + 2 * BLOCK + 8))  # two full blocks and a partial one
    for salt in ("tenant-a", "tenant-a", "tenant-b"):  # tenant-a's second request hits its first
        complete(disclosed, prompt, cache_salt=salt)
    wait_idle(disclosed)
    tenants = disclosed.get("/v1/cache/stats").json()["stats"]["prefix_cache_tenants"]
    a, b = tenants[tenant_label("tenant-a")], tenants[tenant_label("tenant-b")]
    assert (a["queries"], a["hits"], a["hit_tokens"], a["query_tokens"]) == (2, 1, 2 * BLOCK, 2 * len(prompt))
    assert (b["queries"], b["hits"], b["hit_tokens"]) == (1, 0, 0)  # a salt shares nothing with another
    assert a["allocations"] == 2 * b["allocations"] - 2  # the hit took its two blocks from the cache
    assert "tenant-a" not in str(tenants)  # labels, never the salts
    blocks = disclosed.get("/v1/cache/blocks").json()["stats"]["prefix_cache_tenants"]
    assert blocks[tenant_label("tenant-a")] == a
    series = {(s.name, s.labels.get("tenant")): s.value
              for f in text_string_to_metric_families(disclosed.get("/metrics").text) for s in f.samples}  # fmt: skip
    assert series[("vllm_mlx:tenant_prefix_cache_hits_total", tenant_label("tenant-a"))] == 2 * BLOCK
    assert series[("vllm_mlx:tenant_kv_block_allocations_total", tenant_label("tenant-b"))] == b["allocations"]


def test_other_disclosure_switches_show_counters_but_no_tenants(engine):
    """``--enable-prompt-tokens-details`` already tells a caller its hits: the aggregate counters
    are shown with it (hiding them would protect nothing), the per-tenant ones are not."""
    live, http = serve_with(engine, options=ServingOptions(enable_prompt_tokens_details=True))
    try:
        stats = http.get("/v1/cache/stats").json()
        assert stats["cache_stats_disclosed"] and "prefix_cache" in stats["stats"]
        assert "prefix_cache_tenants" not in stats["stats"]
        assert "prefix_cache_tenants" not in http.get("/v1/cache/blocks").json()["stats"]
        assert "vllm:prefix_cache_hits_total" in http.get("/metrics").text
        assert "vllm_mlx:tenant_" not in http.get("/metrics").text
    finally:
        http.close()
        live.stop()


def test_the_api_key_guards_every_endpoint_but_the_probes(engine):
    live, http = serve_with(engine, api_key=KEY)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as anonymous:
            for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/v1/models",
                         "/v1/cache/stats", "/nowhere"):  # fmt: skip
                response = anonymous.get(path)
                assert response.status_code == 401, (path, response.status_code)
                assert response.json()["error"]["code"] == "invalid_api_key"
                wrong = anonymous.get(path, headers={"authorization": "Bearer nope"})
                assert wrong.status_code == 401, path
            assert anonymous.get("/health").status_code == 200
            assert anonymous.get("/version").status_code == 200
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 200, path
        assert http.get("/metrics", headers={"authorization": "", "x-api-key": KEY}).status_code == 200
        assert "vllm:num_requests_running" in http.get("/metrics").text
    finally:
        http.close()
        live.stop()


def test_anthropic_and_responses_ids_are_found_in_the_blocks_view(engine, default):
    url = str(default.base_url).rstrip("/")
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    with messages.messages.create(
        model="tiny", max_tokens=800, messages=[{"role": "user", "content": "Hi"}], stream=True,
        extra_body={"structured_outputs": LONG_OUTPUT},
    ) as events:  # fmt: skip
        message_id = next(iter(events)).message.id  # message_start
        assert_live(default, message_id)
    responses = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with responses.responses.create(
        model="tiny", input="Hi", max_output_tokens=800, stream=True, extra_body={"structured_outputs": LONG_OUTPUT}
    ) as events:
        response_id = next(iter(events)).response.id  # response.created
        assert_live(default, response_id)
    wait_idle(default)  # closing the streams aborted both


def assert_live(http, request_id: str) -> None:
    view = http.get("/v1/cache/blocks", params={"request_id": request_id}).json()
    assert list(view["requests"]) == [request_id], view["requests"]
    assert view["requests"][request_id]["status"] == "RUNNING"


def test_tenant_counters_are_bounded_and_never_keep_a_salt():
    counters = TenantCacheCounters(max_tenants=2)
    for salt in (None, "alpha", "beta", "gamma"):  # clients choose salts: the table stays bounded
        counters.record_query(salt, 40, 16)
        counters.record_allocations(salt, 3)
    tenants = counters.to_dict()
    assert list(tenants) == ["none", tenant_label("alpha"), "other"]
    assert tenants["other"] == {"queries": 2, "query_tokens": 80, "hits": 2, "hit_tokens": 32, "allocations": 6}
    assert tenant_label("alpha") == "sha256:" + hashlib.sha256(b"alpha").hexdigest()[:16]
    assert tenant_label("\ud800").startswith("sha256:")  # any str (the engine API takes what the server refuses)


def test_the_serve_flag_turns_disclosure_on():
    args = build_parser().parse_args(["serve", "some/model", "--enable-cache-stats-disclosure"])
    assert args.enable_cache_stats_disclosure
    assert not build_parser().parse_args(["serve", "some/model"]).enable_cache_stats_disclosure
