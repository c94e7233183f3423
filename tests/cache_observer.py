"""What any client of a live server can read about its cache, and what a request changed in it:
the prefix-guessing attack's view (test_server_disclosure.py, test_server_fuzz.py)."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families


def observe(http) -> dict[str, object]:
    """``/v1/cache/stats``, ``/v1/cache/blocks`` and ``/metrics`` flattened to ``{path: value}``
    (not the latency histograms: timing is another channel, nor when a series was created)."""
    seen = flatten("stats", http.get("/v1/cache/stats").json()) | flatten("blocks", http.get("/v1/cache/blocks").json())
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.type != "histogram":
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    seen[f"metrics.{sample.name}{sorted(sample.labels.items())}"] = sample.value
    return seen


def flatten(prefix: str, value) -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(f"{prefix}.{key}", item).items()}
    return {prefix: value}


def changes(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """``after`` with each number as its change since ``before`` (counters only grow)."""

    def change(key, value):
        old = before.get(key)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        return value - (old or 0) if numeric and isinstance(old, (int, float, type(None))) else value

    return {key: change(key, value) for key, value in after.items()}


def differences(a: dict[str, object], b: dict[str, object]) -> dict[str, tuple]:
    return {key: (a.get(key), b.get(key)) for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


def wait_idle(http, timeout: float = 30) -> None:
    """Until no request is live (the stats' counts by status are empty)."""
    deadline = time.monotonic() + timeout
    while http.get("/v1/cache/stats").json()["request_states"]:
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)


def after_guess(http, secret: list[int], guess: list[int]) -> dict[str, object]:
    """One step of the attack, from an empty cache: another tenant's ``secret`` prompt, then the
    ``guess``; what the guess changed in everything a client can read."""
    assert http.delete("/v1/cache").json() == {"reset": True}
    _complete(http, secret)
    wait_idle(http)
    before = observe(http)
    _complete(http, guess)
    wait_idle(http)
    return changes(before, observe(http))


def _complete(http, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
