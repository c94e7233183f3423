"""LoRA adapters served beside their base model, many in one batch (issue #30).

``LoRARequest`` names an adapter for a request (vLLM's form); ``adapter.py`` reads mlx-lm's and
PEFT's adapter files into plain low-rank factors, checked against the base model;
``batched.py`` applies them per row of a batch: the base projection once for all rows, then each
row's low-rank update from the adapter slot it uses.
"""

from vllm_mlx.lora.request import LoRARequest

__all__ = ["LoRARequest"]
