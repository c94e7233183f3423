"""Model directories that name code: refused unless the user trusts them (``trust_remote_code``).

A model directory is data, except where its configs name Python to import: mlx-lm and mlx-vlm
import the file in ``config.json``'s ``model_file`` (mlx-vlm without asking), and transformers
imports the modules named by an ``auto_map`` (in the model, tokenizer or processor config) when
told to trust them. ``check_model_code`` looks for both, at any depth of those configs (so a
``text_config`` or ``vision_config`` counts too), before anything is loaded. Hub downloads leave
``*.py`` out unless trusted (``hub.allow_patterns``).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_mlx.platform.errors import ModelSourceError

__all__ = ["CODE_KEYS", "CONFIG_FILES", "check_model_code", "named_code"]

CODE_KEYS = ("model_file", "auto_map")
"""Config keys whose value names Python modules to import."""
CONFIG_FILES = (
    "config.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""The configs that the loaders read and that may name code."""


def check_model_code(path: Path, trust_remote_code: bool) -> None:
    """Raise ``ModelSourceError`` if ``path`` names code to run and it is not trusted."""
    if trust_remote_code:
        return
    found = named_code(path)
    if found:
        raise ModelSourceError(
            f"the model in {path} names Python code to run ({found[0]}); it is refused unless you "
            "trust it: pass trust_remote_code=True (CLI: --trust-remote-code)"
        )


def named_code(path: Path) -> list[str]:
    """``"file: key.path = value"`` for every code-naming key in the directory's configs."""
    found = []
    for name in CONFIG_FILES:
        file = path / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # the loader reports a broken config
        found += [f"{name}: {where}" for where in _code_keys(config, "")]
    return found


def _code_keys(value: object, prefix: str) -> list[str]:
    if isinstance(value, list):
        return [hit for item in value for hit in _code_keys(item, prefix)]
    if not isinstance(value, dict):
        return []
    hits = []
    for key, item in value.items():
        where = f"{prefix}{key}"
        if key in CODE_KEYS and item:
            hits.append(f"{where} = {json.dumps(item)[:120]}")
        else:
            hits += _code_keys(item, where + ".")
    return hits
