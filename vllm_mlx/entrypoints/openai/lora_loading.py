"""vLLM's runtime adapter endpoints: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Off unless the operator names a folder (``vllm-mlx serve --enable-lora-loading DIR``): a client
may then load adapter folders inside it, and nothing else on the server's disk (the folder's path
and each file's are resolved, links included, before they are checked). A loaded adapter is read
(off the engine thread, regular files only) and checked against the model before it is listed;
its name then picks it as a request's ``model``, like ``--lora-modules``. Unloading removes the
name; requests running with it finish, then the engine gives its memory back.

The operator's names stay theirs: the base model's name and the ``--lora-modules`` names can be
neither loaded over nor unloaded. A name is printable text without path segments (``..``); of
two loads of one name at once, the second is refused.
"""

from __future__ import annotations

from pathlib import Path

from starlette.concurrency import run_in_threadpool

from vllm_mlx.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm_mlx.entrypoints.openai.serving import DEFAULT_MODEL_ALIAS, OpenAIError
from vllm_mlx.lora.request import LoRARequest


class LoRALoading:
    """The two endpoints' logic over the servings' shared ``adapters`` (name -> ``LoRARequest``)."""

    def __init__(
        self, engine, adapters: dict[str, LoRARequest], folder: str | Path | None, base_model: str = ""
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.folder = Path(folder).expanduser().resolve() if folder is not None else None
        self.reserved = {base_model, DEFAULT_MODEL_ALIAS, *adapters}  # the operator's names: neither replaced nor unloaded
        self._loading: set[str] = set()
        self._next_id = max((a.lora_int_id for a in adapters.values()), default=0) + 1

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        self._check_enabled()
        name = body.lora_name
        _check_name(name)
        if name in self.reserved:
            raise OpenAIError(403, f"'{name}' is a name the server was started with; it cannot be replaced",
                              param="lora_name", code="forbidden")  # fmt: skip
        if name in self.adapters or name in self._loading:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        path = self._inside_folder(body.lora_path)
        lora, self._next_id = LoRARequest(name, self._next_id, str(path)), self._next_id + 1
        self._loading.add(name)  # before the await: a second load of the name is refused
        try:
            await run_in_threadpool(self.engine.register_lora, lora, self.folder)
        except ValueError as exc:  # AdapterError: not an adapter, another model's, neither LoRA nor DoRA
            raise OpenAIError(400, str(exc), param="lora_path") from None
        finally:
            self._loading.discard(name)
        self.adapters[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        self._check_enabled()
        name = body.lora_name
        if name in self.reserved:
            raise OpenAIError(403, f"'{name}' is a name the server was started with; it cannot be unloaded",
                              param="lora_name", code="forbidden")  # fmt: skip
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="model_not_found")  # fmt: skip
        await run_in_threadpool(self.engine.unregister_lora, lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _inside_folder(self, lora_path: str) -> Path:
        if "\0" in lora_path:
            raise OpenAIError(400, "lora_path holds a NUL character", param="lora_path")
        path = Path(lora_path).expanduser().resolve()
        if not path.is_relative_to(self.folder):
            raise OpenAIError(403, "lora_path must be an adapter folder inside the server's --enable-lora-loading "
                              "folder", param="lora_path", code="forbidden")  # fmt: skip
        return path

    def _check_enabled(self) -> None:
        if self.folder is None:
            raise OpenAIError(404, "Loading adapters at runtime is off (vllm-mlx serve --enable-lora-loading DIR)",
                              code="not_found")  # fmt: skip


MAX_NAME_LENGTH = 256


def _check_name(name: str) -> None:
    """A name clients will put in ``model``: printable, no surrounding spaces, no ``.``/``..``
    path segments (names may look like ``org/adapter``, never like a way out of a folder)."""
    problem = None
    if not name or len(name) > MAX_NAME_LENGTH:
        problem = f"must be 1 to {MAX_NAME_LENGTH} characters"
    elif not name.isprintable() or name != name.strip():
        problem = "must be printable, without control characters or surrounding spaces"
    elif any(part in (".", "..", "") for part in name.split("/")):
        problem = "must not hold empty, '.' or '..' path segments"
    if problem:
        raise OpenAIError(400, f"lora_name {problem}", param="lora_name")
