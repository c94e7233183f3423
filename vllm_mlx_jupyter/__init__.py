"""IPython/Jupyter front end for vllm_mlx: ``%load_ext vllm_mlx_jupyter``.

Loading the extension registers ``%%generate`` and ``%vllm_mlx`` and imports nothing heavy:
MLX and the model load on ``%vllm_mlx load`` or the first ``%%generate``. ``%unload_ext``
stops the engine (running generations end as aborted) and removes the magics.
"""

from __future__ import annotations

__all__ = ["get_session", "load_ipython_extension", "unload_ipython_extension"]

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
    if ipython is None:
        from IPython import get_ipython

        ipython = get_ipython()
    magics = _MAGICS.get(id(ipython))
    if magics is None:
        raise RuntimeError("vllm_mlx_jupyter is not loaded in this shell: %load_ext vllm_mlx_jupyter")
    return magics.session


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
