"""Tiny random-weight models with a Hermes-style tools chat template, served live: shared by the
tool-calling, Anthropic Messages and OpenAI Responses server tests.

The template renders tools in the system turn (``<tools>``), calls as ``<tool_call>`` JSON and
results as ``<tool_response>``; ``{% set thinking = true %}`` in front opens a ``<think>`` block.
The fixtures ``tools_model_dir`` and ``thinking_model_dir`` (conftest.py) build the models;
``harmony_model_dir`` has a gpt-oss style (Harmony) template instead, whose markers are plain text
to this tokenizer (SmolLM2's).
"""

from __future__ import annotations

from contextlib import contextmanager

import json
import shutil

from live_server import LiveServer

MODEL = "tiny-tools"

HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if thinking %}<think>
{% endif %}{% endif %}"""

HARMONY_TEMPLATE = """
{%- if tools %}<|start|>developer<|message|># Tools

namespace functions {
{%- for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json<|message|>{{ call.function.arguments }}<|call|>
{%- endfor %}
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


def with_template(src, dst, template: str):
    """A copy of the model directory ``src`` at ``dst`` with ``template`` as its chat template."""
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return dst


@contextmanager
def serving(model_dir, **app_options):
    """A started engine on ``model_dir`` and a live server for it (``live_app``), as
    ``(engine, live)``; both stopped on leaving."""
    from vllm_mlx.engine.async_engine import AsyncEngineCore

    engine = AsyncEngineCore(model=str(model_dir), max_num_seqs=8).start()
    live = live_app(engine, **app_options)
    try:
        yield engine, live
    finally:
        live.stop()
        engine.stop()


def openai_client(live: LiveServer):
    """The official client for ``live``'s OpenAI routes."""
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def live_app(engine, **app_options) -> LiveServer:
    """A live server for a started ``engine`` (apps may share one), serving it as ``MODEL``."""
    from vllm_mlx.entrypoints.openai.server import build_app

    return LiveServer(build_app(engine, served_model_name=MODEL, **app_options))
