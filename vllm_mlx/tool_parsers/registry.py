"""Which tool-call parser a model needs: by name (``--tool-call-parser``) or from its template.

Harmony (gpt-oss) is no tool parser: one stream splits reasoning, content and calls
(``harmony.py``), so it is chosen apart (``uses_harmony``) but named the same way."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_mlx.tool_parsers.base import IdFactory, ToolParser
from vllm_mlx.tool_parsers.hermes import HermesToolParser
from vllm_mlx.tool_parsers.llama3 import Llama3JsonToolParser
from vllm_mlx.tool_parsers.mistral import MistralToolParser
from vllm_mlx.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from vllm_mlx.tool_parsers.reasoning import THINK_START, ReasoningParser, prompt_opens_reasoning

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser, MistralToolParser)
}
HARMONY = "harmony"
ALIASES = {
    "qwen": "hermes", "qwen2_5": "hermes", "qwen3": "hermes", "llama3": "llama3_json", "llama": "llama3_json",
    "openai": HARMONY, "gpt_oss": HARMONY,
}  # fmt: skip
PARSER_NAMES = sorted([*TOOL_PARSERS, HARMONY])

# (marker in the chat template, parser name), first match wins: Qwen3-Coder's template also
# mentions <tool_call>, so its <function= comes before Hermes.
TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|channel|>", "<|message|>"), HARMONY),
    (("<function=", "<parameter="), "qwen3_coder"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<tool_call>",), "hermes"),
    (("<|python_tag|>",), "llama3_json"),
    (("ipython", "<|start_header_id|>"), "llama3_json"),
)


def tool_parser_name(chat_template: str | None) -> str | None:
    """The parser a chat template's tool markers point to; None if it shows none we know."""
    for markers, name in TEMPLATE_MARKERS:
        if chat_template and all(marker in chat_template for marker in markers):
            return name
    return None


def select_tool_parser(
    chat_template: str | None,
    name: str | None = None,
    tools: Sequence[dict] | None = None,
    id_factory: IdFactory | None = None,
) -> ToolParser | None:
    """A parser by explicit ``name`` if given, else from the template's markers; None if unknown,
    or if the output is Harmony (``uses_harmony``: no tool parser reads it).

    Raises:
        ValueError: ``name`` is given and is no parser's name (the message lists them).
    """
    key = _parser_key(chat_template, name)
    return None if key is None or key == HARMONY else TOOL_PARSERS[key](tools, id_factory)


def uses_harmony(chat_template: str | None, name: str | None = None) -> bool:
    """True if the output is Harmony: by ``name`` if given, else by the template's markers.

    Raises:
        ValueError: ``name`` is given and is no parser's name.
    """
    return _parser_key(chat_template, name) == HARMONY


def _parser_key(chat_template: str | None, name: str | None) -> str | None:
    if name is None:
        return tool_parser_name(chat_template)
    key = ALIASES.get(name, name)
    if key not in PARSER_NAMES:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {PARSER_NAMES}")
    return key


def select_reasoning_parser(chat_template: str | None, prompt: str | None = None) -> ReasoningParser | None:
    """A ``<think>`` parser if the template mentions ``<think>``; it starts inside the block when
    the rendered ``prompt`` ends with an open ``<think>``."""
    if not chat_template or THINK_START not in chat_template:
        return None
    return ReasoningParser(starts_in_reasoning=prompt is not None and prompt_opens_reasoning(prompt))
