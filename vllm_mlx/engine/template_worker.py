"""The handler of ``template_guard.py``'s worker processes (``platform/worker_child.py`` runs it):
renders chat templates, code from a model's files, where a template that loops for hours or
builds a string of gigabytes costs the worker, not the server. Imports the tokenizer's libraries
(transformers, mlx-lm) and nothing of ours.

Requests:
- ``{"load": key, "tokenizer": <base64 pickle>}``: keep the tokenizer under ``key`` (the last
  ``KEPT_TOKENIZERS`` are kept); answered ``{"loaded": true}``, or ``{"unloadable": <why>}`` when
  its class cannot be imported here.
- ``{"tokenizer": key, "messages": [...], "add_generation_prompt": bool, "tools": [...] | null}``:
  ``{"text": <the rendered prompt>}``, ``{"error": <the template's message>}`` when it refused the
  messages, ``{"out_of_memory": true}`` when it needed more than the worker's cap, or
  ``{"missing": true}`` when no tokenizer is kept under ``key``.
"""

from __future__ import annotations

import base64
import pickle
from collections import OrderedDict

KEPT_TOKENIZERS = 4


def setup(message: dict) -> OrderedDict:
    return OrderedDict()


def answer(tokenizers: OrderedDict, message: dict) -> dict:
    if "load" in message:
        try:
            tokenizers[message["load"]] = pickle.loads(base64.b64decode(message["tokenizer"]))
        except (ImportError, AttributeError, pickle.UnpicklingError) as exc:  # a class this process cannot import
            return {"unloadable": f"{type(exc).__name__}: {exc}"}
        while len(tokenizers) > KEPT_TOKENIZERS:
            tokenizers.popitem(last=False)
        return {"loaded": True}
    tokenizer = tokenizers.get(message["tokenizer"])
    if tokenizer is None:
        return {"missing": True}
    tokenizers.move_to_end(message["tokenizer"])
    tools = message.get("tools")
    try:
        text = tokenizer.apply_chat_template(
            message["messages"], add_generation_prompt=message["add_generation_prompt"], tokenize=False,
            **({"tools": tools} if tools else {}),
        )  # fmt: skip
    except MemoryError:  # over the worker's cap (a string of gigabytes); the worker serves on
        return {"out_of_memory": True}
    except Exception as exc:  # noqa: BLE001 -- the template's refusal (e.g. roles that must alternate)
        return {"error": str(exc)}
    return {"text": text}
