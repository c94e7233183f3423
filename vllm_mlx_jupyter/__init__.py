"""IPython/Jupyter front end for vllm_mlx: ``%load_ext vllm_mlx_jupyter``.

Loading the extension registers ``%%generate`` and ``%vllm_mlx`` and imports nothing heavy:
MLX and the model load on ``%vllm_mlx load`` or the first ``%%generate``. ``%unload_ext``
stops the engine (running generations end as aborted) and removes the magics.
"""

from __future__ import annotations

__all__ = ["generate_over", "get_session", "load_ipython_extension", "unload_ipython_extension"]

_MAGICS: dict[int, object] = {}  # id(shell) -> GenerateMagics


def load_ipython_extension(ipython) -> None:
    from vllm_mlx_jupyter.magics import GenerateMagics

    if id(ipython) in _MAGICS:
        return
    magics = GenerateMagics(shell=ipython)
    ipython.register_magics(magics)
    _MAGICS[id(ipython)] = magics


def get_session(ipython=None):
    """The kernel-resident ``Session`` (its ``engine``, ``generations``, ``chats``) of a shell
    where the extension is loaded; the current shell by default."""
    return _magics(ipython).session


def generate_over(items, template: str, *, resume=None, ipython=None, **options):
    """``%%generate --over`` from Python: run ``template`` over each row of ``items`` (a list
    of strings or dicts, or a DataFrame) and return the ``OverGeneration`` at once.

    ``options`` are the cell's flags by name, with Python values: ``max_tokens=16``,
    ``temperature=0``, ``seed=0`` (row ``i`` samples with ``seed + i``), ``system=...``,
    ``raw=True``, ``image="column"``, ``choice=["yes", "no"]``, ``schema=Model``, ``regex=...``,
    ``max_in_flight=64``, ``name=...``, ``wait=True``. ``resume``: an earlier, finished or
    cancelled handle over the same rows, whose finished rows are kept.
    """
    return _magics(ipython).over_call(items, template, options, resume=resume)


def _magics(ipython):
    """The magics of ``ipython`` (default: the current shell), where the extension is loaded."""
    if ipython is None:
        from IPython import get_ipython

        ipython = get_ipython()
    magics = _MAGICS.get(id(ipython))
    if magics is None:
        raise RuntimeError("vllm_mlx_jupyter is not loaded in this shell: %load_ext vllm_mlx_jupyter")
    return magics


def unload_ipython_extension(ipython) -> None:
    magics = _MAGICS.pop(id(ipython), None)
    if magics is None:
        return
    magics.session.close()
    manager = ipython.magics_manager
    for kind, names in magics.magics.items():
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop(type(magics).__name__, None)
    if magics in ipython.configurables:
        ipython.configurables.remove(magics)
