"""Model sources: local MLX directories, hub ids, GGUF files, and the GGUF checkpoints that packages
on the index ship (``catalog.py``: the built-in default model, Gemma-3 270M Q4_K_M).

``resolve_model(source)`` turns any source into a local MLX model directory (preparing it if
needed); ``load_model(source)`` loads it with mlx-lm. Failures raise ``ModelSourceError`` with a
one-line message. A directory that names Python code (``model_file``, ``auto_map``) loads only
with ``trust_remote_code=True`` (``trust.py``); hub downloads skip ``*.py`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mlx.models.catalog import find_checkpoint, prepare_checkpoint
from vllm_mlx.models.hub import looks_like_repo_id, resolve_repo
from vllm_mlx.models.store import CachedModel, cache_root, list_cached_models, models_dir
from vllm_mlx.models.trust import check_model_code
from vllm_mlx.platform.errors import ModelSourceError

__all__ = [
    "CachedModel",
    "LoadedModel",
    "ModelSourceError",
    "cache_root",
    "list_cached_models",
    "load_model",
    "models_dir",
    "resolve_model",
]


def resolve_model(source: str | Path, trust_remote_code: bool = False) -> Path:
    """The local MLX model directory for ``source``: a directory, a ``.gguf`` file, the name of a
    checkpoint a package on the index ships (``default`` or ``smollm2-135m-instruct``,
    ``gemma3-270m-q4_k_m``), or a Hugging Face repo id (downloaded without ``*.py`` files unless
    ``trust_remote_code``)."""
    text = str(source)
    if (checkpoint := find_checkpoint(text)) is not None:
        return prepare_checkpoint(checkpoint)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is not an MLX model directory (no config.json)")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf model")
        from vllm_mlx.models.gguf import resolve_gguf

        return resolve_gguf(path)
    if looks_like_repo_id(text) and not text.startswith((".", "/", "~")):
        return resolve_repo(text, trust_remote_code=trust_remote_code)
    raise ModelSourceError(f"model not found: {text!r} is neither a local path, a hub repo id, nor 'default'")


@dataclass
class LoadedModel:
    """A model with its tokenizer wrapper, config and the directory it came from.

    ``model`` is an mlx-lm model, or for a vision-language model the
    ``vllm_mlx.multimodal.vlm_models.VisionLanguageModel`` adapter around the mlx-vlm model (then
    ``vision`` is that same adapter; it is None for text models).
    """

    model: Any
    tokenizer: Any
    config: dict
    path: Path
    vision: Any = None


def load_model(source: str | Path, trust_remote_code: bool = False) -> LoadedModel:
    """Resolve ``source`` and load it: text models with mlx-lm, vision-language models with
    mlx-vlm (directories whose config has a ``vision_config``).

    Raises:
        ModelSourceError: The model cannot be found or loaded, or it names Python code to run
            (``model_file``, ``auto_map``) and ``trust_remote_code`` is False.
    """
    import mlx_lm

    from vllm_mlx.models.portable_layers import make_portable

    path = resolve_model(source, trust_remote_code)
    check_model_code(path, trust_remote_code)
    config = read_config(path)
    if config is not None:
        from vllm_mlx.multimodal.vlm_models import is_vision_language_config

        if is_vision_language_config(config):
            return _load_vision_language_model(path, config, trust_remote_code)
    tokenizer_config = {"trust_remote_code": True} if trust_remote_code else None
    try:
        model, tokenizer, config = mlx_lm.load(
            str(path), tokenizer_config=tokenizer_config, return_config=True, trust_remote_code=trust_remote_code
        )
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelSourceError(f"cannot load the model in {path}: {exc}".splitlines()[0]) from exc
    except SystemExit as exc:  # an mlx-lm module that exits on import (OLMo's, without ai2-olmo)
        raise ModelSourceError(f"cannot load the model in {path}: mlx-lm's model code exited ({exc.code}); "
                               "it may print what it needs above") from None  # fmt: skip
    make_portable(model)  # BitNet's and Muse Spark's Metal kernels, on a backend without Metal
    return LoadedModel(model, tokenizer, config, path)


def read_config(path: Path) -> dict | None:
    """A model directory's ``config.json``, or None when it is missing or not JSON."""
    import json

    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # mlx-lm's loader reports it


def _load_vision_language_model(path: Path, config: dict, trust_remote_code: bool) -> LoadedModel:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from vllm_mlx.multimodal.vlm_families import load_vision_language_model

    vision = load_vision_language_model(path, config, trust_remote_code)
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    hf_tokenizer = vision.tokenizer
    if not getattr(hf_tokenizer, "chat_template", None):  # some VLMs keep it in chat_template.json
        hf_tokenizer.chat_template = getattr(vision.processor, "chat_template", None)
    tokenizer = TokenizerWrapper(hf_tokenizer, eos_token_ids=eos_ids)
    return LoadedModel(vision, tokenizer, config, path, vision=vision)
