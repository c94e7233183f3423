"""What re-quantizing a GGUF's non-affine tensors to 8 bits does to the model's logits.

vllm-mlx holds seven GGML types exactly (MLX's affine format, groups of 32) and re-quantizes the
others (Q2_K, Q3_K, Q6_K, the i-quants, ...) to 8 bits in groups of 32 (``models/gguf/tensors.py``).
This compares, on one GGUF file, the converted model against the same model with every
re-quantized tensor replaced by gguf-py's exact float32 dequantization, both computing in float32:
the largest logit difference, top-1 agreement and the KL divergence per position.

    python bench/gguf_requantization.py FILE.gguf [--prompt TEXT]
    python bench/gguf_requantization.py gemma3-270m-q4_k_m   # a checkpoint the index ships
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

PROMPT = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the "
    "city to the fall of Constantinople. Its institutions"
)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def exact_weights(gguf_path: Path) -> list:
    """(mlx-lm name, exact float32 array) of every tensor the conversion re-quantized."""
    import mlx.core as mx

    from vllm_mlx.models.gguf.architectures import architecture_of
    from vllm_mlx.models.gguf.header import open_gguf
    from vllm_mlx.models.gguf.tensors import REQUANTIZED_TYPES, dequantize, type_name

    gguf = open_gguf(gguf_path)
    arch = architecture_of(gguf.metadata)
    return [
        (arch.hf_name(name), mx.array(dequantize(gguf.tensor_bytes(info), info.type_id, info.shape)))
        for name, info in gguf.tensors.items()
        if type_name(info.type_id) in REQUANTIZED_TYPES
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", help="a .gguf file, or the name of a checkpoint the index ships")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm

    from vllm_mlx.models.gguf import convert_gguf
    from vllm_mlx.platform.cpu_backend import prepare_model_weights

    path = Path(args.gguf)
    if not path.is_file():
        from vllm_mlx.models.catalog import checkpoint_gguf_path  # noqa: PLC0415 (a checkpoint by name)

        path = checkpoint_gguf_path(args.gguf)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = convert_gguf(path, Path(tmp) / "model", scale_dtype="float32")
        converted, tokenizer = mlx_lm.load(str(model_dir))
        exact, _ = mlx_lm.load(str(model_dir))
    for model in (converted, exact):
        prepare_model_weights(model, "float32")
    replaced = exact_weights(path)
    exact.load_weights(replaced, strict=False)
    ids = tokenizer.encode(args.prompt)
    ours = np.array(converted(mx.array([ids]))[0].astype(mx.float32))
    reference = np.array(exact(mx.array([ids]))[0].astype(mx.float32))
    kl = (np.exp(log_softmax(reference)) * (log_softmax(reference) - log_softmax(ours))).sum(-1)
    print(f"{path.name}: {len(replaced)} re-quantized tensors, {len(ids)}-token prompt")
    print(f"  max |logit difference| {np.abs(ours - reference).max():.3g} (logits within ±{np.abs(reference).max():.3g})")
    print(f"  top-1 agreement        {(ours.argmax(-1) == reference.argmax(-1)).mean():.3f}")
    print(f"  KL(exact || ours)      mean {kl.mean():.2g} nats, max {kl.max():.2g}")


if __name__ == "__main__":
    main()
