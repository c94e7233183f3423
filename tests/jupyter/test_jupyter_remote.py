"""``%vllm_mlx connect``: the notebook's cells on a live ``vllm-mlx serve`` (uvicorn on a free
127.0.0.1 port, in a thread) over the tiny llama, driven from a real IPython shell.

The oracles are the server itself (the same greedy request sent without streaming) and the
server's engine (its ``cache_snapshot()``, read in-process). Every wait is bounded.
"""

from __future__ import annotations


import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402
from vllm_mlx.entrypoints.openai.serving import ServingOptions  # noqa: E402
from vllm_mlx_jupyter.session.generation import ABORTED, DONE  # noqa: E402
from vllm_mlx_jupyter.views.inspector import STATE_CODES, decode_state  # noqa: E402
from factories import wait_until  # noqa: E402
from notebook_shell import generate  # noqa: E402
from live_server import LiveServer, free_socket  # noqa: E402

KEY = "sk-notebook"
TIMEOUT = 60.0
LONG = "--min-tokens 1500 --max-tokens 1500 --temperature 0"  # seconds on the tiny model


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """An adapter the server serves (as ``--lora-modules sql=...`` would)."""
    from lora_adapters import write_mlx_lm_adapter

    from vllm_mlx.lora import LoRARequest

    path = write_mlx_lm_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "sql", rank=4, scale=2.0, seed=1)
    return LoRARequest("sql", 1, str(path))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapter):
    eng = AsyncEngineCore(model=str(tiny_model_dir), num_kv_blocks=256, max_model_len=2048, enable_lora=True,
                          max_loras=1, max_lora_rank=4).start()  # fmt: skip
    eng.register_lora(adapter)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def server(engine, adapter):
    """With the operator's cache-hit disclosure on: the inspector gets this notebook's tables."""
    live = LiveServer(build_app(engine, served_model_name="tiny", api_key=KEY, lora_modules=[adapter],
                                options=ServingOptions(enable_prompt_tokens_details=True)))  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="module")
def ip(server):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "vllm_mlx_jupyter")
    shell.run_line_magic("config", "GenerateMagics.auto_load = False")
    with capture_output():
        shell.run_line_magic("vllm_mlx", f"connect {server.url} --api-key {KEY}")
    yield shell
    shell.run_line_magic("unload_ext", "vllm_mlx_jupyter")
    shell.run_line_magic("config", "GenerateMagics.auto_load = True")  # the shell is shared with later tests


@pytest.fixture
def session(ip):
    from vllm_mlx_jupyter import _MAGICS

    return _MAGICS[id(ip)].session


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
        yield client


def idle_snapshot(engine) -> dict:
    """The server's engine snapshot once no request holds blocks."""
    def idle():
        snap = engine.cache_snapshot()
        return snap if not snap["requests"] and snap["stats"]["num_used_blocks"] == 0 else None

    return wait_until(idle, "the server to free every block")


# -- connecting -------------------------------------------------------------------------------


def test_connect_refuses_a_wrong_url_or_key_and_changes_nothing(ip, session, server):
    engine = session.engine
    sock, url = free_socket()  # bound, not listening: nothing answers there
    try:
        with pytest.raises(UsageError, match="no server answers"):
            ip.run_line_magic("vllm_mlx", f"connect {url}")
    finally:
        sock.close()
    with pytest.raises(UsageError, match="refused the API key"):
        ip.run_line_magic("vllm_mlx", f"connect {server.url} --api-key wrong")
    with pytest.raises(UsageError, match="refused the API key"):
        ip.run_line_magic("vllm_mlx", f"connect {server.url}")
    with pytest.raises(UsageError, match="not an http"):
        ip.run_line_magic("vllm_mlx", "connect localhost:1")
    assert session.engine is engine and session.remote  # still on the same server


def test_status_names_the_server(ip, server):
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "status")
    text = out.outputs[0].data["text/plain"]
    assert server.url in text and "tiny" in text and "KV usage" in text


