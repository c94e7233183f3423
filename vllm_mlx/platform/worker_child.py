"""The child process of ``worker_pool.py``: ``python -I worker_child.py HANDLER``.

Run as a script, it imports nothing of ours: it loads the handler file by its path. A handler
defines ``setup(message: dict) -> state`` (the parent's first line; the child answers
``{"ready": true}``) and ``answer(state, message: dict) -> dict`` (each later line). Before each
request the child caps its address space at its size then plus the setup's ``memory_bytes`` (or
the request's own), so one request can add at most that much (a Python ``MemoryError`` is answered as a failure, a
native allocation over the cap aborts the child, and the parent sees its output end). A handler
that raises answers ``{"failed": "<the exception>"}`` and the child serves on.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import sys


def main() -> None:
    handler = _load_handler(sys.argv[1])
    setup = json.loads(sys.stdin.readline())
    state = handler.setup(setup)
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        _cap_address_space(request.pop("memory_bytes", setup["memory_bytes"]))
        try:
            answer = handler.answer(state, request)
        except Exception as exc:  # noqa: BLE001 -- one request's fault, told to the parent
            answer = {"failed": f"{type(exc).__name__}: {exc}"}
        _reply(answer)


def _load_handler(path: str):
    spec = importlib.util.spec_from_file_location("worker_handler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cap_address_space(extra_bytes: int) -> None:
    """Cap the address space (the soft limit: the handler's work cannot call setrlimit, and the
    next request moves it) at its size now plus ``extra_bytes``. Linux only: macOS has no
    ``/proc`` and ignores ``RLIMIT_AS``; there the parent's deadlines guard."""
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * resource.getpagesize()
    except OSError:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = current + extra_bytes if hard == resource.RLIM_INFINITY else min(current + extra_bytes, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        pass


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
