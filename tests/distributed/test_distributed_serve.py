"""``vllm-mlx serve --tensor-parallel-size 2`` and ``--pipeline-parallel-size 2``
(vllm_mlx/entrypoints/distributed_serve.py): the CLI starts two loopback ranks and supervises
them; only rank 0 listens for HTTP; the official ``openai`` client gets the single-process
engine's greedy text; SIGTERM stops every rank; a rank killed or hung mid-generation fails the
stream and ends the launch with status 1. Models that cannot be split, and ``--distributed``
outside a launch, are refused with a clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from live_server import free_socket, wait_for_health
from vllm_mlx.entrypoints import cli

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox jumps over the lazy dog and"
START_TIMEOUT = 150  # two model loads on 2 busy cores take ~20 s
STOP_TIMEOUT = 30  # SIGTERM to exit: uvicorn's shutdown, then the engine's "stop" to rank 1


def _rank_pids(marker: str) -> dict[int, int]:
    """rank -> pid of the live rank processes whose command line holds ``marker`` (our model
    directory's unique path), read from each process's ``MLX_RANK``."""
    psutil = pytest.importorskip("psutil")
    ranks = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(process.info["cmdline"] or ()) and "--distributed" in process.info["cmdline"]:
                if process.status() != psutil.STATUS_ZOMBIE:
                    ranks[int(process.environ()["MLX_RANK"])] = process.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            continue
    return ranks


def _listening_ports(pid: int) -> set[int]:
    import psutil

    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _ring_ports(pid: int) -> set[int]:
    import psutil

    hostfile = json.loads(Path(psutil.Process(pid).environ()["MLX_HOSTFILE"]).read_text())
    return {int(address.rsplit(":", 1)[1]) for rank in hostfile for address in rank}


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path) -> Path:
    """The tiny llama (4 heads, 2 KV heads) under a unique path: the marker that finds our ranks."""
    return _unique_copy(tiny_model_dir, tmp_path)


def _unique_copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / f"tiny-tp-{uuid.uuid4().hex[:8]}"))


def _single_process_text(model_dir: Path) -> str:
    """The single-process engine's greedy completion of ``PROMPT`` (12 tokens)."""
    from vllm_mlx.core.request import SamplingParams
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=str(model_dir), force_model_takeover=True)
    try:
        engine.add_request(PROMPT, SamplingParams(max_tokens=12, temperature=0), request_id="x")
        while engine.has_unfinished_requests():
            outputs = engine.step()
        return outputs[0].outputs[0].text
    finally:
        engine.shutdown()


def _kill_everything(proc: subprocess.Popen, marker: str) -> None:
    for pgid in {proc.pid, *_rank_pids(marker).values()}:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(10)


def _start_two_ranks(
    model_dir: Path, tmp_path: Path, *extra: str, split: str = "--tensor-parallel-size"
) -> tuple[subprocess.Popen, int, Path]:
    """``vllm-mlx serve MODEL {split} 2 [extra]`` in its own session, logging to a file."""
    sock, _ = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "vllm_mlx.entrypoints.cli", "serve", str(model_dir),
               split, "2", "--port", str(port), "--host", "127.0.0.1", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, port, log


SPLITS = {"--tensor-parallel-size": "tiny_model_dir", "--pipeline-parallel-size": "tiny_qwen3_5_dir"}


@pytest.mark.parametrize("split", SPLITS)
def test_serve_over_two_ranks_equals_the_single_process_engine(split, request, tmp_path):
    """Heads split (the tiny llama) or layers split (two stages of the tiny Qwen3.5 hybrid)."""
    import mlx.core as mx
    import openai

    if not mx.distributed.is_available():
        pytest.skip("mlx has no distributed backend")
    source = request.getfixturevalue(SPLITS[split])
    single_process_text = _single_process_text(source)
    model_dir = _unique_copy(source, tmp_path)
    proc, port, log = _start_two_ranks(model_dir, tmp_path, split=split)
    try:
        wait_for_health(proc, port, log, START_TIMEOUT, "the 2-rank server")
        ranks = _rank_pids(str(model_dir))
        assert sorted(ranks) == [0, 1], log.read_text()[-3000:]
        # Only rank 0 serves HTTP; rank 1 listens on nothing but its ring port.
        ring = _ring_ports(ranks[0])
        assert port in _listening_ports(ranks[0])
        assert _listening_ports(ranks[1]) <= ring and port not in ring

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert completion.choices[0].text == single_process_text
        assert completion.usage.completion_tokens == 12

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_TIMEOUT) == 0, log.read_text()[-3000:]
        assert time.monotonic() - started < STOP_TIMEOUT
        assert _rank_pids(str(model_dir)) == {}  # (the supervisor reaped them: no zombies either)
        assert "rank 1: stopped after" in log.read_text()  # rank 1 ended on rank 0's "stop"
    finally:
        _kill_everything(proc, str(model_dir))


