"""The OpenAI-compatible server (``vllm-mlx serve``).

- ``protocol``: the wire format (pydantic request/response models, the error shape);
- ``serving``, ``serving_chat``, ``serving_completion``: OpenAI requests <-> the engine;
- ``server``: the FastAPI app factory ``build_app(engine)`` and the uvicorn runner;
- ``sse_response``: streamed responses, given up when the client stops reading;
- ``middleware``: API key and body-size limit; ``metrics``: Prometheus; ``cli_args``: flags.

Importing this package is cheap; FastAPI and uvicorn load with ``server`` (``pip install
'vllm-mlx[server]'``).
"""

from vllm_mlx.config import DEFAULT_STREAM_STALL_TIMEOUT_S  # noqa: F401 (declared with its option)

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: the request-body limit (413 above it)
