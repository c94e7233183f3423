"""GGUF files (llama.cpp's format) as MLX model directories that mlx-lm loads as they are.

``header`` walks a file's header before any reader trusts it; ``tensors`` turns each tensor type
into MLX arrays (affine-quantized where MLX can hold the type exactly); ``architectures`` maps
each supported ``general.architecture`` to mlx-lm's config and parameter names; ``tokenizer``
builds ``tokenizer.json`` from the metadata; ``convert`` writes the directory atomically.
"""

from vllm_mlx.models.gguf.convert import convert_gguf, file_sha256, resolve_gguf

__all__ = ["convert_gguf", "file_sha256", "resolve_gguf"]
