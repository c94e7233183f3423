"""Values into HTML: every HTML builder of the notebook puts data in through these.

Almost nothing a notebook output shows is its own: model text, a server's JSON
(``%vllm_mlx connect``), request names. A saved notebook is trusted when it is opened again, so
markup that slips into an output runs later, on whoever opens it. Hence:

- ``escape(value)``: any value as HTML text, safe in element content and in a quoted attribute
  (``"`` and ``'`` are escaped too);
- ``as_int`` / ``as_float``: a value meant to be a number, as one (a server's ``"<script>"``,
  ``None``, ``NaN`` or a list turn into the fallback), so a number is never formatted into
  markup as the string it came as, and a format spec like ``:.0%`` never raises on one.
"""

from __future__ import annotations

import html
import math


def escape(value: object) -> str:
    """``value`` (anything; ``str()`` of it) as escaped HTML text."""
    return html.escape(value if isinstance(value, str) else str(value), quote=True)


def as_float(value: object, fallback: float = 0.0) -> float:
    """``value`` as a finite float; ``fallback`` when it is not a finite number."""
    if isinstance(value, str | bytes) and not value.strip():
        return fallback
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return fallback
    return number if math.isfinite(number) else fallback


def as_int(value: object, fallback: int = 0) -> int:
    """``value`` as an int (a float is truncated); ``fallback`` when it is not a finite number."""
    if isinstance(value, int):  # bool included: JSON's true is 1
        return int(value)
    number = as_float(value, math.nan)
    return fallback if math.isnan(number) else int(number)
