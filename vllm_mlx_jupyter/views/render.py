"""The live output area of a generation: a status line, a stop button and the text.

Status and text are display outputs bound by ``display_id`` (updated from the consumer thread,
they land in the cell that started the generation, and they are saved with the notebook); the
stop button is an ipywidgets ``Button`` whose click aborts the request. Nothing here prints.
An ``--over`` run (``OverGeneration``) gets the same area: a progress line and bar, the stop
button, and its last finished rows instead of the text.
"""

from __future__ import annotations

import re
import time

from vllm_mlx_jupyter.views.markup import escape
from vllm_mlx_jupyter.views.model_markdown import render_markdown
from vllm_mlx_jupyter.states import ABORTED, DONE, ERROR, GENERATING, PREFILLING, QUEUED
from vllm_mlx_jupyter.views.token_view import TOKENS, tokens_bundle

RECENT_CHARS = 160
SHOWN_ERRORS = 3
_COLORS = {
    QUEUED: "#9e9e9e",
    PREFILLING: "#ef6c00",
    GENERATING: "#1e88e5",
    DONE: "#43a047",
    ABORTED: "#616161",
    ERROR: "#e53935",
}


def _is_over(gen) -> bool:
    """An ``--over`` run (``over.OverGeneration``), told by a flag: this module shows both kinds
    and imports neither (generation.py shows its handles through this module)."""
    return getattr(gen, "is_over", False)


def current_execution_count() -> int:
    from IPython import get_ipython

    shell = get_ipython()
    return getattr(shell, "execution_count", 0) if shell is not None else 0


def status_parts(gen) -> list[str]:
    """The status line as parts: name, state, tokens, tok/s, speculation, TTFT, cached prompt tokens."""
    out = gen.output
    state = gen.state
    if state == DONE and out is not None and out.finish_reason:
        state = f"done ({out.finish_reason})"
    if state == ERROR:
        state = f"error: {gen.error}"
    parts = [gen.name, state]
    if gen.tool_calls:
        n = len(gen.tool_calls)
        parts.append(f"{n} tool call{'s' if n != 1 else ''}")
    if gen.parse_error:
        parts.append(f"not parsed: {gen.parse_error}")
    if out is not None:
        n = out.num_completion_tokens
        parts.append(f"{n} token{'s' if n != 1 else ''}")
        rate = _tokens_per_second(out, n)
        if rate is not None:
            parts.append(f"{rate:.1f} tok/s")
        metrics = getattr(out, "metrics", None)  # a remote server's outputs have none
        if metrics is not None and metrics.num_draft_tokens:
            parts.append(f"{metrics.num_accepted_tokens}/{metrics.num_draft_tokens} proposed tokens kept")
        if out.ttft is not None:
            parts.append(f"TTFT {out.ttft:.2f} s")
        disk = metrics.num_disk_tokens if metrics is not None else 0
        on_disk = f" ({disk} from disk)" if disk else ""
        parts.append(f"{out.num_cached_tokens}/{out.num_prompt_tokens} prompt tokens from cache{on_disk}")
    elif gen.num_prompt_tokens is not None:
        parts.append(f"{gen.num_prompt_tokens} prompt tokens")
    return parts


def _tokens_per_second(out, n: int) -> float | None:
    if n < 2 or out.first_token_time is None:
        return None
    end = out.finish_time or time.monotonic()
    elapsed = end - out.first_token_time
    return (n - 1) / elapsed if elapsed > 0 else None


def status_bundle(gen) -> dict:
    parts = over_status_parts(gen) if _is_over(gen) else status_parts(gen)
    color = _COLORS.get(gen.state, "#9e9e9e")
    text = " · ".join(escape(p) for p in parts)
    markup = (
        f'<div class="vllm-mlx-status" data-state="{escape(gen.state)}" '
        f'style="font:12px/1.6 var(--jp-code-font-family, monospace);color:#666">'
        f'<span style="color:{color}">●</span> {text}</div>'
    )
    return {"text/plain": " · ".join(parts), "text/html": markup + _progress_bar(gen)}


def over_status_parts(gen) -> list[str]:
    """An ``--over`` run's status: rows done of total, errors, in flight, tokens, tok/s, ETA."""
    p = gen.progress
    state = f"error: {gen.error}" if gen.state == ERROR else gen.state
    parts = [gen.name, state, f"{p.done}/{p.total} rows"]
    if p.failed:
        parts.append(f"{p.failed} error{'s' if p.failed != 1 else ''}")
    if not gen.done:
        parts.append(f"{p.in_flight} in flight")
    parts.append(f"{p.tokens} tokens")
    if p.tokens_per_second is not None:
        parts.append(f"{p.tokens_per_second:.1f} tok/s")
    parts.append(f"{p.elapsed:.1f} s")
    if not gen.done and p.eta is not None:
        parts.append(f"ETA {p.eta:.0f} s")
    return parts