# -- generating -------------------------------------------------------------------------------


def test_concurrent_cells_stream_the_servers_greedy_text(ip, session, http):
    flags = "--temperature 0 --min-tokens 200 --max-tokens 200"
    prompts = ["Tell me a story.", "Count to ten."]
    gens = [generate(ip, f"-n remote-{i} {flags}", p) for i, p in enumerate(prompts)]
    wait_until(lambda: all(g.text and not g.done for g in gens) or all(g.done for g in gens), "both streaming")
    both_streamed = all(not g.done for g in gens)  # both had text while neither had ended
    for gen in gens:
        assert gen.wait(TIMEOUT) and gen.state == DONE, (gen.state, gen.error)
    assert both_streamed, "the cells did not stream concurrently"
    for gen, prompt in zip(gens, prompts):
        oracle = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "temperature": 0, "min_tokens": 200, "max_tokens": 200,
        }).json()  # fmt: skip
        assert gen.text == oracle["choices"][0]["message"]["content"]
        assert gen.output.num_completion_tokens == oracle["usage"]["completion_tokens"] == 200
        assert gen.output.num_prompt_tokens == oracle["usage"]["prompt_tokens"]


def test_raw_cells_use_completions(ip, http):
    gen = generate(ip, "--raw --temperature 0 --max-tokens 12 --wait", "Once upon a time")
    oracle = http.post("/v1/completions", json={"prompt": "Once upon a time", "temperature": 0, "max_tokens": 12})
    assert gen.state == DONE and gen.text == oracle.json()["choices"][0]["text"]


def test_abort_stops_the_generation_and_the_server_frees_its_blocks(ip, session, engine):
    gen = generate(ip, f"-n long {LONG}")
    wait_until(lambda: gen.text, "the first tokens")
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "abort long")
    assert "aborted: long" in out.stdout
    assert gen.wait(TIMEOUT) and gen.state == ABORTED
    assert gen.output.num_completion_tokens < 1500
    idle_snapshot(engine)


def test_chat_session_sends_the_history(ip, session, http):
    first = generate(ip, "--chat remote-chat --temperature 0 --max-tokens 8 --wait", "Hi there.")
    second = generate(ip, "--chat remote-chat --temperature 0 --max-tokens 8 --wait", "And then?")
    assert first.state == second.state == DONE
    messages = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And then?"}]  # fmt: skip
    oracle = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 8})
    assert second.text == oracle.json()["choices"][0]["message"]["content"]


def test_over_runs_rows_on_the_server(ip, session, http):
    ip.user_ns["rows"] = ["red", "green", "blue"]
    handle = generate(ip, "--over rows --temperature 0 --max-tokens 6 --wait", "Name a fruit that is {item}.")
    assert handle.state == DONE and handle.errors == {}
    for item, text in zip(ip.user_ns["rows"], handle.results):
        oracle = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Name a fruit that is {item}."}], "temperature": 0, "max_tokens": 6,
        }).json()  # fmt: skip
        assert text == oracle["choices"][0]["message"]["content"]


