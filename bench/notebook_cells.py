"""Notebook cells: eight ``%%generate`` cells issued back to back vs the same eight with ``--wait``.

A real kernel (jupyter_client) receives all eight cells at once, as "Run All" sends them:
  concurrent  each cell returns at once; the engine batches the eight requests
  sequential  each cell blocks (``--wait``) until its generation is done
Reports the wall time from the first cell to the end of the last generation, the ratio, and the
TTFT of the last cell measured from when the cells were sent (what the user waits for) and as
the engine sees it (from the request's arrival).

    python bench/notebook_cells.py [--model default] [--cells 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "Write a haiku about the sea.", "Tell me a short joke.", "Name three rivers in Europe.",
    "What is the capital of France?", "Describe a cat in one sentence.", "Give me a tip for writing tests.",
    "What is 12 times 12?", "Suggest a name for a boat.", "Explain what a KV cache is.",
    "Write a one-line poem about autumn.",
]  # fmt: skip

REPORT = """
import json as _json, time as _time
%vllm_mlx wait
_gens = [{names}]
print("RESULT " + _json.dumps({{
    "end": _time.monotonic(),
    "gens": [{{"name": g.name, "state": g.state, "tokens": len(g.output.token_ids),
               "arrival": g.output.arrival_time, "first_token": g.output.first_token_time,
               "finish": g.output.finish_time}} for g in _gens],
}}))
"""


def run(kc, code: str, timeout: float = 600) -> str:
    """Execute one cell; return its stdout; raise on an error."""
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(reply["content"].get("evalue", "cell failed"))
    return "".join(out)


def send_all(kc, cells: list[str], timeout: float = 600) -> None:
    """Send every cell without waiting (as "Run All" does), then wait for all their replies."""
    pending = {kc.execute(cell) for cell in cells}
    deadline = time.monotonic() + timeout
    while pending:
        msg = kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") in pending:
            pending.discard(msg["parent_header"]["msg_id"])
            if msg["content"]["status"] != "ok":
                raise RuntimeError(msg["content"].get("evalue", "cell failed"))


def measure(kc, mode: str, cells: int, max_tokens: int) -> dict:
    names = [f"{mode}{i}" for i in range(cells)]
    flag = " --wait" if mode == "sequential" else ""
    source = [f"%%generate -n {n} -o {n} --max-tokens {max_tokens} --min-tokens {max_tokens} --temperature 0{flag}\n"
              f"{PROMPTS[i % len(PROMPTS)]}" for i, n in enumerate(names)]  # fmt: skip
    start = float(run(kc, "import time; print(time.monotonic())"))
    send_all(kc, source)
    stdout = run(kc, REPORT.format(names=", ".join(names)))
    result = json.loads(stdout.split("RESULT ", 1)[1])
    last = result["gens"][-1]
    return {
        "wall": result["end"] - start,
        "last_ttft_user": last["first_token"] - start,
        "last_ttft_engine": last["first_token"] - last["arrival"],
        "tokens": sum(g["tokens"] for g in result["gens"]),
        "states": {g["state"] for g in result["gens"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--cells", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    args = parser.parse_args(argv)

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, f"%load_ext vllm_mlx_jupyter\n%vllm_mlx load {args.model} --num-kv-blocks {args.num_kv_blocks}")
        run(kc, "%%generate --max-tokens 4 --wait\nWarm up.")
        results = {mode: measure(kc, mode, args.cells, args.max_tokens) for mode in ("concurrent", "sequential")}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    print(f"{args.cells} cells x {args.max_tokens} tokens, model {args.model}")
    print(f"{'mode':<12}{'wall s':>9}{'tok/s':>9}{'last TTFT (sent) s':>21}{'last TTFT (engine) s':>23}")
    for mode, r in results.items():
        assert r["states"] == {"done"}, r["states"]
        rate = r["tokens"] / r["wall"]
        print(f"{mode:<12}{r['wall']:>9.2f}{rate:>9.1f}{r['last_ttft_user']:>21.2f}{r['last_ttft_engine']:>23.2f}")
    c, s = results["concurrent"], results["sequential"]
    print(f"wall-time ratio sequential/concurrent: {s['wall'] / c['wall']:.2f}x; "
          f"last cell's TTFT from sending: {s['last_ttft_user']:.2f} s -> {c['last_ttft_user']:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
