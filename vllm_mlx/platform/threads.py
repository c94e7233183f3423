"""MLX and threads: what every thread that runs MLX must do so the process exits cleanly.

MLX streams are thread-local. The engine thread (``AsyncEngineCore``) and vLLM's engine-core
thread (``MLXWorker``) each own a model; both use these helpers.
"""

from __future__ import annotations

import atexit
import functools


def clear_thread_streams() -> None:
    """MLX wants every thread that used it to destroy its streams before it ends (and the main
    thread before interpreter exit): a stream thread still alive at exit aborts the process
    ("terminate called without an active exception", exit status 134; ml-explore/mlx#3126)."""
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()


@functools.cache
def clear_streams_at_exit() -> None:
    atexit.register(clear_thread_streams)  # runs on the main thread, before finalization


def create_random_state_here() -> None:
    """MLX's global random state, created first on the engine thread, was seen to abort the
    process at exit ("terminate called without an active exception") under uvicorn; mlx-lm
    creates it at import. Creating it on the thread that starts the engine avoids that."""
    import mlx.core as mx
    import mlx_lm.sample_utils  # noqa: F401

    mx.random.state  # noqa: B018 - touching it creates it