def test_constraints_and_system_go_to_the_server(ip):
    gen = generate(ip, "--choice yes --choice no --temperature 0 --max-tokens 4 --wait --system 'Answer.'", "Ok?")
    assert gen.state == DONE and gen.text in ("yes", "no")
    gen = generate(ip, "--json --temperature 0 --max-tokens 64 --wait", "A JSON object, please.")
    assert gen.state == DONE and (isinstance(gen.parsed, dict) or gen.finish_reason == "length"), gen.text


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_tool_calls_come_from_the_server_and_results_go_back(ip, session, http):
    """``--tools`` with a forced call: the server renders, enforces and parses it; the handle has
    the server's calls (its own reply to the same request), ``run_tools`` answers them, and the
    next turn sends the whole history with the results."""
    import json

    ip.user_ns["calc_tools"] = [add]
    first = generate(ip, "--chat calc --tools calc_tools --tool-choice add --temperature 0 --max-tokens 96 --wait",
                     "What is 2 plus 3?")  # fmt: skip
    assert first.state == DONE, first.error
    spec = session.chats["calc"].tools.specs
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    forced = {"type": "function", "function": {"name": "add"}}
    oracle = http.post("/v1/chat/completions", json={"messages": question, "tools": spec, "tool_choice": forced,
                                                     "temperature": 0, "max_tokens": 96}).json()  # fmt: skip
    calls = oracle["choices"][0]["message"]["tool_calls"]
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]
    assert first.tool_calls and {c.name for c in first.tool_calls} == {"add"}
    results = first.run_tools()
    assert results == [add(**json.loads(c.arguments)) for c in first.tool_calls]

    # The turn that answers the results leaves tool_choice to the server ("auto"): the tiny
    # model's template has no place for tools, so the server describes them in the system message.
    second = generate(ip, "--chat calc --temperature 0 --max-tokens 8 --wait", None)
    assert second.state == DONE, second.error
    history = session.chats["calc"].messages[:-1]  # what the second turn sent
    assert [m["role"] for m in history] == ["user", "assistant", *["tool"] * len(results)]
    oracle = http.post("/v1/chat/completions", json={"messages": history, "tools": spec,
                                                     "temperature": 0, "max_tokens": 8}).json()  # fmt: skip
    assert second.text == (oracle["choices"][0]["message"]["content"] or "")


def test_adapters_are_the_servers(ip, http):
    """Connected, ``--adapter NAME`` runs with an adapter the server serves (its answer is the
    server's own for that ``model``); ``adapter list`` lists the server's; an unknown name says
    what is served, and ``adapter load`` says where adapters come from."""
    with capture_output() as listed:
        ip.run_line_magic("vllm_mlx", "adapter list")
    assert listed.stdout.strip() == "sql: served"
    gen = generate(ip, "--adapter sql --temperature 0 --max-tokens 8 --raw --wait", "Tell me about lighthouses.")
    assert gen.state == DONE, gen.error
    oracle = http.post("/v1/completions", json={"model": "sql", "prompt": "Tell me about lighthouses.",
                                                "temperature": 0, "max_tokens": 8}).json()  # fmt: skip
    base = http.post("/v1/completions", json={"prompt": "Tell me about lighthouses.", "temperature": 0,
                                              "max_tokens": 8}).json()  # fmt: skip
    assert gen.text == oracle["choices"][0]["text"] != base["choices"][0]["text"]
    with pytest.raises(UsageError, match="serves no such adapter .it serves: sql"):
        generate(ip, "--adapter nope", "x")
    with pytest.raises(UsageError, match="adapter list shows them"):
        ip.run_line_magic("vllm_mlx", "adapter load other /tmp/other")


def test_what_the_api_cannot_carry_is_refused(ip):
    ip.user_ns["calc_tools"] = [add]
    with pytest.raises(UsageError, match="--tool-call-parser: a server parses tool calls with its own"):
        generate(ip, "--tools calc_tools --tool-call-parser hermes")
    with pytest.raises(UsageError, match="--tool-choice"):
        generate(ip, "--tools calc_tools --tool-choice subtract")


@pytest.mark.parametrize("raw", [False, True])
def test_logprobs_stream_into_the_token_view(ip, http, raw):
    """``--logprobs 2``: every token with its logprob and top 2, as the server reports them for
    the same greedy request (chat's ``top_logprobs`` or completions' ``logprobs``)."""
    line = "--logprobs 2 --temperature 0 --max-tokens 6 --wait" + (" --raw" if raw else "")
    gen = generate(ip, line, "Say something.")
    assert gen.state == DONE and len(gen.tokens) == 6
    assert "".join(t.text for t in gen.tokens) == gen.text
    if raw:
        body = {"prompt": "Say something.", "temperature": 0, "max_tokens": 6, "logprobs": 2}
        choice = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        expected = [(t, lp, top) for t, lp, top in zip(choice["tokens"], choice["token_logprobs"], choice["top_logprobs"])]
    else:
        body = {"messages": [{"role": "user", "content": "Say something."}], "temperature": 0, "max_tokens": 6,
                "logprobs": True, "top_logprobs": 2}  # fmt: skip
        content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
        expected = [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]}) for e in content]
    for token, (text, logprob, top) in zip(gen.tokens, expected):
        assert token.text == text and token.logprob == pytest.approx(logprob, abs=1e-4)
        assert {alt.text: alt.logprob for alt in token.top} == pytest.approx(top, abs=1e-4)
        assert len(token.top) == 2


