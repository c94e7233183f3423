"""The scheduler's waiting queue: FIFO within a client, round-robin across clients.

One HTTP request with 3,000 prompts, or ``n=64``, becomes thousands of engine requests. Served
strictly FIFO, a small request sent a second later would wait behind all of them. So waiting
requests are grouped by ``Request.fairness_key`` (one key per caller's request by default; the
server gives all prompts of one HTTP request the same key) and admission takes the first request
of each key in turn.

Invariants:

* Within a key, requests leave in the order they came (a preempted request re-enters at the
  front of its key, and its key moves to the front of the rotation: it resumes first, as it
  did before fairness existed).
* With one request per key (the default), the order is plain FIFO.
* ``len`` and ``bool`` are O(1); ``peek`` is O(keys with running requests + 1) (see its
  docstring); ``remove`` is O(requests of that key).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Mapping

from vllm_mlx.core.request import Request


class WaitingQueue:
    """Waiting requests, admitted round-robin over ``fairness_key``, FIFO within a key."""

    def __init__(self) -> None:
        self._by_key: OrderedDict[str, deque[Request]] = OrderedDict()
        self._len = 0

    def append(self, request: Request) -> None:
        """Queue a new request behind the others of its key."""
        self._by_key.setdefault(request.fairness_key, deque()).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """Put a preempted request back: first of its key, its key first in the rotation."""
        key = request.fairness_key
        self._by_key.setdefault(key, deque()).appendleft(request)
        self._by_key.move_to_end(key, last=False)
        self._len += 1

    def peek(self, load: Mapping[str, int] | None = None, skip: Collection[str] = ()) -> Request | None:
        """The request admission takes next: the first of the key with the least ``load``
        (running requests per key; none = all equal), the earliest key in rotation among equals;
        keys in ``skip`` are passed over (None when every key is).

        Only keys with running requests have a load, and there are at most ``max_num_seqs`` of
        those, so the scan stops within that many keys (plus the skipped ones) of the front.
        IndexError when empty.
        """
        if not self._by_key:
            raise IndexError("peek from an empty WaitingQueue")
        best_key, best_load = None, None
        for key in self._by_key:
            if key in skip:
                continue
            key_load = load.get(key, 0) if load else 0
            if best_load is None or key_load < best_load:
                best_key, best_load = key, key_load
                if key_load == 0:
                    break
        return None if best_key is None else self._by_key[best_key][0]

    def pop(self, request: Request) -> None:
        """Take ``request``, the first of its key (as ``peek`` returned it); its key goes to the
        back of the rotation."""
        key = request.fairness_key
        queue = self._by_key[key]
        if queue[0] is not request:
            raise ValueError(f"{request.request_id!r} is not first of its key")
        queue.popleft()
        if queue:
            self._by_key.move_to_end(key)
        else:
            del self._by_key[key]
        self._len -= 1

    def remove(self, request: Request) -> None:
        """Drop a request (abort, error); ValueError if it is not queued."""
        key = request.fairness_key
        queue = self._by_key.get(key)
        if queue is None:
            raise ValueError(f"{request.request_id!r} is not waiting")
        queue.remove(request)
        if not queue:
            del self._by_key[key]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __getitem__(self, index: int) -> Request:
        """The ``index``-th request in iteration order (``queue[0]`` is ``peek()``)."""
        return list(self)[index]

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request: keys in rotation order, each key's requests in order."""
        for queue in self._by_key.values():
            yield from queue
