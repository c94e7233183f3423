"""vLLM's runtime adapter endpoints: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Off unless the operator names a folder (``vllm-mlx serve --enable-lora-loading DIR``): a client
may then load adapter folders inside it, and nothing else on the server's disk (the path is
resolved, links included, before it is checked). A loaded adapter is read and checked against
the model before it is listed; its name then picks it as a request's ``model``, like
``--lora-modules``. Unloading removes the name (requests running with it finish).
"""

from __future__ import annotations

from pathlib import Path

from starlette.concurrency import run_in_threadpool

from vllm_mlx.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm_mlx.entrypoints.openai.serving import OpenAIError
from vllm_mlx.lora.request import LoRARequest


class LoRALoading:
    """The two endpoints' logic over the servings' shared ``adapters`` (name -> ``LoRARequest``)."""

    def __init__(self, engine, adapters: dict[str, LoRARequest], folder: str | Path | None) -> None:
        self.engine = engine
        self.adapters = adapters
        self.folder = Path(folder).expanduser().resolve() if folder is not None else None
        self._next_id = max((a.lora_int_id for a in adapters.values()), default=0) + 1

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        self._check_enabled()
        if body.lora_name in self.adapters:
            raise OpenAIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        path = Path(body.lora_path).expanduser().resolve()
        if not path.is_relative_to(self.folder):
            raise OpenAIError(403, "lora_path must be an adapter folder inside the server's --enable-lora-loading "
                              "folder", param="lora_path", code="forbidden")  # fmt: skip
        lora = LoRARequest(body.lora_name, self._next_id, str(path))
        try:
            await run_in_threadpool(self.engine.register_lora, lora)
        except ValueError as exc:  # AdapterError: not an adapter, another model's, neither LoRA nor DoRA
            raise OpenAIError(400, str(exc), param="lora_path") from None
        self._next_id += 1
        self.adapters[lora.lora_name] = lora
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        self._check_enabled()
        if self.adapters.pop(body.lora_name, None) is None:
            raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                              code="model_not_found")  # fmt: skip
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _check_enabled(self) -> None:
        if self.folder is None:
            raise OpenAIError(404, "Loading adapters at runtime is off (vllm-mlx serve --enable-lora-loading DIR)",
                              code="not_found")  # fmt: skip