def _progress_bar(gen) -> str:
    if not _is_over(gen):
        return ""
    p = gen.progress
    done = 100 * p.done / p.total if p.total else 100
    failed = 100 * p.failed / p.total if p.total else 0
    return (
        '<div class="vllm-mlx-progress" style="display:flex;height:6px;background:#eee;max-width:480px">'
        f'<div style="width:{done:.2f}%;background:#43a047"></div>'
        f'<div style="width:{failed:.2f}%;background:#e53935"></div></div>'
    )


def body_bundle(gen) -> dict:
    """The text in the generation's format: markdown, text, or a code block.

    Model text is untrusted, yet it lands in a trusted output area, where JupyterLab runs the HTML
    in ``text/markdown`` and ``text/html`` as is. So Markdown is rendered here
    (``model_markdown.py``: raw HTML escaped, ``javascript:`` links left as text, images from
    URLs shown as links unless ``gen.allow_remote_images``) and sent as ``text/html``; no
    ``text/markdown`` is ever sent. ``<img onerror=...>`` in an answer shows as text.

    ``--logprobs`` generations show the token view instead (``token_view.py``).

    Reasoning comes first, folded; tool calls follow the text as ``name(arguments)``, never as
    the model's call markup.
    """
    if _is_over(gen):
        return over_body_bundle(gen)
    if gen.format == TOKENS:
        return tokens_bundle(gen)
    text, calls = gen.content, [f"{call.name}({call.arguments})" for call in gen.tool_calls]
    thinking = f"thinking: {gen.reasoning}" if gen.reasoning else None
    plain = "\n".join(filter(None, [thinking, text, *(f"tool call: {call}" for call in calls)]))
    if gen.format == "text":
        return {"text/plain": plain}
    if gen.format == "code":
        fence = "`" * max(3, _longest_backtick_run(text) + 1)
        source = f"{fence}\n{text}\n{fence}"
    else:
        source = text
    images = getattr(gen, "allow_remote_images", False)  # views of other handles: links, the safe default
    folded = (f"<details><summary>thinking</summary>{render_markdown(gen.reasoning, images)}</details>"
              if gen.reasoning else "")  # fmt: skip
    markup = folded + render_markdown(source, images) + "".join(
        f'<div class="vllm-mlx-tool-call" style="font-family:monospace">&#128295; {escape(call)}</div>'
        for call in calls
    )
    return {"text/html": f'<div class="vllm-mlx-text">{markup}</div>', "text/plain": plain}


def over_body_bundle(gen) -> dict:
    """The last rows to finish, one line each (cut to ``RECENT_CHARS``), and the first errors.
    Model text goes out escaped: never as HTML or Markdown."""
    lines = [f"#{index}: {_one_line(text)}" for index, text in gen.recent()]
    errors = sorted(gen.errors.items())
    lines += [f"#{index} error: {_one_line(message)}" for index, message in errors[:SHOWN_ERRORS]]
    if len(errors) > SHOWN_ERRORS:
        lines.append(f"… {len(errors) - SHOWN_ERRORS} more errors in .errors")
    rows = "".join(f"<div>{escape(line)}</div>" for line in lines)
    markup = f'<div class="vllm-mlx-rows" style="font:12px monospace">{rows}</div>'
    return {"text/plain": "\n".join(lines), "text/html": markup}


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= RECENT_CHARS else flat[: RECENT_CHARS - 1] + "…"


def _longest_backtick_run(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)


class _StopButton:
    """A lazily imported ipywidgets Button (``vllm-mlx-stop``) that aborts the generation."""

    @staticmethod
    def create(gen):
        import ipywidgets as widgets

        class StopButton(widgets.Button):
            def _repr_mimebundle_(self, **kwargs):  # saved notebooks: no widget repr as text
                bundle = super()._repr_mimebundle_(**kwargs)
                if isinstance(bundle, dict):
                    bundle["text/plain"] = ""
                return bundle

        button = StopButton(description="Stop", icon="stop", tooltip=f"abort {gen.name}",
                            layout=widgets.Layout(width="auto"))  # fmt: skip
        button.add_class("vllm-mlx-stop")
        button.on_click(lambda _button: gen.cancel())
        return button


class LiveView:
    """One live output area of a generation in the current cell."""

    def __init__(self, gen, with_button: bool = True) -> None:
        from IPython.display import display

        self.execution_count = current_execution_count()
        self._sent_status, self._sent_body = status_bundle(gen), body_bundle(gen)
        self.status = display(self._sent_status, raw=True, display_id=True)
        self.button = None
        if with_button and not gen.done:
            self.button = _StopButton.create(gen)
            display(self.button)
        self.body = display(self._sent_body, raw=True, display_id=True)

    @classmethod
    def show(cls, gen) -> LiveView:
        view = cls(gen)
        gen.add_view(view)
        return view

    def update(self, gen, final: bool, force: bool = False) -> None:
        """Send what changed (the text is re-sent whole, hence the throttle upstream)."""
        status, body = status_bundle(gen), body_bundle(gen)
        if force or status != self._sent_status:
            self.status.update(status, raw=True)
            self._sent_status = status
        if force or body != self._sent_body:
            self.body.update(body, raw=True)
            self._sent_body = body
        if final and self.button is not None:
            self.button.disabled = True
            self.button.layout.display = "none"
