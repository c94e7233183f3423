"""Tools for templates without a tool slot (``tool_parsers/tool_prompt.py``): which templates
render tools, and the conversation a template that renders none gets instead, on real templates
(SmolLM2's has no tools; a Hermes-style one has)."""

from __future__ import annotations

import json
import re

import pytest
from tool_models import HERMES_CALL, TOOLS

from vllm_mlx.tool_parsers.hermes import HermesToolParser
from vllm_mlx.tool_parsers.tool_prompt import renders_tools, tools_instructions, with_tools_in_messages

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir, tools_model_dir):
    """(SmolLM2's tokenizer: no tools in its template, the same with a Hermes-style template)."""
    from vllm_mlx.models import load_model

    return load_model(tiny_model_dir).tokenizer, load_model(tools_model_dir).tokenizer


def render_with(tokenizer):
    return lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)


def test_templates_are_told_apart_by_whether_tools_reach_their_prompt(tokenizers):
    plain, hermes = tokenizers
    assert not renders_tools(plain.chat_template, render_with(plain))
    assert renders_tools(hermes.chat_template, render_with(hermes))
    assert not renders_tools(None, render_with(plain))

    def refusing(messages, tools):
        raise ValueError("no tools here")

    assert not renders_tools("{# a template that fails with tools #}", refusing)


def test_the_conversation_carries_the_tools_and_its_calls_and_results(tokenizers):
    plain, _ = tokenizers
    messages = with_tools_in_messages(CONVERSATION, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith(tools_instructions(TOOLS)) and messages[0]["content"].endswith("Be brief.")
    assert all(json.dumps(tool["function"]) in messages[0]["content"] for tool in TOOLS)
    assert "tool_calls" not in messages[2]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert messages[3]["content"] == '<tool_response>\n{"temp": -3}\n</tool_response>'
    rendered = plain.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in rendered and "<tool_call>" in rendered and "<tool_response>" in rendered
    no_system = with_tools_in_messages(CONVERSATION[1:2], TOOLS)
    assert no_system[0] == {"role": "system", "content": tools_instructions(TOOLS)}


def test_the_format_described_is_the_one_parsed():
    """The call format the instructions show is what the fallback's parser reads."""
    example = re.search(r"<tool_call>\n.*?\n</tool_call>", tools_instructions(TOOLS), re.S).group(0)
    assert HermesToolParser().extract(example).tool_calls[0].name == "function_name"
    [call] = HermesToolParser(TOOLS).extract(HERMES_CALL).tool_calls
    assert call.name == "get_weather"