def test_images_go_inline_to_a_vision_server(ip, server, tiny_qwen2_vl_dir, tmp_path):
    """``--image PATH``: the kernel reads the file and sends its pixels inline (the server reads
    no file: by default it would refuse a path); the reply is the server's own greedy reply to
    the same image sent as a PNG data URL. ``--raw`` with an image still needs the kernel's engine."""
    import base64
    import io

    from PIL import Image

    image = Image.new("RGB", (64, 64), (200, 30, 90))
    path = tmp_path / "photo.png"
    image.save(path)
    png = io.BytesIO()
    image.save(png, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    engine = AsyncEngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, force_model_takeover=True).start()
    vlm = LiveServer(build_app(engine, served_model_name="vlm", api_key=KEY))
    try:
        with capture_output():
            ip.run_line_magic("vllm_mlx", f"connect {vlm.url} --api-key {KEY}")
        gen = generate(ip, f"--image {path} --temperature 0 --max-tokens 6 --wait", "What is it?")
        parts = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "What is it?"}]
        with httpx.Client(base_url=vlm.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
            oracle = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": parts}], "temperature": 0, "max_tokens": 6,
            }).json()  # fmt: skip
        assert gen.state == DONE and gen.text == oracle["choices"][0]["message"]["content"], gen.error
        with pytest.raises(UsageError, match="no such file"):  # read here, so named here
            generate(ip, f"--image {tmp_path / 'nope.png'}", "What is it?")
        with pytest.raises(UsageError, match="--image with --raw"):
            generate(ip, f"--raw --image {path}", "What is it?")
    finally:
        with capture_output():
            ip.run_line_magic("vllm_mlx", f"connect {server.url} --api-key {KEY}")
        vlm.stop()
        engine.stop()


def test_status_of_a_server_that_discloses_no_hits(ip, engine, server):
    """A server with the default options shows no prefix-cache counters: the status says so."""
    default = LiveServer(build_app(engine, served_model_name="tiny", api_key=KEY))
    try:
        with capture_output():
            ip.run_line_magic("vllm_mlx", f"connect {default.url} --api-key {KEY}")
        with capture_output() as out:
            ip.run_line_magic("vllm_mlx", "status")
        text = out.outputs[0].data["text/plain"]
        assert "prefix cache: not disclosed by the server" in text and "KV usage" in text
    finally:
        with capture_output():
            ip.run_line_magic("vllm_mlx", f"connect {server.url} --api-key {KEY}")
        default.stop()


def test_timeline_needs_the_kernel_engine(ip):
    with pytest.raises(UsageError, match="in-kernel engine"):
        ip.run_line_magic("vllm_mlx", "timeline")


# -- the inspector ----------------------------------------------------------------------------


