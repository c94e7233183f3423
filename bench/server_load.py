"""Load test: this server (``vllm-mlx serve``) vs ``mlx_lm.server``, same model, same requests.

Each server runs alone, as a subprocess on its own loopback port (never both at once: they would
share the CPU). A load generator sends ``--num-requests`` streaming chat requests at each
concurrency level (at most that many in flight), greedy, ``--max-tokens`` each, and measures
aggregate output tok/s (completion tokens from the usage chunk / wall time) and TTFT (request
sent -> first content chunk) p50/p95. Then it prints both tables and the ratios.

    python bench/server_load.py                                  # default model, 1/8/32 x 32 x 64
    python bench/server_load.py --num-requests 8 --max-tokens 32 --concurrency 1,4
    python bench/server_load.py --weight-format quantized        # the same weights as mlx-lm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOPICS = [
    "the sea",
    "a lighthouse keeper",
    "the history of bread",
    "a robot learning to paint",
    "mountains",
    "the first day of school",
    "a city at night",
    "how rivers form",
    "an old clock",
    "a journey by train",
    "the moon",
    "a small garden",
    "a lost letter",
    "winter in the north",
    "a market in the morning",
    "a friendly dragon",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


class ServerProcess:
    """A server subprocess; ready once ``/v1/models`` answers; its log goes to a temp file."""

    def __init__(self, name: str, cmd: list[str], port: int, timeout: float) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text()[-2000:]
                raise RuntimeError(f"{name} exited ({self.proc.returncode}); log: {self.log.name}\n{tail}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start within {timeout} s; log: {self.log.name}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    start = time.perf_counter()
    first, tokens, chunks = None, None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "latency": end - start, "tokens": tokens if tokens is not None else chunks}


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    gate = asyncio.Semaphore(concurrency)

    def body(i: int) -> dict:
        content = f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}. (#{i})"
        return {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await one_request(client, {**body(0), "max_tokens": 4})  # warm-up (not measured)

        async def gated(i: int) -> dict:
            async with gate:
                return await one_request(client, body(i))

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(num_requests)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
    }


def bench_server(name: str, cmd: list[str], port: int, model_name: str, args) -> list[dict]:
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    server = ServerProcess(name, cmd, port, args.startup_timeout)
    try:
        rows = []
        for c in args.concurrency:
            row = asyncio.run(run_level(server.url, model_name, c, args.num_requests, args.max_tokens))
            print(
                f"   c={c:<3d} {row['tokens']:6d} tok  {row['wall_s']:7.2f} s  {row['tok_per_s']:8.1f} tok/s  "
                f"TTFT p50 {row['ttft_p50']:.3f} s  p95 {row['ttft_p95']:.3f} s",
                flush=True,
            )
            rows.append(row)
        return rows
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="model for both servers (default: the built-in one)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--weight-format",
        default="auto",
        choices=["auto", "quantized", "float32"],
        help="our server's weights (mlx-lm always runs the model's own)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--skip-mlx-lm", action="store_true", help="only benchmark this server")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from vllm_mlx.models import resolve_model

    model_dir = str(resolve_model(args.model))
    ours_port, theirs_port = free_port(), free_port()
    ours_cmd = [
        sys.executable,
        "-m",
        "vllm_mlx.entrypoints.cli",
        "serve",
        model_dir,
        "--port",
        str(ours_port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        "--weight-format",
        args.weight_format,
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    theirs_cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        model_dir,
        "--port",
        str(theirs_port),
        "--log-level",
        "WARNING",
        "--decode-concurrency",
        str(args.max_num_seqs),
    ]
    results = {"vllm-mlx": bench_server("vllm-mlx", ours_cmd, ours_port, "bench", args)}
    if not args.skip_mlx_lm:
        results["mlx-lm"] = bench_server("mlx-lm", theirs_cmd, theirs_port, model_dir, args)
        print("\n ratios are vllm-mlx / mlx-lm")
        print(" conc | tok/s vllm-mlx | tok/s mlx-lm | ratio | TTFT p50 ratio | TTFT p95 ratio")
        for ours, theirs in zip(results["vllm-mlx"], results["mlx-lm"]):
            print(
                f" {ours['concurrency']:4d} | {ours['tok_per_s']:14.1f} | {theirs['tok_per_s']:12.1f} | "
                f"{ours['tok_per_s'] / theirs['tok_per_s']:5.2f}x | {ours['ttft_p50'] / theirs['ttft_p50']:14.2f} | "
                f"{ours['ttft_p95'] / theirs['ttft_p95']:14.2f}"
            )
        print(" (tok/s: higher is better; TTFT ratios below 1 mean vllm-mlx answers sooner)")
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
