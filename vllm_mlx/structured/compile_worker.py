"""The child process of ``compile_guard.py``: builds llguidance matchers where a blow-up cannot
hurt the server, and answers whether they compiled.

Run as a script (``python compile_worker.py``), so that it imports llguidance and nothing of
ours. Protocol, one JSON object per line: the first from the parent is
``{"tokenizer": <tokenizer.json text>, "eos": [ids], "memory_bytes": n}``; the worker answers
``{"ready": true}`` once its address space is capped at its size then plus ``memory_bytes``.
Then each ``{"grammar": <llguidance grammar>}`` is answered ``{"error": null}`` (it compiled) or
``{"error": "<llguidance's message>"}``. Running out of memory kills the worker (Rust aborts on
a failed allocation); the parent sees its output end.
"""

from __future__ import annotations

import json
import resource
import sys


def _address_space() -> int:
    """This process's virtual memory size in bytes (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * resource.getpagesize()
    except OSError:
        return 0


def main() -> None:
    import llguidance

    setup = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], eos_token=setup["eos"] or None)
    current = _address_space()
    if current:  # Linux; macOS has no /proc and ignores RLIMIT_AS: there the parent's timeout guards
        limit = current + setup["memory_bytes"]
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
    _reply({"ready": True})
    for line in sys.stdin:
        grammar = json.loads(line)["grammar"]
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        _reply({"error": matcher.get_error() if matcher.is_error() else None})
        del matcher


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
