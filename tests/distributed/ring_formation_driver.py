"""One rank of ``tests/distributed/test_ring_formation.py``: form the group as every rank does
(``distributed.init_group``; rank 0 twice, as ``serve`` does), sum each rank's number once, and print one JSON line: the group's
size and the sum, or the error that ended the formation (its type and message)."""

from __future__ import annotations

import json

import mlx.core as mx


def main() -> None:
    from vllm_mlx.distributed.group import init_group

    try:
        group = init_group()
        if group.rank() == 0:  # as under `serve`: the CLI forms the group, then rank 0's engine asks again
            group = init_group()
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    total = mx.distributed.all_sum(mx.array([group.rank() + 1]), group=group).item()
    print(json.dumps({"rank": group.rank(), "size": group.size(), "sum": total}), flush=True)


if __name__ == "__main__":
    main()