def test_ranks_end_themselves_when_the_supervisor_is_killed(model_dir, tmp_path):
    """SIGKILL cannot be forwarded: every rank ends itself, whichever way it learns first. Rank 0
    notices it was re-parented, or that rank 1's liveness link closed (rank 1 ended first); rank 1,
    blocked in a collective waiting for rank 0's next message, notices it was re-parented too, or
    the ring tells it that rank 0 is gone."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        pytest.skip("mlx has no distributed backend")
    proc, port, log = _start_two_ranks(model_dir, tmp_path)
    try:
        wait_for_health(proc, port, log, START_TIMEOUT, "the 2-rank server")
        assert sorted(_rank_pids(str(model_dir))) == [0, 1]
        proc.kill()  # the supervisor alone (the ranks are in a process group of their own)
        proc.wait(10)
        deadline = time.monotonic() + 15
        while _rank_pids(str(model_dir)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert _rank_pids(str(model_dir)) == {}, log.read_text()[-3000:]
        text = log.read_text()
        assert "rank 0: the supervisor is gone; exiting" in text or "rank 1's process ended" in text, text[-3000:]
        assert "rank 1: the supervisor is gone; exiting" in text or "rank 1: rank 0 or a peer is gone" in text
    finally:
        _kill_everything(proc, str(model_dir))


HUNG_TIMEOUT_S = 15  # --distributed-timeout of the hang case (5 s: a busy machine's first steps took longer)
# The die case is noticed at once (rank 1's liveness link closes; asserted below), never at the deadline: a wide deadline there
# keeps a healthy step on a busy machine from being taken for a hung rank.
DIE_TIMEOUT_S = 120


@pytest.mark.parametrize(("mode", "reason"), [("die", "rank is gone"), ("hang", "stopped answering")])
def test_a_rank_lost_mid_generation_fails_the_stream_and_ends_the_launch(model_dir, tmp_path, mode, reason):
    """Rank 1 killed (SIGKILL) or hung (SIGSTOP) while a completion streams: the client gets the
    reason as an error (at once, or at the deadline), rank 0's server shuts itself down (a failed
    engine exits 1, see ``serve_until_engine_ends``), and the supervisor, seeing rank 0 fail,
    kills rank 1 at once and exits 1 naming both ranks' ends; no rank is left."""
    import mlx.core as mx
    import openai
    import psutil

    if not mx.distributed.is_available():
        pytest.skip("mlx has no distributed backend")
    timeout_s = DIE_TIMEOUT_S if mode == "die" else HUNG_TIMEOUT_S
    proc, port, log = _start_two_ranks(model_dir, tmp_path, "--distributed-timeout", str(timeout_s))
    try:
        wait_for_health(proc, port, log, START_TIMEOUT, "the 2-rank server")
        ranks = _rank_pids(str(model_dir))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=2)  # compiles the first steps
        stream = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=1500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        chunks, error = 0, None
        try:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    os.kill(ranks[1], signal.SIGKILL if mode == "die" else signal.SIGSTOP)
                    lost_at = time.monotonic()
        except openai.APIError as exc:
            error = str(exc)
        assert chunks >= 3 and error is not None and reason in error, (chunks, error)
        noticed_s = time.monotonic() - lost_at
        assert noticed_s < (3 if mode == "die" else HUNG_TIMEOUT_S + 3), noticed_s

        # Rank 0 ends itself (no rank has exited, so the supervisor's grace is not running): ~1 s on
        # a quiet machine, ~20 s with a dozen other jobs on the 2 cores.
        _, alive = psutil.wait_procs([psutil.Process(ranks[0])], timeout=60)
        assert not alive, log.read_text()[-3000:]
        assert proc.wait(10) == 1, log.read_text()[-3000:]  # rank 0 failed: rank 1 killed at once, hung or not
        assert _rank_pids(str(model_dir)) == {}
        text = log.read_text()
        assert "rank 0 exited with status 1" in text and "rank 1 was killed by signal 9" in text
    finally:
        _kill_everything(proc, str(model_dir))


def test_models_that_cannot_split_are_refused_before_any_rank_starts(default_model_dir, capsys):
    """The default model has 3 KV heads: over 2 ranks it is refused by the supervisor itself."""
    assert cli.main(["serve", str(default_model_dir), "--tensor-parallel-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "tensor parallelism over 2 ranks needs heads that divide evenly" in err
    assert "started" not in err


def test_vision_language_models_are_refused(tiny_qwen2_vl_dir, capsys):
    assert cli.main(["serve", str(tiny_qwen2_vl_dir), "--tensor-parallel-size", "2"]) == 1
    assert "does not support vision-language models" in capsys.readouterr().err


def test_distributed_outside_a_launch_says_how_to_launch(tiny_model_dir, capsys, monkeypatch):
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["serve", str(tiny_model_dir), "--distributed"]) == 1
    err = capsys.readouterr().err
    assert "mlx.launch --hosts HOST1,HOST2 --backend ring -- vllm-mlx serve MODEL --distributed" in err
    assert "--tensor-parallel-size N" in err


def test_tensor_parallel_size_one_is_the_single_process_server():
    args = cli.build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "1"])
    assert args.tensor_parallel_size == 1 and not args.distributed
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "0"])
