"""OpenAI-style chat messages -> what a chat template renders, plus the images, in order.

A message's ``content`` is a string or a list of parts. Parts are ``{"type": "text", "text": ...}``,
OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": "..."``), or the
Hugging Face / vLLM style ``{"type": "image", "image": <path, bytes, URL or PIL image>}``.

Templates of vision-language models place an image wherever a ``{"type": "image"}`` part sits;
templates of text models expect string content. So image parts become ``{"type": "image"}``
(the image itself goes to the list returned beside the messages), and a message without images
has its text parts joined into one string, which every template accepts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from vllm_mlx.engine.template_guard import ChatTemplateError, template_guard
from vllm_mlx.multimodal.images import ImageSource
from vllm_mlx.tool_parsers.tool_prompt import FALLBACK_PARSER, renders_tools, with_tools_in_messages, written_out

__all__ = ["ChatPrompt", "ChatTemplateError", "split_chat_images", "template_image_text", "template_renders_tools",
           "template_text", "template_token_ids", "tool_parser_for"]  # fmt: skip

logger = logging.getLogger(__name__)
_TOLD: set[str] = set()  # templates whose tools fallback was logged


@dataclass
class ChatPrompt:
    """Messages ready for a chat template, and the images their image parts stood for."""

    messages: list[dict]
    images: list[ImageSource] = field(default_factory=list)


def split_chat_images(messages: list[dict]) -> ChatPrompt:
    """Take the images out of ``messages`` (in order) and normalise the content parts.

    Raises:
        ValueError: A content part of an unknown type, or an image part without an image.
    """
    images: list[ImageSource] = []
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = [_template_part(part, images) for part in content]
            if all(p["type"] == "text" for p in parts):
                content = "\n".join(p["text"] for p in parts)
            else:
                content = parts
        out.append({**message, "content": content if content is not None else ""})
    return ChatPrompt(out, images)


def _template_part(part: dict, images: list[ImageSource]) -> dict:
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not url:
            raise ValueError("an image_url content part needs a url")
        images.append(url)
        return {"type": "image"}
    if kind == "image":
        image = part.get("image", part.get("url"))
        if image is None:
            raise ValueError("an image content part needs an 'image' (path, bytes, URL or PIL image)")
        images.append(image)
        return {"type": "image"}
    raise ValueError(f"unsupported content part type {kind!r} (use 'text', 'image_url' or 'image')")


def template_token_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """``messages`` under ``tokenizer``'s chat template, as a list of int token ids: the ids of
    ``template_text`` (as transformers and mlx-lm tokenize a rendered template). ``tools``: OpenAI
    function tools, which templates that know tools render into the prompt (for one that does
    not, they go into the system message: ``tool_parsers/tool_prompt.py``)."""
    text = template_text(tokenizer, messages, add_generation_prompt, tools)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def template_text(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """The prompt ``template_token_ids`` tokenizes, as text (special tokens written out),
    rendered in a time- and memory-limited worker (``template_guard.py``).

    Raises:
        ChatTemplateError: The template refused the messages, or overran its time or memory.
    """
    messages, tools = _template_inputs(tokenizer, messages, tools)
    return template_guard().render(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)


_MARKER = "\u2063"  # an invisible separator: text no template writes by itself


def template_image_text(tokenizer) -> str | None:
    """What the chat template writes for an image part before a user's text (LLaVA's
    ``"<image>\n"``, Qwen's ``"<|vision_start|><|image_pad|><|vision_end|>"``): how a prompt
    written without the template should show an image. None: no template, or it writes the
    image elsewhere than right before the text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = [{"type": "text", "text": _MARKER}]
    try:
        with_image = template_text(tokenizer, [{"role": "user", "content": [{"type": "image"}, *text]}])
        without = template_text(tokenizer, [{"role": "user", "content": text}])
    except ValueError:  # a template that takes no image parts, or refuses the probe
        return None
    start = without.find(_MARKER)
    end = with_image.find(_MARKER)
    if start < 0 or end < start or with_image[:start] != without[:start]:
        return None
    return with_image[start:end] or None


def template_renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template puts ``tools`` in its prompt (probed once per template)."""
    template = getattr(tokenizer, "chat_template", None)

    def render(messages: list[dict], tools: list[dict] | None) -> str:
        return template_guard().render(tokenizer, messages, add_generation_prompt=True, tools=tools)

    return renders_tools(str(template) if template else None, render)


def tool_parser_for(tokenizer, configured: str | None) -> str | None:
    """The tool-call parser requests with tools need: the operator's (``configured``), else the
    fallback's when the template renders no tools (their format is then the one we describe),
    else None (the template's own markers decide)."""
    if configured is not None or template_renders_tools(tokenizer):
        return configured
    return FALLBACK_PARSER


def _template_inputs(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """What the template is given: earlier calls' arguments as mappings, and for a template that
    renders no tools, the tools in the system message and earlier calls and results written out."""
    messages = [_template_tool_calls(m) for m in messages]
    if template_renders_tools(tokenizer):
        return messages, tools or None
    if tools:
        template = str(getattr(tokenizer, "chat_template", ""))
        if template not in _TOLD:
            _TOLD.add(template)
            logger.warning("the chat template renders no tools: they are described in the system message, and "
                           "calls are read in the %s format", FALLBACK_PARSER)  # fmt: skip
        return with_tools_in_messages(messages, tools), None
    return written_out(messages), None


def _template_tool_calls(message: dict) -> dict:
    """An assistant message's ``tool_calls`` as chat templates expect them.

    OpenAI sends each call's ``arguments`` as a JSON string; Hugging Face templates (Qwen,
    Llama 3, Mistral, Hermes) iterate or ``tojson`` it as a mapping, so a string would be
    rendered quoted. Arguments that are not a JSON object stay as they are.
    """
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}
