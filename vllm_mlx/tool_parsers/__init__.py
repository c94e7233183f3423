"""Tool-call and reasoning parsers: model output text -> OpenAI ``tool_calls`` and
``reasoning_content``, whole or streamed (one module per format family).

- ``base.py``: ``ToolCall``, ``ToolCallResult``, the streamed deltas, and the one incremental
  machine all formats run on (its docstring holds the invariants).
- ``hermes.py`` (Hermes, Qwen2.5, Qwen3), ``qwen3_coder.py`` (XML), ``llama3.py`` (Llama 3.x
  JSON), ``mistral.py`` (``[TOOL_CALLS]``).
- ``reasoning.py``: ``<think>...</think>``.
- ``harmony.py``: gpt-oss's Harmony messages (reasoning, content and calls from one stream).
- ``registry.py``: pick a parser by name or from a chat template.

Pure Python, no MLX: the server's output processing uses it off the engine thread.
"""

from vllm_mlx.tool_parsers.base import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallResult,
    ToolCallStream,
    ToolParser,
    reassemble,
)
from vllm_mlx.tool_parsers.harmony import HarmonyParser
from vllm_mlx.tool_parsers.hermes import HermesToolParser
from vllm_mlx.tool_parsers.llama3 import Llama3JsonToolParser
from vllm_mlx.tool_parsers.mistral import MistralToolParser
from vllm_mlx.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from vllm_mlx.tool_parsers.reasoning import ReasoningDelta, ReasoningParser, ReasoningResult, ReasoningStream
from vllm_mlx.tool_parsers.registry import TOOL_PARSERS, select_reasoning_parser, select_tool_parser, tool_parser_name

__all__ = [
    "TOOL_PARSERS",
    "HarmonyParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "Qwen3CoderToolParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningResult",
    "ReasoningStream",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallResult",
    "ToolCallStream",
    "ToolParser",
    "reassemble",
    "select_reasoning_parser",
    "select_tool_parser",
    "tool_parser_name",
]
