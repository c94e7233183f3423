"""Chat templates are code from a model's files: they render in time- and memory-limited worker
processes (``engine/template_guard.py``). A template that loops for hours or builds a string of
gigabytes fails the request that triggered it, with a clear error; other requests, and the next
render, are served; what a template renders is exactly what the tokenizer renders in-process.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import threading
import time

import pytest

from vllm_mlx.engine.chat import template_text, template_token_ids
from vllm_mlx.engine.template_guard import ChatTemplateError, TemplateGuard, TemplateOverrun, template_guard

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
"""10^10 iterations: hours in Jinja's sandbox, which lets it through."""
GIGABYTES = "{{ 'a' * 10**10 }}"
"""A 10 GB string, which the sandbox lets through too."""
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIGGER = "loop forever"
LOOPS_ON_TRIGGER = "{% if messages[-1]['content'] == '" + TRIGGER + "' %}" + LOOPS + "{% endif %}" + CHATML
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]  # fmt: skip


def load_tokenizer(model_dir, chat_template: str | None = None):
    from mlx_lm.utils import load_tokenizer as load

    tokenizer = load(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_renders_exactly_what_the_tokenizer_renders(tokenizer):
    for messages, tools, add in ((MESSAGES, None, True), (MESSAGES, TOOLS, True), (MESSAGES[:1], None, False)):
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add, tokenize=False, **({"tools": tools} if tools else {})
        )
        assert template_guard().render(tokenizer, messages, add_generation_prompt=add, tools=tools) == expected
    expected_ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert template_token_ids(tokenizer, MESSAGES) == expected_ids


def test_a_template_that_refuses_the_messages_says_why(default_model_dir):
    refusing = load_tokenizer(default_model_dir, "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate") as caught:
        template_text(refusing, MESSAGES)
    assert not isinstance(caught.value, TemplateOverrun)


def test_a_template_that_loops_is_stopped_and_the_next_render_is_served(tokenizer, default_model_dir):
    guard = TemplateGuard(timeout_s=1.0, max_workers=1)
    try:
        looping = load_tokenizer(default_model_dir, LOOPS)
        guard.warm(tokenizer)  # starts the worker: what is timed below is a tokenizer load and the loop
        started = time.monotonic()
        with pytest.raises(TemplateOverrun, match="took longer than 1 s; it was stopped"):
            guard.render(looping, MESSAGES, add_generation_prompt=True, tools=None)
        assert time.monotonic() - started < 30  # unguarded, it runs for hours
        assert guard.workers.started() == []  # the looping worker was killed, not kept
        expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert guard.render(tokenizer, MESSAGES, add_generation_prompt=True, tools=None) == expected
    finally:
        guard.close()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS caps the worker on Linux (elsewhere the deadline does)")
def test_a_template_that_builds_gigabytes_fails_in_its_worker(tokenizer, default_model_dir):
    guard = TemplateGuard(memory_bytes=256 << 20, max_workers=1)
    try:
        huge = load_tokenizer(default_model_dir, GIGABYTES)
        with pytest.raises(TemplateOverrun, match="needed more than 256 MiB of memory"):
            guard.render(huge, MESSAGES, add_generation_prompt=True, tools=None)
        expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert guard.render(tokenizer, MESSAGES, add_generation_prompt=True, tools=None) == expected
    finally:
        guard.close()


class _Unpicklable:
    """A tokenizer whose class the worker could not import (as one from a model directory's code)."""

    chat_template = CHATML

    def __init__(self) -> None:
        self.lock = threading.Lock()  # refuses pickling

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs) -> str:
        return "here:" + messages[-1]["content"]


def test_a_tokenizer_that_cannot_be_sent_renders_here_and_says_so(caplog):
    guard = TemplateGuard(max_workers=1)
    with caplog.at_level(logging.WARNING, logger="vllm_mlx.engine.template_guard"):
        assert guard.render(_Unpicklable(), MESSAGES, add_generation_prompt=True, tools=None) == "here:What is 2+2?"
    assert "without a time limit" in caplog.text
    assert guard.workers.started() == []  # no worker was needed


# -- the server: a template that loops on one conversation fails that request alone ----------------------------


@pytest.fixture(scope="module")
def looping_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, whose chat template loops for hours when the last message is ``TRIGGER``."""
    out = tmp_path_factory.mktemp("looping-template")
    for path in tiny_model_dir.iterdir():
        shutil.copy(path, out / path.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = LOOPS_ON_TRIGGER
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_the_server_fails_the_looping_request_alone(looping_model_dir, monkeypatch):
    httpx = pytest.importorskip("httpx")
    from live_server import LiveServer

    from vllm_mlx.engine.async_engine import AsyncEngineCore
    from vllm_mlx.entrypoints.openai.server import build_app

    monkeypatch.setattr(template_guard(), "timeout_s", 3.0)
    engine = AsyncEngineCore(model=str(looping_model_dir), num_kv_blocks=64, max_model_len=256).start()
    live = LiveServer(build_app(engine, served_model_name="tiny"))
    try:
        with httpx.Client(base_url=live.url, timeout=120) as http:

            def chat(content: str):
                body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3}
                return http.post("/v1/chat/completions", json=body)

            looping: dict = {}
            thread = threading.Thread(target=lambda: looping.update(response=chat(TRIGGER)))
            thread.start()
            served = chat("Hello")  # while the loop holds one worker, another serves this
            assert served.status_code == 200, served.text
            assert "response" not in looping or looping["response"].status_code == 400
            thread.join(120)
            response = looping["response"]
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert message.startswith("The chat template could not render the messages: ")
            assert "took longer than 3 s; it was stopped" in message
            assert chat("Hello again").status_code == 200
            assert http.get("/health").status_code == 200
    finally:
        live.stop()
        engine.stop()
