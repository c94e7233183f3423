"""The ``%%generate`` / ``%vllm_mlx`` magics in a real IPython shell, on the tiny llama.

Every wait is bounded: a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from vllm_mlx_jupyter.session.generation import ABORTED, DONE
from vllm_mlx_jupyter.session.prompt import interpolate
from notebook_shell import generate, loaded_shell

TIMEOUT = 60.0
NUM_KV_BLOCKS = 256
LONG = "--min-tokens 1500 --max-tokens 1500 --temperature 0"  # seconds on the tiny model: aborts land mid-stream


@pytest.fixture(scope="module")
def ip(tiny_model_dir):
    with loaded_shell(tiny_model_dir, {"num_kv_blocks": NUM_KV_BLOCKS}, max_tokens=16) as shell:
        yield shell


@pytest.fixture
def magics(ip):
    from vllm_mlx_jupyter import _MAGICS

    return _MAGICS[id(ip)]


# -- the extension ------------------------------------------------------------------------


def test_load_ext_is_light_and_unload_stops_the_engine(tiny_model_dir):
    """In a fresh interpreter: no MLX until a model loads; %unload_ext stops it and the magics."""
    script = textwrap.dedent(f"""
        import sys
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.utils.capture import capture_output
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "vllm_mlx_jupyter")
        assert "mlx" not in sys.modules and "mlx.core" not in sys.modules, "mlx imported by %load_ext"
        assert ip.find_cell_magic("generate") and ip.find_line_magic("vllm_mlx")
        with capture_output():
            ip.run_line_magic("vllm_mlx", "load {tiny_model_dir} --num-kv-blocks 64")
            gen = ip.run_cell_magic("generate", "--max-tokens 4 --wait", "Hi")
        assert gen.done and gen.state == "done", gen.state
        from vllm_mlx_jupyter import _MAGICS
        engine = _MAGICS[id(ip)].session.engine
        ip.run_line_magic("unload_ext", "vllm_mlx_jupyter")
        assert not engine.is_running
        assert ip.find_cell_magic("generate") is None and ip.find_line_magic("vllm_mlx") is None
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_config_traits_set_the_defaults(ip, magics):
    ip.run_line_magic("config", "GenerateMagics.max_tokens = 5")
    try:
        gen = generate(ip, "--temperature 0 --wait")
        assert len(gen.output.token_ids) <= 5 and gen.params.max_tokens == 5
    finally:
        ip.run_line_magic("config", "GenerateMagics.max_tokens = 16")
    ip.run_line_magic("config", "GenerateMagics.update_interval = 0.01")
    assert magics.update_interval == 0.1  # never more than 10 updates a second
    ip.run_line_magic("config", "GenerateMagics.update_interval = 0.1")


# -- flags and errors ---------------------------------------------------------------------


@pytest.mark.parametrize("line, message", [
    ("--bogus", "unrecognized arguments"),
    ("--max-tokens many", "invalid int value"),
    ("--format html", "invalid choice"),
    ("--temperature -1", "temperature"),
    ("--top-p 2", "top_p"),
    ('--stop "unclosed', "quotation"),
])  # fmt: skip
def test_bad_flags_raise_usage_errors_with_help(ip, line, message):
    with pytest.raises(UsageError) as info:
        generate(ip, line)
    assert message in str(info.value)
    if "unrecognized" in message:
        assert "--max-tokens" in str(info.value)  # the help comes with it


def test_line_comments_quotes_and_escapes(ip):
    gen = generate(ip, "--wait --max-tokens 2 --stop '\\n' --stop \"#\" -n tag#1  # a comment", "Hi")
    assert gen.name == "tag#1" and gen.params.stop == ["\n", "#"]
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "status  # how are we doing?")
    assert "KV usage" in out.outputs[0].data["text/plain"]


def test_empty_cell_and_images_are_refused_clearly(ip):
    with pytest.raises(UsageError, match="empty"):
        generate(ip, "", "  \n ")
    with pytest.raises(UsageError, match="no such file"):
        generate(ip, "--image /nonexistent/cat.png")
    ip.user_ns["picture"] = b"\x89PNG..."
    with pytest.raises(UsageError, match="text-only"):  # this kernel's model has no vision tower
        generate(ip, "--image picture", "Describe it.")


