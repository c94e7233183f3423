"""From an ``--over`` request (a ``%%generate --over VAR`` cell or ``generate_over``) to a started
``OverGeneration``: rows, each row's prompt, resuming, and the in-flight bound.

A row's prompt is the cell body with ``{name}`` taken from the row first (``{item}`` for a list
of strings, ``{column}``/``{key}`` for DataFrame rows and dicts), then from the notebook, with
the same narrow rules as a plain cell (``prompt.interpolate``). ``--image NAME`` naming a
column (or key) of the rows gives each row its own image; any other ``NAME`` is one image for
every row.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vllm_mlx_jupyter.over.generation import OverGeneration, RowResult
from vllm_mlx_jupyter.over.rows import Row, RowSource
from vllm_mlx_jupyter.session.prompt import interpolate
from vllm_mlx_jupyter.session.session import Session, SessionError

IN_FLIGHT_PER_SEQ = 2  # default bound: twice the engine's batch, so a finished row's slot is refilled at once


@dataclass(frozen=True)
class Column:
    """An ``--image`` that names a column: each row's own value."""

    name: str


@dataclass
class OverRequest:
    """What every row of an ``--over`` run shares."""

    items: object
    template: str
    params: object
    name: str | None = None
    system: str | None = None
    raw: bool = False
    images: list = field(default_factory=list)
    """``--image`` names (a column, or what ``resolve_image`` makes of it) or image values."""
    response_format: object = None
    interpolate: bool = True
    namespace: Mapping = field(default_factory=dict)
    max_in_flight: int | None = None
    resume: OverGeneration | None = None
    interval: float = 0.1
    speculative: bool | None = None
    """Whether the rows speculate (None: as the engine was loaded)."""
    adapter: str | None = None
    """The LoRA adapter every row runs with (``--adapter``; None: the base model)."""


def start_over(session: Session, request: OverRequest, resolve_image: Callable[[object], object] = lambda x: x):
    """Check the request, then start its ``OverGeneration`` and register it with the session.

    Raises:
        SessionError: Not a list or DataFrame, a bad bound, or a resume that does not fit.
    """
    engine = session.require_engine()
    if request.speculative is not None and session.remote:
        raise SessionError("--speculative/--no-speculative: a server speculates as it was started; "
                           "connected, a cell cannot choose")  # fmt: skip
    session.check_params(request.params)
    try:
        source = RowSource(request.items)
    except TypeError as exc:
        raise SessionError(str(exc)) from None
    kept = _kept(request.resume, source)
    name = session.claim_name(request.name or (request.resume.name if request.resume is not None else None))
    bound = request.max_in_flight
    if bound is None:
        bound = IN_FLIGHT_PER_SEQ * session.max_num_seqs()
    columns = source.names()
    images = [Column(i) if isinstance(i, str) and i in columns else resolve_image(i) for i in request.images]
    fmt = request.response_format
    lora = session.adapter(request.adapter) if request.adapter is not None else None  # SessionError if unknown
    try:
        handle = OverGeneration(
            name, engine, source, _row_prompt(session, request, images), request.params, max_in_flight=bound,
            reader_format=fmt, constraint=engine.compile_constraint(request.params) if fmt is not None else None,
            kept=kept, interval=request.interval, speculative=request.speculative,
            lora_request=lora,
        )  # fmt: skip
    except ValueError as exc:
        raise SessionError(f"--max-in-flight: {exc}") from None
    handle.start()
    session.register(handle)
    return handle


def _row_prompt(session: Session, request: OverRequest, images: list) -> Callable[[Row], object]:
    """The function that renders and prepares one row's prompt (on the run's builder thread)."""

    def build(row: Row):
        names = ChainMap(row.fields, request.namespace)
        text, system = request.template, request.system
        if request.interpolate:
            text = interpolate(text, names)
            system = interpolate(system, names) if system else system
        row_images = [row.fields.get(i.name) if isinstance(i, Column) else i for i in images]
        return session.prompt_for(text, system=system, raw=request.raw, images=[i for i in row_images if i is not None])

    return build


def _kept(previous: OverGeneration | None, source: RowSource) -> dict[int, RowResult]:
    """The rows an earlier run finished, for ``--resume`` (nothing without one)."""
    if previous is None:
        return {}
    if not previous.done:
        raise SessionError(f"--resume: {previous.name!r} is still running: cancel it (or wait) first")
    if previous.total != len(source):
        raise SessionError(
            f"--resume: {previous.name!r} ran over {previous.total} rows, this input has {len(source)}: "
            "resume only the same rows (or drop --resume)"
        )
    return previous.kept_results
