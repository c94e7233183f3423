"""The client libraries people point at a local server, unchanged, against the server on the
default model with no flag beyond the model: each gets what it asked for (a parsed object of its
type, a call of the named tool with valid arguments, an agent run that calls its tool and ends).

The scenarios are ``bench/client_libraries.py``'s (a user runs that script against their own
server); here the libraries that install beside the test suite run in CI: LangChain's OpenAI and
Anthropic chat models, pydantic-ai and OpenAI's agents SDK. (instructor pins an older ``openai``:
the script only.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from live_server import LiveServer  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "client_libraries.py"


def load_scenarios():
    spec = importlib.util.spec_from_file_location("client_libraries", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCENARIOS = load_scenarios()


@pytest.fixture(scope="module")
def base_url():
    """``vllm-mlx serve default`` as the script starts it, in this process."""
    from vllm_mlx.models import resolve_model

    model = resolve_model("default")
    engine = AsyncEngineCore(model=str(model), max_num_seqs=8).start()
    live = LiveServer(build_app(engine, served_model_name=model.name))
    yield live.url
    live.stop()
    engine.stop()


@pytest.mark.parametrize(
    "scenario, module",
    [
        ("langchain_openai", "langchain_openai"),
        ("langchain_anthropic", "langchain_anthropic"),
        ("pydantic_ai", "pydantic_ai"),
        ("openai_agents", "agents"),
    ],
)
def test_the_library_gets_what_it_asked_for(base_url, scenario, module):
    pytest.importorskip(module, reason=f"{module} is not installed (the dev extra has it)")
    got = getattr(SCENARIOS, scenario)(base_url)  # each scenario asserts its own contract
    assert "Capital(" in got or "called weather" in got, got
