"""The client libraries people use, unchanged, against ``vllm-mlx serve default``: does each get
what it asked for?

Starts the server on 127.0.0.1 with no flag beyond the model, then runs one scenario per library
that is installed (the others are SKIPPED): structured output (each library's own way of asking
for a Pydantic model), forced tool calls, and an agent with a function tool over several turns.
The default model is tiny: what is checked is the contract (a parsed object of the right type, a
call of the named tool with valid arguments, an agent run that ends), not the quality of answers.

    pip install openai anthropic openai-agents instructor "pydantic-ai-slim[openai,anthropic]" \\
        langchain-openai langchain-anthropic
    python bench/client_libraries.py [--port 8765] [--only NAME ...] [--model NAME]

Prints one line per scenario (PASS, FAIL with the reason, SKIP) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable

from pydantic import BaseModel, Field

MODEL = "default"
"""The name requests give (``--model``: an older server knows only the served model's own name)."""
QUESTION = "What is the capital of France? Answer in JSON."


class Capital(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return f"It is sunny in {city}, 21 C."


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
    },
}


# -- scenarios: each returns a short description of what it got, or raises ------------------------


def openai_parse(base: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none")
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], response_format=Capital, max_tokens=48
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital), completion
    return repr(parsed)


def openai_tools(base: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none")
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=48,
    )  # fmt: skip
    [call] = answer.choices[0].message.tool_calls[:1]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    return f"{call.function.name}({call.function.arguments})"


def anthropic_parse(base: str) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="none")
    message = client.messages.parse(
        model=MODEL, max_tokens=48, output_format=Capital, messages=[{"role": "user", "content": QUESTION}]
    )
    assert isinstance(message.parsed_output, Capital), message
    return repr(message.parsed_output)


def anthropic_tools(base: str) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="none")
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip
    message = client.messages.create(
        model=MODEL, max_tokens=48, tools=[tool], tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )  # fmt: skip
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and "city" in uses[0].input, message
    return f"tool_use {uses[0].name}({uses[0].input})"


def langchain_openai(base: str) -> str:
    from langchain_openai import ChatOpenAI

    return _langchain(ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="none", max_tokens=48, temperature=0))


def langchain_anthropic(base: str) -> str:
    from langchain_anthropic import ChatAnthropic

    return _langchain(ChatAnthropic(model=MODEL, base_url=base, api_key="none", max_tokens=48, temperature=0))


def _langchain(chat) -> str:
    """A LangChain chat model's structured output (JSON schema) and forced tool call."""
    from langchain_core.tools import tool

    parsed = chat.with_structured_output(Capital, method="json_schema").invoke(QUESTION)
    assert isinstance(parsed, Capital), parsed
    calls = chat.bind_tools([tool(get_weather)], tool_choice="any").invoke("Weather in Paris?").tool_calls
    assert calls and calls[0]["name"] == "get_weather" and "city" in calls[0]["args"], calls
    return f"{parsed!r}; {calls[0]['name']}({calls[0]['args']})"


def instructor_json_schema(base: str) -> str:
    import instructor
    from openai import OpenAI

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(OpenAI(base_url=base + "/v1", api_key="none"), mode=mode)
        parsed = client.chat.completions.create(
            model=MODEL, response_model=Capital, max_retries=0, max_tokens=48,
            messages=[{"role": "user", "content": QUESTION}],
        )  # fmt: skip
        assert isinstance(parsed, Capital), parsed
    return repr(parsed)


def pydantic_ai(base: str) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base + "/v1", api_key="none"))
    result = Agent(model, output_type=Capital).run_sync(QUESTION, model_settings={"max_tokens": 64})
    assert isinstance(result.output, Capital), result
    return repr(result.output)


def openai_agents(base: str) -> str:
    """An agent with a function tool: forced to call it on the first turn, then (the SDK resets
    ``tool_choice`` after a call: the request leaves it out) it answers from the result."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return get_weather(city)

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=base + "/v1", api_key="none"))
    agent = Agent(name="weather", instructions="Answer briefly.", model=model, tools=[weather],
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48))  # fmt: skip
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6)
    assert calls and isinstance(result.final_output, str), (calls, result.final_output)
    return f"called weather({calls[0]!r}), then answered {result.final_output[:40]!r}"


SCENARIOS: dict[str, tuple[str, Callable[[str], str]]] = {
    "openai parse": ("openai", openai_parse),
    "openai required tool": ("openai", openai_tools),
    "anthropic messages.parse": ("anthropic", anthropic_parse),
    "anthropic tool_choice any": ("anthropic", anthropic_tools),
    "langchain-openai": ("langchain_openai", langchain_openai),
    "langchain-anthropic": ("langchain_anthropic", langchain_anthropic),
    "instructor": ("instructor", instructor_json_schema),
    "pydantic-ai": ("pydantic_ai", pydantic_ai),
    "openai-agents": ("agents", openai_agents),
}


def start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_mlx.entrypoints.cli", "serve", "default", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return server
        except OSError:
            time.sleep(1)
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
    server.terminate()
    raise SystemExit("the server did not become healthy in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--only", nargs="*", help="run only these scenarios (names as printed)")
    parser.add_argument("--model", default=MODEL, help="the model name requests give (default: %(default)s)")
    args = parser.parse_args()
    globals()["MODEL"] = args.model
    server = start_server(args.port)
    base, failed = f"http://127.0.0.1:{args.port}", 0
    try:
        for name, (module, scenario) in SCENARIOS.items():
            if args.only and name not in args.only:
                continue
            if importlib.util.find_spec(module) is None:
                print(f"SKIP  {name}: {module} is not installed", flush=True)
                continue
            start = time.perf_counter()
            try:
                got = scenario(base)
            except Exception as exc:  # a scenario that fails says why and the others still run
                failed += 1
                print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
            else:
                print(f"PASS  {name} ({time.perf_counter() - start:.1f} s): {got}", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
