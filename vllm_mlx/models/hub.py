"""Hugging Face Hub repo ids, resolved with ``huggingface_hub`` (fails fast when offline)."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_mlx.platform.errors import ModelSourceError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


def looks_like_repo_id(source: str) -> bool:
    return bool(_REPO_ID.match(source)) and not source.endswith(".gguf")


def allow_patterns(trust_remote_code: bool) -> list[str]:
    """The files a hub download fetches: weights, configs, tokenizer; ``*.py`` only if trusted."""
    return [*_MODEL_FILES, "*.py"] if trust_remote_code else list(_MODEL_FILES)


def resolve_repo(repo_id: str, revision: str | None = None, *, trust_remote_code: bool = False) -> Path:
    """Download (or find in the local HF cache) an MLX model repository (``allow_patterns``)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as exc:  # pragma: no cover - mlx-lm depends on huggingface_hub
        raise ModelSourceError("resolving hub ids needs huggingface_hub (pip install huggingface_hub)") from exc
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns(trust_remote_code)))
    except LocalEntryNotFoundError as exc:
        raise ModelSourceError(
            f"cannot reach the Hugging Face Hub to fetch {repo_id!r} and it is not in the local cache; "
            "pass the path of a local MLX model directory or a .gguf file instead (or 'default')"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelSourceError(f"no model {repo_id!r} on the Hugging Face Hub (or it is private)") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(f"could not download {repo_id!r}: {exc}".splitlines()[0]) from exc
