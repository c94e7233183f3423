"""Structured outputs: constrain a request's output to a JSON Schema, regex, choice or grammar.

- ``params.py``: ``StructuredOutputsParams`` (pure Python; ``SamplingParams`` holds one).
- ``grammar.py``: compile it with llguidance; compiled grammars cached by content.
- ``bounds.py``: refuse repetition bounds too costly to compile (``--max-constraint-bound``).
- ``compile_guard.py`` (+ ``compile_worker.py``): compile first in a memory- and time-capped
  worker process, so a blow-up the walk misses cannot take the server down.
- ``matcher.py``: ``RequestConstraint``, one completion's matcher, synced to its accepted tokens.
- ``bitmask.py``: one step's masks, applied to the batch's logits before sampling.
- ``response_format.py``: Pydantic models and JSON Schemas as ``response_format``; ``.parsed``.

Only ``params`` is imported here: ``import vllm_mlx`` must not pull in llguidance or MLX.
"""

from vllm_mlx.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
