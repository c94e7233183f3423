"""``%%generate`` constraints (``--schema``, ``--json``, ``--regex``, ``--choice``) and tools
(``--tools``, tool results in a chat) in a real IPython shell, on the tiny llama.

The tiny model's chat template is replaced by a Hermes-style one that renders tools and
``<tool_call>`` blocks. A random model calls no tool by itself, so the tool tests force a call's
text with ``--regex``: what is tested is the path from a finished call to ``.tool_calls``, the
cell output, the chat history and the next turn's prompt.
"""

from __future__ import annotations

import json
import re
import shutil
from typing import Literal

import jsonschema
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from tokenizers import Tokenizer

from vllm_mlx_jupyter.session.generation import DONE, GenerationError
from vllm_mlx_jupyter.views.render import body_bundle, status_parts
from vllm_mlx_jupyter.session.tools import function_tool
from notebook_shell import loaded_shell

TIMEOUT = 120.0
HERMES_TEMPLATE = """\
{#- The model may think first, in <think>...</think>. #}
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# The text of one call to get_weather(city="Paris"), as a regex the output must match.
CALL_REGEX = r"""'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'"""
VERDICT_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "answer": {"enum": ["yes", "no"]}},
    "required": ["ok", "answer"],
    "additionalProperties": False,
}


def get_weather(city: str, unit: Literal["C", "F"] = "C") -> dict:
    """The current weather in a city.

    Longer notes that are not part of the description.
    """
    return {"city": city, "temperature": 21, "unit": unit}


def set_light(on: bool, color: Literal["red", "green"]) -> str:
    """Switch the light."""
    return f"light {'on' if on else 'off'}, {color}"


@pytest.fixture(scope="module")
def notebook_tools_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a chat template that renders tools and tool calls."""
    out = tmp_path_factory.mktemp("tiny-tools") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def ip(notebook_tools_model_dir):
    with loaded_shell(notebook_tools_model_dir, {"num_kv_blocks": 256}, temperature=0.0) as shell:
        yield shell


