"""Forming the ranks' group, and making sure every member belongs to this launch.

MLX's ring backend forms its ring over plain TCP with no handshake: rank r (r < N - 1) accepts
the first connection on its port as its left neighbour, then connects to rank r + 1's port; the
last rank connects first, then accepts. Any local process that connects to a rank's loopback
port before that rank's real neighbour does is taken for it (a port scanner, a health probe, a
rank of another launch on the same ports). Two things can follow:

- The ring fails to form: the accepting rank closes its listening socket after the stray's
  connection, so its real neighbour is refused, and every rank's ``mx.distributed.init`` raises
  "[ring] Couldn't connect". ``form_group`` retries the init (MLX allows a new ``init`` after a
  failed one: each rank binds and connects anew) a bounded number of times, then raises
  ``RingFormationError`` saying what most likely happened, instead of "not a rank of a launch".
- The ring forms with a process of another launch in it (another launch's rank took a place in
  this ring). ``check_launch_nonce`` finds it: the launcher hands every rank of one launch the
  same random nonce (``LAUNCH_NONCE_ENV``), and right after the group forms, before any other
  collective, the ranks ``all_gather`` a hash of it. A mismatch names the place the foreign
  process holds and the port it connected to (``ForeignRankError``); MLX keeps a formed group
  for the life of the process, so this one is not retried: the launch must be restarted.

Ranks launched without a nonce (``mlx.launch`` across machines, unless given
``--env VLLM_MLX_LAUNCH_NONCE=...``) all contribute zeros, which agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time

import mlx.core as mx
import numpy as np

from vllm_mlx.platform.errors import VllmMlxError

logger = logging.getLogger(__name__)

LAUNCH_NONCE_ENV = "VLLM_MLX_LAUNCH_NONCE"
FORM_ATTEMPTS = 3
RETRY_PAUSE_S = 1.0  # lets every rank notice the failure before anyone listens again
NONCE_HASH_BYTES = 16


class RingFormationError(VllmMlxError):
    """The ranks of a launch could not form their group."""


class ForeignRankError(RingFormationError):
    """A process that is not part of this launch took a place in the group."""


def new_launch_nonce() -> str:
    """A fresh nonce for one launch: the same value goes to every one of its ranks."""
    return secrets.token_hex(16)


def launched_as_rank() -> bool:
    """This process was started as a rank of a launch (MLX's ring environment is set)."""
    return "MLX_RANK" in os.environ and "MLX_HOSTFILE" in os.environ


def ring_addresses() -> list[str]:
    """Each rank's ``host:port`` from ``MLX_HOSTFILE`` (empty when unreadable)."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return [", ".join(addresses) for addresses in json.load(f)]
    except (KeyError, OSError, ValueError, TypeError):
        return []


def form_group(strict: bool = True, attempts: int = FORM_ATTEMPTS) -> mx.distributed.Group:
    """``mx.distributed.init``, retried while it fails in a process launched as a rank; then the
    nonce check. Outside a launch the first failure is re-raised as it came (``RuntimeError``)."""
    for attempt in range(1, attempts + 1):
        try:
            group = mx.distributed.init(strict=strict)
            break
        except RuntimeError as exc:
            if not launched_as_rank():
                raise
            if attempt == attempts:
                raise RingFormationError(formation_failure(exc, attempts)) from exc
            logger.warning("rank %s: the ring did not form (%s); trying again (%d of %d)",
                           os.environ["MLX_RANK"], exc, attempt + 1, attempts)  # fmt: skip
            time.sleep(RETRY_PAUSE_S)
    if group.size() > 1 and not _nonce_checked:
        check_launch_nonce(group)
    return group


_nonce_checked = False
"""MLX forms the group once per process and hands the same one to every later ``init``; the
check is a collective, so it runs once too (a rank may ask for the group more than once: ``serve``
forms it, then rank 0's engine asks again, while the workers do not)."""


def formation_failure(exc: Exception, attempts: int) -> str:
    addresses = ", ".join(ring_addresses()) or "see MLX_HOSTFILE"
    return (
        f"rank {os.environ.get('MLX_RANK', '?')} could not form the ring with its peers after {attempts} attempts "
        f"({exc}); the ranks' ports are {addresses}: a process that is not part of this launch may have "
        "connected to one of them first (MLX's ring takes the first connection for the neighbouring rank), "
        "or another rank did not start or was refused its port"
    )


def nonce_hash(nonce: str | None) -> np.ndarray:
    """What a rank contributes: a hash of its launch's nonce, or zeros without one."""
    if not nonce:
        return np.zeros(NONCE_HASH_BYTES, np.int32)
    return np.frombuffer(hashlib.sha256(nonce.encode()).digest()[:NONCE_HASH_BYTES], np.uint8).astype(np.int32)


def check_launch_nonce(group: mx.distributed.Group, nonce: str | None = None) -> None:
    """Every member of ``group`` holds this launch's nonce (collectively: the first collective
    every rank issues). ``nonce``: this rank's (default: ``LAUNCH_NONCE_ENV``)."""
    nonce = os.environ.get(LAUNCH_NONCE_ENV) if nonce is None else nonce
    mine = nonce_hash(nonce)
    gathered = np.array(mx.distributed.all_gather(mx.array(mine), group=group)).reshape(group.size(), -1)
    foreign = [rank for rank in range(group.size()) if not (gathered[rank] == mine).all()]
    if foreign:
        raise ForeignRankError(foreign_message(group.rank(), group.size(), foreign))
    global _nonce_checked
    _nonce_checked = True


def foreign_message(rank: int, size: int, foreign: list[int]) -> str:
    """Rank ``rank``'s account of the places ``foreign`` held by processes of another launch: the
    process at place j connected to rank j + 1's port (the ring's direction)."""
    addresses = ring_addresses()
    parts = []
    for place in foreign:
        target = (place + 1) % size
        port = f" ({addresses[target]})" if target < len(addresses) else ""
        parts.append(f"a process that is not part of this launch connected to rank {target}'s port{port} "
                     f"and holds rank {place}'s place in the ring")  # fmt: skip
    return (
        f"rank {rank}: " + "; ".join(parts) + " (its launch nonce differs from this rank's); "
        "stop the other program or launch on other ports, then start the ranks again"
    )