def test_unknown_subcommand_and_names(ip):
    with pytest.raises(UsageError, match="unknown command"):
        ip.run_line_magic("vllm_mlx", "frobnicate")
    with pytest.raises(UsageError, match="no generation named"):
        ip.run_line_magic("vllm_mlx", "wait nobody")
    with pytest.raises(UsageError, match="no chat session"):
        ip.run_line_magic("vllm_mlx", "history nobody")
    with pytest.raises(UsageError, match="unrecognized"):
        ip.run_line_magic("vllm_mlx", "load --no-such-option 3")


# -- prompts ------------------------------------------------------------------------------


def test_interpolation_replaces_only_existing_values():
    import json

    ns = {"topic": "the sea", "n": 3, "json": json, "value": 1.5, "f": lambda: 0}
    assert interpolate("About {topic}, {n} lines", ns) == "About the sea, 3 lines"
    assert interpolate("{missing} stays", ns) == "{missing} stays"
    assert interpolate('{"a": 1} and {1, 2}', ns) == '{"a": 1} and {1, 2}'
    assert interpolate('print(f"{value:>10}")', ns) == 'print(f"{value:>10}")'
    assert interpolate("jinja {{ topic }} {{topic}}", ns) == "jinja {{ topic }} {{topic}}"
    assert interpolate("{json} {f}", ns) == "{json} {f}"  # modules and functions are not values
    assert interpolate("def g(): return {n}", ns) == "def g(): return 3"


def test_cell_interpolation_raw_braces_and_no_line_expansion(ip):
    ip.user_ns.update(topic="the sea", x="EXPANDED")
    gen = generate(ip, "--raw --wait --max-tokens 1", 'Write about {topic} and {missing}: {"k": 1}')
    assert gen.prompt == 'Write about the sea and {missing}: {"k": 1}'
    gen = generate(ip, "--raw --wait --max-tokens 1", "{In} {Out} {_} {_i} {_oh} {get_ipython} on {topic}")
    assert gen.prompt == "{In} {Out} {_} {_i} {_oh} {get_ipython} on the sea"  # never IPython's history
    gen = generate(ip, "--raw --raw-braces --wait --max-tokens 1", "Write about {topic}")
    assert gen.prompt == "Write about {topic}"
    gen = generate(ip, "-n $x --raw --wait --max-tokens 1", "Hi")  # IPython's $var expansion is off
    assert gen.name == "$x"


def test_chat_template_and_system_prompt(ip, magics):
    gen = generate(ip, "--wait --max-tokens 1 --system 'You are terse.'", "Hello there")
    tokenizer = magics.session._tokenizer
    text = tokenizer.decode(gen.prompt)
    assert "You are terse." in text and "Hello there" in text and "<|im_start|>assistant" in text


# -- handles ------------------------------------------------------------------------------


def test_handle_out_var_result_and_await(ip):
    gen = generate(ip, "-n handle -o answer --temperature 0")
    assert ip.user_ns["answer"] is gen
    text = gen.result(timeout=TIMEOUT)
    assert gen.done and gen.state == DONE and text == gen.text == gen.output.text
    assert gen.output.finished and len(gen.output.token_ids) == 16

    async def awaited():
        return await gen

    assert asyncio.run(asyncio.wait_for(awaited(), TIMEOUT)) == text
    again = generate(ip, "-n handle --temperature 0")  # a finished name can be reused
    assert asyncio.run(asyncio.wait_for(_await(again), TIMEOUT)) == text  # greedy: same text


async def _await(gen):
    return await gen


def test_wait_flag_blocks_until_done(ip):
    gen = generate(ip, "--wait")
    assert gen.done and gen.state == DONE


def test_interrupt_during_wait_aborts_and_raises(ip):
    ip.user_ns.pop("interrupted", None)

    def interrupt_once_streaming() -> None:
        # Not a fixed delay: on a loaded machine the cell may not be waiting yet after 0.5 s.
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            gen = ip.user_ns.get("interrupted")
            if gen is not None and gen.output is not None and gen.output.token_ids:
                break
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    # A kernel turns SIGINT into KeyboardInterrupt; make sure no earlier test left another handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_streaming, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            generate(ip, f"-n interrupted -o interrupted --wait {LONG}")
    finally:
        signal.signal(signal.SIGINT, previous)
    gen = ip.user_ns["interrupted"]
    assert gen.wait(TIMEOUT) and gen.state == ABORTED and gen.output.finish_reason == "abort"
    assert 0 < len(gen.output.token_ids) < 1500


