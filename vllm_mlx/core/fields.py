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


def field_doc(f: dataclasses.Field) -> str:
    """The meaning of ``f``; ``ValueError`` when it was declared without one (``described``)."""
    doc = f.metadata.get(DOC)
    if not doc:
        raise ValueError(f"field {f.name!r} has no description: declare it with described(..., doc=...)")
    return doc
