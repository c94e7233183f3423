"""Dataclass fields that carry their meaning: ``described(default, doc=...)`` keeps the text in
the field's metadata (under ``DOC``), where ``vllm_mlx.config.tables`` reads it to generate the
configuration reference's tables of ``SchedulerConfig`` and ``SamplingParams``, as it reads
``EngineConfig``'s declarations (``vllm_mlx.config.options.option``). One source, so the tables
cannot drift from the code. Plain Python: ``core`` imports nothing above it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DOC = "doc"
"""The metadata key of a field's meaning (Markdown, as the docs' tables show it)."""


def described(default: Any = dataclasses.MISSING, *, doc: str, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with ``doc``, its meaning, in its metadata."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={DOC: doc})


def known_fields(cls: type, data: dict) -> dict:
    """The items of ``data`` that name a field of dataclass ``cls`` (what a ``from_dict`` may pass
    on: derived keys, and keys a newer or older peer added, are left out)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {key: value for key, value in data.items() if key in names}


def field_doc(f: dataclasses.Field) -> str:
    """The meaning of ``f``; ``ValueError`` when it was declared without one (``described``)."""
    doc = f.metadata.get(DOC)
    if not doc:
        raise ValueError(f"field {f.name!r} has no description: declare it with described(..., doc=...)")
    return doc