def test_abort_by_name_all_and_cancel(ip):
    one = generate(ip, f"-n one {LONG}")
    two = generate(ip, f"-n two {LONG}")
    three = generate(ip, f"-n three {LONG}")
    with pytest.raises(UsageError, match="still running"):
        generate(ip, "-n one")
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "abort one")
    assert "aborted: one" in out.stdout
    assert one.wait(TIMEOUT) and one.state == ABORTED
    assert three.cancel() and three.wait(TIMEOUT) and three.state == ABORTED
    assert not three.cancel()  # already finished
    with capture_output():
        ip.run_line_magic("vllm_mlx", "abort all")
    assert two.wait(TIMEOUT) and two.state == ABORTED
    assert two.result() == two.text  # an aborted generation returns its partial text


def test_three_cells_in_a_row_share_engine_steps(ip, magics):
    gens = [generate(ip, f"-n batch{i} --max-tokens 300 --temperature 0", f"Story number {i}") for i in range(3)]
    with capture_output():
        ip.run_line_magic("vllm_mlx", "wait batch0 batch1 batch2")
    assert all(g.state == DONE for g in gens)
    records = magics.session.engine.call(lambda engine: list(engine.step_records))
    names = {"batch0", "batch1", "batch2"}
    assert any(names <= set(r.request_ids) for r in records), "the three requests never ran in one step"


def test_a_cell_may_speculate_or_not(ip, magics):
    """``--speculative`` on an engine loaded without a config: n-gram lookup for that cell only;
    the text is the one ``--no-speculative`` gives."""
    text = "one two three four, one two three four, one two three four, one two three four"
    plain = generate(ip, "--no-speculative --temperature 0 --max-tokens 24", text)
    assert plain.speculative is False
    expected = plain.result(timeout=TIMEOUT)
    asked = generate(ip, "--speculative --temperature 0 --max-tokens 24", text)
    assert asked.speculative is True and asked.result(timeout=TIMEOUT) == expected
    speculator = magics.session.engine.call(lambda engine: engine.speculator)
    assert speculator is not None and speculator.by_default is False  # other cells do not speculate


def test_live_output_is_throttled_and_ends_with_the_final_text(ip):
    with capture_output() as out:
        gen = ip.run_cell_magic("generate", "-n live --max-tokens 200 --temperature 0", "Go")
        assert gen.wait(TIMEOUT)
    ids = [o.transient["display_id"] for o in out.outputs if not o.update and o.transient]
    status_id, body_id = ids[0], ids[-1]
    body = [o for o in out.outputs if o.update and o.transient["display_id"] == body_id]
    status = [o for o in out.outputs if o.update and o.transient["display_id"] == status_id]
    assert body[-1].data["text/plain"] == gen.text
    assert status[-1].data["text/plain"].startswith("live · done (length) · 200 tokens")
    elapsed = gen.output.finish_time - gen.output.arrival_time
    assert 1 <= len(body) <= elapsed * 10 + 2  # <= 10 updates a second, plus the final one
    assert 'data-state="done"' in status[-1].data["text/html"]


def test_formats(ip):
    with capture_output() as out:
        gen = ip.run_cell_magic("generate", "--format code --wait --max-tokens 4", "code")
    assert out.outputs[-1].data["text/html"].startswith('<div class="vllm-mlx-text"><pre><code>')
    assert "text/markdown" not in out.outputs[-1].data  # model text is never sent as raw Markdown
    with capture_output() as out:
        ip.run_cell_magic("generate", "--format text --wait --max-tokens 4", "text")
    assert set(out.outputs[-1].data) == {"text/plain"}
    assert gen.format == "code"


# -- chat sessions ------------------------------------------------------------------------


