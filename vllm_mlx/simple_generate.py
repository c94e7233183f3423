"""A single-request generation path through mlx-lm.

This is the foundation's stand-in for the engine: it streams text for one prompt with
mlx-lm's own generator. The continuous-batching engine replaces it behind the same CLI.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vllm_mlx.request import SamplingParams


def generate_text(model: str | Path, prompt: str, params: SamplingParams, *, chat: bool = True) -> Iterator[str]:
    """Yield text pieces for ``prompt`` as they are generated."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from vllm_mlx.models import load_model

    loaded = load_model(model)
    tokenizer = loaded.tokenizer
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p, top_k=params.top_k)
    for response in mlx_lm.stream_generate(
        loaded.model, tokenizer, prompt, max_tokens=params.max_tokens, sampler=sampler
    ):
        yield response.text
