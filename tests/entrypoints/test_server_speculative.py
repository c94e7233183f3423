"""The server with speculative decoding on: the official ``openai`` client gets the same answer
as without it, the response's usage counts the kept and rejected proposals (OpenAI's
``completion_tokens_details``), and ``/metrics`` adds them up. A tiny model whose text repeats
(``test_speculative``'s), live on 127.0.0.1."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from live_server import LiveServer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402

LIKELY = range(2000, 2012)
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running far away."
GREEDY = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return build_tiny_llama(tmp_path_factory.mktemp("repeating"), default_model_dir, likely_tokens=LIKELY)


def serve(model_dir, **options):
    engine = AsyncEngineCore(model=str(model_dir), num_kv_blocks=256, force_model_takeover=True, **options).start()
    return engine, LiveServer(build_app(engine, served_model_name="tiny"))


@pytest.fixture(scope="module")
def plain_answer(model_dir):
    engine, live = serve(model_dir)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        answer = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    finally:
        live.stop()
        engine.stop()
    return answer


@pytest.fixture(scope="module")
def speculating(model_dir, plain_answer):
    # Not adaptive: this is about the counts, so every proposal lookup finds is verified.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    engine, live = serve(model_dir, speculative_config=spec)
    yield live.url
    live.stop()
    engine.stop()


def test_same_answer_and_usage_counts_the_proposals(speculating, plain_answer):
    client = openai.OpenAI(base_url=speculating + "/v1", api_key="none")
    answer = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert answer.choices[0].text == plain_answer.choices[0].text
    assert plain_answer.usage.completion_tokens_details is None  # no speculation, no counts
    details = answer.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    streamed = chunks[-1].usage.completion_tokens_details  # the stream's usage chunk has them too
    assert chunks[-1].usage.completion_tokens == 24
    assert streamed.accepted_prediction_tokens + streamed.rejected_prediction_tokens > 0
    with httpx.Client(base_url=speculating) as http:
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    drafts = families["vllm:spec_decode_num_draft_tokens"].samples[0].value
    accepted = families["vllm:spec_decode_num_accepted_tokens"].samples[0].value
    assert accepted == details.accepted_prediction_tokens + streamed.accepted_prediction_tokens
    assert drafts == accepted + details.rejected_prediction_tokens + streamed.rejected_prediction_tokens