def test_inspector_draws_the_servers_blocks(ip, session, engine):
    inspector = session.inspector()
    gen = generate(ip, f"-n inspected {LONG}")
    try:
        wait_until(lambda: len(gen.text) > 20, "tokens")
        assert inspector.refresh()
        state = decode_state(inspector.get_state())
        truth = engine.cache_snapshot()
        assert state["num_blocks"] == len(truth["blocks"])
        row = next(r for r in state["requests"] if r["name"] == "inspected")
        table = state["block_tables"][row["offset"] : row["offset"] + row["num_blocks"]]
        assert row["num_blocks"] > 0 and all(truth["blocks"][b]["state"] == "used" for b in table)
        assert all(state["block_state"][b] == STATE_CODES["used"] for b in table)
    finally:
        gen.cancel()
        gen.wait(TIMEOUT)
    idle_snapshot(engine)
    assert inspector.refresh()
    state, truth = decode_state(inspector.get_state()), engine.cache_snapshot()
    assert state["block_state"] == [STATE_CODES[b["state"]] for b in truth["blocks"]]
    assert state["stats"]["num_cached_free_blocks"] == truth["stats"]["num_cached_free_blocks"]
    assert all(not h and not t for h, t in state["block_info"].values())  # no hashes, no text


def test_blocks_endpoint_shows_no_other_tenant(server, http, engine):
    """Another client's request is not listed, even by a client that asks for every id it can
    see; its blocks show only as states."""
    stream = engine.add_request("some other tenant's secret prompt " * 4,
                                _params(min_tokens=400, max_tokens=400), "other-tenant")  # fmt: skip
    try:
        wait_until(lambda: engine.cache_snapshot()["requests"].get("other-tenant", {}).get("block_ids"), "blocks")
        view = http.get("/v1/cache/blocks", params={"request_id": ["not-mine", "gen-1"]}).json()
        assert view["requests"] == {} and view["blocks"] == {}
        assert "u" in view["block_states"] and "secret" not in str(view)
        mine = http.get("/v1/cache/blocks", params={"request_id": "other-tenant"}).json()  # whoever knows the id
        assert mine["requests"]["other-tenant"]["block_ids"] and mine["tables_disclosed"]
    finally:
        engine.abort("other-tenant")
        del stream
    idle_snapshot(engine)
    assert httpx.get(server.url + "/v1/cache/blocks").status_code == 401  # the key is required


def test_blocks_view_discloses_tables_only_where_the_operator_allows(engine):
    from vllm_mlx.core.snapshot import CacheSnapshot
    from vllm_mlx.entrypoints.openai.cache_blocks import block_view

    stream = engine.add_request("a prompt long enough to fill two blocks " * 3, _params(min_tokens=400, max_tokens=400),
                                "viewed")  # fmt: skip
    try:
        wait_until(lambda: engine.cache_snapshot()["requests"].get("viewed", {}).get("block_ids"), "blocks")
        snapshot = engine.cache_snapshot()
        truth = snapshot["requests"]["viewed"]
        typed = CacheSnapshot.from_dict(snapshot)  # the same moment as ``snapshot``
        hidden = block_view(typed, ["viewed"])
        assert hidden["requests"]["viewed"]["block_ids"] == [] and hidden["blocks"] == {}
        assert not hidden["tables_disclosed"] and hidden["requests"]["viewed"]["num_prompt_tokens"]
        shown = block_view(typed, ["viewed"], disclose_hits=True)
        assert shown["requests"]["viewed"]["block_ids"] == truth["block_ids"]
        assert set(shown["blocks"]) == {str(b) for b in truth["block_ids"] if b}
        everyone = block_view(typed, [], per_request=True)
        assert set(everyone["requests"]) == set(snapshot["requests"])
        assert len(hidden["block_states"]) == len(snapshot["blocks"])
    finally:
        engine.abort("viewed")
        del stream
    idle_snapshot(engine)


def test_disconnect_returns_to_the_kernel_engine(ip, session, server):
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "disconnect")
    assert "disconnected" in out.stdout and session.engine is None and not session.remote
    with pytest.raises(UsageError, match="no model is loaded"):
        generate(ip, "--max-tokens 2")
    with capture_output():
        ip.run_line_magic("vllm_mlx", f"connect {server.url} --api-key {KEY}")
    assert session.remote


def _params(**fields):
    from vllm_mlx import SamplingParams

    return SamplingParams(temperature=0, **fields)