def test_chat_turns_chain_and_reuse_the_prefix_cache(ip, magics):
    first = generate(ip, "--chat trip --system 'You are a travel guide.' --temperature 0", "Suggest a city in Italy.")
    second = generate(ip, "--chat trip --temperature 0", "What should I eat there?")  # waits for the first
    assert second.result(TIMEOUT) is not None and first.done
    assert (first.name, second.name) == ("trip-1", "trip-2")
    assert second.prompt[: len(first.prompt)] == first.prompt  # the earlier turn is the prefix
    assert second.output.num_cached_tokens >= len(first.prompt) // 16 * 16 > 0
    chat = magics.session.chats["trip"]
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == first.text
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "history trip")
    assert "[system] You are a travel guide." in out.stdout and "What should I eat there?" in out.stdout
    with capture_output():
        ip.run_line_magic("vllm_mlx", "reset trip")
    assert "trip" not in magics.session.chats
    with pytest.raises(UsageError, match="--raw"):
        generate(ip, "--chat other --raw")


def test_a_chat_is_saved_loaded_and_forked(ip, magics, tmp_path, monkeypatch):
    """``save-cache``/``load-cache`` keep a chat's turns and KV for a later kernel (here: the
    session and the prefix cache forgotten); ``fork`` goes on from the same blocks."""
    monkeypatch.setenv("VLLM_MLX_CACHE", str(tmp_path))  # where saved/ goes
    line = "--chat keep --system 'Answer briefly.' --wait --max-tokens 8 --temperature 0"
    generate(ip, line, "Tell me about lighthouses.")
    generate(ip, line, "And about harbours?")
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "save-cache kept keep")
    assert "tokens of KV" in out.stdout and (tmp_path / "saved" / "kept.chat.json").is_file()
    expected = generate(ip, "--chat keep --wait --max-tokens 8 --temperature 0", "One more.").text
    with capture_output():
        ip.run_line_magic("vllm_mlx", "reset keep")
        ip.run_line_magic("vllm_mlx", "reset-cache")  # as in a new kernel: nothing cached
        ip.run_line_magic("vllm_mlx", "load-cache kept")
        ip.run_line_magic("vllm_mlx", "fork kept twin")
    for name in ("kept", "twin"):
        again = generate(ip, f"--chat {name} --wait --max-tokens 8 --temperature 0", "One more.")
        assert again.text == expected and again.output.num_cached_tokens >= 32
    assert magics.session.chats["kept"].system == "Answer briefly."
    with pytest.raises(UsageError, match="no saved chat"):
        ip.run_line_magic("vllm_mlx", "load-cache missing")
    with pytest.raises(UsageError, match="not a name"):
        ip.run_line_magic("vllm_mlx", "save-cache ../escape keep")
    (tmp_path / "saved" / "kept.chat.json").write_text("{not json")
    with pytest.raises(UsageError, match="damaged"):
        ip.run_line_magic("vllm_mlx", "load-cache kept")


# -- engine commands ----------------------------------------------------------------------


def test_status_and_reset_cache(ip):
    generate(ip, "--wait --max-tokens 2", "A prompt long enough to fill one whole block of sixteen tokens, surely.")
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "status")
    text = out.outputs[0].data["text/plain"]
    assert "KV usage" in text and "hit rate" in text and "0 running" in text
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "reset-cache")
    assert "prefix cache reset" in out.stdout


def test_inspect_shows_the_session_inspector(ip, magics):
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "inspect")
    data = out.outputs[0].data
    assert "application/vnd.jupyter.widget-view+json" in data and "KV cache" in data["text/plain"]
    assert magics.session.inspector().num_blocks == NUM_KV_BLOCKS


def test_shutdown_then_autoload_on_generate(ip, magics):
    running = generate(ip, f"-n cut {LONG}")
    with capture_output():
        ip.run_line_magic("vllm_mlx", "shutdown")
    assert not magics.session.loaded
    assert running.wait(TIMEOUT) and running.state == ABORTED
    gen = generate(ip, "--wait --max-tokens 2")  # loads the configured model again
    assert gen.state == DONE and magics.session.loaded
    assert magics.session.engine.get_stats()["kv_cache"]["num_blocks"] == NUM_KV_BLOCKS - 1


def test_failed_load_is_a_usage_error(ip, magics, tmp_path):
    with pytest.raises(UsageError, match="could not load"):
        with capture_output():
            ip.run_line_magic("vllm_mlx", f"load {tmp_path / 'no-such-model'}")
    assert not magics.session.loaded
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "status")
    assert "no model loaded" in out.outputs[0].data["text/plain"]
