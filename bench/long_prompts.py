"""Prompts too long for the context: what they cost the other clients.

Starts ``vllm-mlx serve`` (the default model) on a loopback port, measures a one-token chat
request alone (median of ``--repeats``), then sends ``--clients`` chat requests of
``--megabytes`` of text each at once and, while they are in flight, the same one-token request
again and again. Prints how long the huge requests took to be refused and how long the small
ones waited.

    python bench/long_prompts.py                       # 4 clients x 3.75 MB
    python bench/long_prompts.py --clients 8 --megabytes 2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

SENTENCE = "The quick brown fox jumps over the lazy dog. "
SMALL = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_mlx.entrypoints.cli", "serve", "default", "--port", str(port)]
    cmd += ["--log-level", "warning"]
    log = tempfile.NamedTemporaryFile("w+", prefix="long-prompts-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not start in {timeout} s; log: {log.name}")


def timed_post(client: httpx.Client, body: dict) -> tuple[float, int]:
    started = time.monotonic()
    status = client.post("/v1/chat/completions", json=body).status_code
    return time.monotonic() - started, status


def measure(url: str, clients: int, megabytes: float, repeats: int) -> dict:
    with httpx.Client(base_url=url, timeout=600) as client:
        timed_post(client, SMALL)  # warm
        alone = statistics.median(timed_post(client, SMALL)[0] for _ in range(repeats))
        text = SENTENCE * int(megabytes * 1e6 / len(SENTENCE))
        huge = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        results: list[tuple[float, int]] = []

        def send() -> None:
            with httpx.Client(base_url=url, timeout=600) as own:
                results.append(timed_post(own, huge))

        threads = [threading.Thread(target=send) for _ in range(clients)]
        for thread in threads:
            thread.start()
        beside: list[float] = []
        while any(thread.is_alive() for thread in threads) or not beside:
            seconds, status = timed_post(client, SMALL)
            assert status == 200, status
            beside.append(seconds)
            time.sleep(0.1)
        for thread in threads:
            thread.join()
    return {"alone": alone, "beside": beside, "huge": sorted(results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--megabytes", type=float, default=3.75)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--startup-timeout", type=float, default=300)
    args = parser.parse_args(argv)
    port = free_port()
    proc = start_server(port, args.startup_timeout)
    try:
        result = measure(f"http://127.0.0.1:{port}", args.clients, args.megabytes, args.repeats)
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"one-token request alone (median of {args.repeats}): {result['alone']:.3f} s")
    beside = result["beside"]
    print(
        f"one-token requests while {args.clients} x {args.megabytes} MB prompts were in flight: {len(beside)}, "
        f"median {statistics.median(beside):.3f} s, slowest {max(beside):.3f} s"
    )
    for seconds, status in result["huge"]:
        print(f"  huge prompt answered in {seconds:.2f} s with status {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
