"""The handler of ``compile_guard.py``'s worker processes (``platform/worker_child.py`` runs it):
builds llguidance matchers where a blow-up cannot hurt the server, and answers whether they
compiled. Imports llguidance and nothing of ours.

Setup: ``{"tokenizer": <tokenizer.json text>, "eos": [ids], "memory_bytes": n}``. Each
``{"grammar": <llguidance grammar>}`` is answered ``{"error": null}`` (it compiled) or
``{"error": "<llguidance's message>"}``. Running out of memory kills the worker (Rust aborts on
a failed allocation); the parent sees its output end.
"""

from __future__ import annotations


def setup(message: dict):
    import llguidance

    return llguidance.LLTokenizer(message["tokenizer"], eos_token=message["eos"] or None)


def answer(tokenizer, message: dict) -> dict:
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, message["grammar"], log_level=0)
    return {"error": matcher.get_error() if matcher.is_error() else None}
