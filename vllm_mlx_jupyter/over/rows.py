"""The rows of ``%%generate --over VAR``: what each row's template sees, and the results table.

``VAR`` is a list (or tuple) of strings or of dicts, or a pandas DataFrame. A row is a mapping
from names to values: ``{"item": text}`` for a string, the dict itself for a dict, the columns
of a DataFrame row. Rows are read lazily, in input order: nothing is copied or rendered up front,
so a DataFrame of 100,000 rows costs one row at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One input row: its position and the names its template may use."""

    index: int
    fields: Mapping[str, object]


class RowSource:
    """Reads the rows of a list or a DataFrame.

    Raises:
        TypeError: ``items`` is not a list/tuple of strings or dicts, nor a DataFrame.
    """

    def __init__(self, items: object) -> None:
        self.items = items
        self.frame = _is_frame(items)
        if not self.frame:
            if isinstance(items, str | bytes) or not isinstance(items, Sequence):
                kind = type(items).__name__
                raise TypeError(f"--over needs a list (of strings or dicts) or a pandas DataFrame, not {kind}")
            bad = next((x for x in items if not isinstance(x, str | Mapping)), None)  # fmt: skip
            if bad is not None:
                raise TypeError(f"--over: every item must be a string or a dict, not {type(bad).__name__}")

    def __len__(self) -> int:
        return len(self.items)

    def names(self) -> set[str]:
        """The names a row may hold (columns; keys of the first dicts; ``item``)."""
        if self.frame:
            return {str(c) for c in self.items.columns}
        names = {"item"}
        for item in self.items[:100]:
            if isinstance(item, Mapping):
                names |= {str(k) for k in item}
        return names

    def rows(self, skip: frozenset[int] = frozenset()) -> Iterator[Row]:
        """The rows in input order, leaving out the indices in ``skip`` (rows already done)."""
        for index, fields in enumerate(self._fields()):
            if index not in skip:
                yield Row(index, fields)

    def _fields(self) -> Iterator[Mapping[str, object]]:
        if self.frame:
            columns = [str(c) for c in self.items.columns]
            for values in zip(*(self.items[c] for c in self.items.columns), strict=True):
                yield dict(zip(columns, values, strict=True))
            return
        for item in self.items:
            yield {"item": item} if isinstance(item, str) else {str(k): v for k, v in item.items()}

    def table(self, columns: dict[str, list]):
        """A copy of the input DataFrame with ``columns`` added (or replaced)."""
        frame = self.items.copy()
        for name, values in columns.items():
            frame[name] = values
        return frame


def _is_frame(items: object) -> bool:
    """A pandas DataFrame, without importing pandas when it is not one."""
    return type(items).__name__ == "DataFrame" and hasattr(items, "columns") and hasattr(items, "iloc")
