"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and path: ``LoRARequest("sql", 1, "adapters/sql")``.

    ``lora_int_id`` identifies the adapter to the engine (its slot, its prefix-cache blocks);
    it must be >= 1 (0 is the base model) and stand for one adapter for the engine's lifetime.
    ``lora_path``: a folder with mlx-lm's ``adapters.safetensors`` + ``adapter_config.json``, or
    PEFT's ``adapter_model.safetensors`` + ``adapter_config.json``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest: lora_path must be a non-empty str, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