@pytest.fixture(scope="module")
def decode(notebook_tools_model_dir):
    """Prompt token ids -> text, with a tokenizer independent of the session's."""
    tokenizer = Tokenizer.from_file(str(notebook_tools_model_dir / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def generate_done(ip, line: str, cell: str | None = "Is the sky blue?"):
    """A ``%%generate`` cell, done; ``cell=None``: the line magic ``%generate``."""
    with capture_output():
        gen = ip.run_line_magic("generate", line) if cell is None else ip.run_cell_magic("generate", line, cell)
    gen.result(TIMEOUT)
    return gen


# -- constraints --------------------------------------------------------------------------


def test_schema_from_a_pydantic_model_gives_an_instance(ip):
    pydantic = pytest.importorskip("pydantic")

    class Verdict(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        ok: bool
        answer: Literal["yes", "no"]

    ip.user_ns["Verdict"] = Verdict
    gen = generate_done(ip, "--schema Verdict --compact-json --max-tokens 48")
    assert gen.state == DONE and gen.finish_reason == "stop", gen.text
    assert isinstance(gen.parsed, Verdict) and gen.parse_error is None
    assert gen.parsed == Verdict.model_validate_json(gen.text)


def test_schema_from_a_dict_and_json_give_parsed_json(ip):
    ip.user_ns["verdict_schema"] = VERDICT_SCHEMA
    gen = generate_done(ip, "--schema verdict_schema --compact-json --max-tokens 48")
    assert gen.finish_reason == "stop", gen.text
    jsonschema.validate(gen.parsed, VERDICT_SCHEMA)
    assert gen.parsed == json.loads(gen.text)
    anything = generate_done(ip, "--json --compact-json --max-tokens 64 --temperature 0.8 --seed 3")
    if anything.finish_reason == "stop":
        assert isinstance(anything.parsed, dict) and anything.parsed == json.loads(anything.text)
    else:  # cut short: a prefix of an object, not parsed
        assert anything.text.lstrip().startswith("{") and anything.parsed is None


def test_output_cut_by_max_tokens_is_not_parsed_and_says_why(ip):
    ip.user_ns["verdict_schema"] = VERDICT_SCHEMA
    gen = generate_done(ip, "--schema verdict_schema --max-tokens 2")
    assert gen.state == DONE and gen.finish_reason == "length"
    assert gen.parsed is None and "max_tokens" in gen.parse_error
    assert any("max_tokens" in part for part in status_parts(gen))  # shown in the cell's status line


def test_regex_and_choice_hold(ip):
    gen = generate_done(ip, "--regex '[a-z]{3,8}-[0-9]{2}' --max-tokens 24")
    assert re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", gen.text), gen.text
    assert gen.parsed is None and gen.parse_error is None  # a regex output is its text
    gen = generate_done(ip, '--choice yes --choice no --choice "not sure" --max-tokens 8')
    assert gen.text in ("yes", "no", "not sure")
    ip.user_ns["colors"] = ["crimson red", "forest green"]
    gen = generate_done(ip, "--choice colors --max-tokens 8")
    assert gen.text in ("crimson red", "forest green")


@pytest.mark.parametrize("line, message", [
    ("--regex a --json", "one constraint"),
    ("--choice a --schema verdict_schema", "one constraint"),
    ("--regex '(unclosed'", "--regex"),
    ("--regex a --compact-json", "--compact-json"),
    ("--schema no_such_var", "no_such_var"),
    ("--schema colors", "--schema"),
    ("--tools no_such_var", "no_such_var"),
    ("--tools colors", "--tools colors"),
    ("--tools weather_tools --raw", "--raw"),
    ("--tools weather_tools --tool-call-parser nope", "nope"),
    ("--tools weather_tools --tool-choice set_light", "not in tools"),
    ("--tools weather_tools --tool-choice required --regex a", "give no other"),
    ("--schema huge_schema", "--schema: maxItems is 1000000000, over the limit of 10000"),  # not compiled at all
])  # fmt: skip
def test_bad_constraints_and_tools_are_usage_errors(ip, line, message):
    ip.user_ns.update(verdict_schema=VERDICT_SCHEMA, colors=["red", "green"], weather_tools=[get_weather])
    ip.user_ns["huge_schema"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 10**9}
    with pytest.raises(UsageError, match=re.escape(message)):
        generate_done(ip, line)


def test_bad_regex_is_refused_before_anything_is_queued(ip):
    from vllm_mlx_jupyter import get_session

    session = get_session(ip)
    before = set(session.generations)
    with pytest.raises(UsageError, match=r"--regex.*\(unclosed"):
        generate_done(ip, "-n bad-regex --regex '(unclosed'")
    assert set(session.generations) == before


# -- tools --------------------------------------------------------------------------------


def test_a_function_becomes_an_openai_tool():
    assert function_tool(get_weather) == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }

    def anything(x: int, **rest) -> None:
        """Takes more than it names."""

    assert "additionalProperties" not in function_tool(anything)["function"]["parameters"]


def test_tools_are_rendered_and_calls_are_parsed_without_chat(ip, decode):
    ip.user_ns["weather_tools"] = [function_tool(get_weather)]  # an OpenAI tool dict
    gen = generate_done(ip, f"--tools weather_tools --regex {CALL_REGEX} --max-tokens 64", "Weather in Paris?")
    prompt = decode(gen.prompt)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "The current weather" in prompt
    assert [(c.name, json.loads(c.arguments)) for c in gen.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert gen.content == "" and gen.text.startswith("<tool_call>")
    body = body_bundle(gen)  # what the cell shows: the call, not its markup
    assert "get_weather" in body["text/html"] and "Paris" in body["text/html"]
    assert "<tool_call>" not in body["text/plain"] and "&lt;tool_call&gt;" not in body["text/html"]
    assert "1 tool call" in status_parts(gen)
    with pytest.raises(GenerationError, match="--chat"):
        gen.add_tool_result(gen.tool_calls[0], "21 C")


def test_tool_choice_enforces_a_call(ip):
    ip.user_ns["light_tools"] = [set_light, get_weather]
    gen = generate_done(ip, "--tools light_tools --tool-choice set_light --max-tokens 32", "Lights on!")
    assert gen.finish_reason == "stop", gen.text
    [call] = gen.tool_calls
    assert call.name == "set_light" and set(json.loads(call.arguments)) == {"on", "color"}
    gen = generate_done(ip, "--tools light_tools --tool-choice required --max-tokens 48 --seed 1", "Lights on!")
    assert gen.tool_calls and gen.tool_calls[0].name in ("set_light", "get_weather")
    assert gen.content == ""


def test_reasoning_is_split_off_and_folded(ip):
    ip.user_ns["weather_tools"] = [get_weather]
    regex = CALL_REGEX.replace("'<tool_call>", "'<think>Paris is in France[.]</think>\\n<tool_call>")
    gen = generate_done(ip, f"--tools weather_tools --regex {regex} --max-tokens 64", "Weather in Paris?")
    assert gen.reasoning == "Paris is in France." and [c.name for c in gen.tool_calls] == ["get_weather"]
    assert gen.content == ""
    html = body_bundle(gen)["text/html"]
    assert "<details><summary>thinking</summary>" in html and "Paris is in France." in html


def test_chat_records_calls_and_continues_with_tool_results(ip, decode):
    from vllm_mlx_jupyter import get_session

    ip.user_ns["weather_tools"] = [get_weather]  # a Python function
    first = generate_done(ip, f"--chat w --tools weather_tools --regex {CALL_REGEX} --max-tokens 64", "Weather in Paris?")
    [call] = first.tool_calls
    chat = get_session(ip).chats["w"]
    assert chat.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}},
        ]},
    ]  # fmt: skip
    assert first.run_tools() == [{"city": "Paris", "temperature": 21, "unit": "C"}]
    assert chat.messages[-1] == {
        "role": "tool", "tool_call_id": call.id, "content": '{"city": "Paris", "temperature": 21, "unit": "C"}',
    }  # fmt: skip
    with pytest.raises(ValueError, match="has a result already"):
        first.add_tool_result(call, "again")
    with pytest.raises(ValueError, match="no tool call"):
        first.add_tool_result("call_unknown", "?")

    second = generate_done(ip, "--chat w --max-tokens 4", None)  # %generate: the model answers the results
    prompt = decode(second.prompt)
    assert prompt.startswith(decode(first.prompt))  # the tools stay for later turns
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"city": "Paris", "temperature": 21, "unit": "C"}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and prompt.count("<|im_start|>user") == 2
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool", "assistant"]
    with pytest.raises(ValueError, match="latest finished turn"):
        first.add_tool_result(call, "late")
    with capture_output() as out:
        ip.run_line_magic("vllm_mlx", "history w")
    assert "-> get_weather(" in out.stdout and f"[tool] ({call.id})" in out.stdout
    with pytest.raises(UsageError, match="empty"):
        generate_done(ip, "--chat w", None)  # no tool results to answer now


def test_tool_calls_from_model_text_are_shown_as_text_never_as_html():
    from types import SimpleNamespace

    from vllm_mlx.tool_parsers import ToolCall

    call = ToolCall("call_1", "<img src=x onerror=alert(1)>", '{"q": "<script>alert(2)</script>"}')
    body = body_bundle(SimpleNamespace(content="", reasoning=None, tool_calls=[call], format="markdown"))
    assert "<img" not in body["text/html"] and "<script" not in body["text/html"]
    assert "&lt;script&gt;" in body["text/html"] and call.arguments in body["text/plain"]
