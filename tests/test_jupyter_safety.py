"""Model text in a notebook is data: it never runs as HTML, and prompts never pull in IPython's history."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from vllm_mlx.request import CompletionOutput, RequestOutput
from vllm_mlx_jupyter.generation import DONE, Generation
from vllm_mlx_jupyter.prompt import interpolate
from vllm_mlx_jupyter.render import LiveView

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


def shown(text: str, format: str = "markdown") -> list[dict]:
    """Run a generation of ``text`` in a live view; return the data of every body display/update."""
    shell = InteractiveShell.instance()
    assert shell is not None
    gen = Generation("g", ScriptedEngine(text), None, lambda: [1, 2, 3], format=format)
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
