"""The two sides of the engine == mlx-lm oracle tests: mlx-lm's own greedy generation on a model
directory, and the engine's greedy tokens for the same prompts run to the end."""

from __future__ import annotations


def mlx_lm_tokens(path, prompts: list[str] | list[list[int]], max_tokens: int, adapter_path=None) -> list[list[int]]:
    """mlx-lm's ``stream_generate`` greedy tokens for each prompt (text or token ids), alone (with
    the LoRA adapter in ``adapter_path``, applied by mlx-lm itself, when given)."""
    import mlx_lm

    from vllm_mlx.models.portable_layers import make_portable

    model, tokenizer = mlx_lm.load(str(path), adapter_path=str(adapter_path) if adapter_path else None)
    make_portable(model)  # Metal kernels (BitNet, Muse Spark) on the CPU: as the engine's model (tested on its own)
    return [
        [r.token for r in mlx_lm.stream_generate(model, tokenizer, _ids(tokenizer, p), max_tokens=max_tokens)]
        for p in prompts
    ]


def _ids(tokenizer, prompt: str | list[int]) -> list[int]:
    return prompt if isinstance(prompt, list) else tokenizer.encode(prompt)


def finish(engine, final: dict | None = None) -> dict:
    """Step ``engine`` until idle; the final outputs by request id (added to ``final``)."""
    final = {} if final is None else final
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return final


def engine_tokens(engine, prompts: list[str], params) -> list[list[int]]:
    """Submit every prompt at once, run to the end; each prompt's tokens, in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    final = finish(engine)
    return [final[i].outputs[0].token_ids for i in ids]


def staggered_tokens(engine, prompts: list, params, after_step=None, max_steps: int = 5000) -> list[list[int]]:
    """Submit a prompt every other step while earlier ones run, step until idle (``after_step()`` after
    each step: an invariant to check); each prompt's tokens, in order."""
    ids, final = [], {}
    for step in range(max_steps):
        if step % 2 == 0 and len(ids) < len(prompts):
            ids.append(engine.add_request(prompts[len(ids)], params))
        elif not engine.has_unfinished_requests():
            break
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        if after_step is not None:
            after_step()
    return [final[i].outputs[0].token_ids for i in ids]
