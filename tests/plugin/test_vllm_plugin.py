"""The vLLM platform plugin: real vLLM (the pinned release) driving our MLXModelRunner.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its engine core, our worker and
MLX share the test's thread; ``vllm serve`` runs as a real subprocess. The oracle is our own
engine on the same model: greedy token ids must be identical, whatever vLLM's scheduler did
(chunked prefill, preemption and resume, prefix-cache hits, async scheduling on or off). The
worker's counters (``MLXWorker.stats``) prove each case really happened.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

# Before vLLM reads its environment (it caches it once an engine starts).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'vllm-mlx[vllm]'")

from live_server import free_port, wait_for_health  # noqa: E402

from vllm_mlx import EngineCore  # noqa: E402
from vllm_mlx import SamplingParams as OurParams  # noqa: E402

MAX_TOKENS = 24
PROMPT_LENGTHS = (5, 17, 40, 70, 33, 3)  # block size 16: one to five blocks
SMALL_KV = 16 << 20  # bytes; the tiny model needs 512 bytes per token
SERVE_PROMPT = "The quick brown fox"


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny llama as vLLM needs a model directory to look: its config names the
    architecture (vLLM picks generate vs pooling from it) and the dtype (MLX's safetensors
    header without metadata trips vLLM's dtype probe). mlx-lm's converted models have both."""
    out = tmp_path_factory.mktemp("tiny-llama-vllm")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, out / item.name)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in PROMPT_LENGTHS]


def our_greedy(model: Path | str, prompts: list, max_tokens: int, **options) -> list:
    """Our engine's greedy outputs (RequestOutput), in prompt order."""
    engine = EngineCore(model=str(model), force_model_takeover=True)
    try:
        params = OurParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[i] for i in ids]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def expected(vllm_model_dir, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in our_greedy(vllm_model_dir, prompts, MAX_TOKENS)]


def greedy() -> vllm.SamplingParams:
    return vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def worker_stats(llm) -> dict:
    return llm.collective_rpc(lambda worker: dict(vars(worker.stats)))[0]


def shut_down(llm) -> None:
    llm.llm_engine.engine_core.shutdown()  # frees the MLX model and KV pool now


# -- the plugin is selected -----------------------------------------------------------------------


def test_vllm_selects_the_mlx_platform():
    from importlib.metadata import entry_points

    from vllm.platforms import current_platform

    from vllm_mlx import MLXPlatform
    from vllm_mlx.plugin.platform import register

    (plugin,) = [ep for ep in entry_points(group="vllm.platform_plugins") if ep.name == "mlx"]
    assert plugin.value == "vllm_mlx.plugin.platform:register"
    assert register() == "vllm_mlx.plugin.platform.MLXPlatform"
    assert isinstance(current_platform, MLXPlatform)
    assert current_platform.is_out_of_tree()


def test_plugin_names_without_vllm_say_how_to_install():
    """Where torch/vllm are missing (simulated in a fresh interpreter), the names raise an
    ImportError that names the extra; ``import vllm_mlx`` itself stays light."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['vllm'] = None\n"
        "import vllm_mlx\n"
        "for name in ('MLXPlatform', 'MLXWorker'):\n"
        "    try:\n"
        "        getattr(vllm_mlx, name)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert all('pip install "vllm-mlx[vllm]"' in line for line in lines)


# -- vllm.LLM gives our engine's tokens ------------------------------------------------------------


def test_our_engine_matches_mlx_lm(vllm_model_dir, prompts, expected):
    """The oracle's own oracle: our engine equals mlx-lm's greedy generation."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(vllm_model_dir))
    tokens = [
        r.token
        for r in mlx_lm.stream_generate(
            model, tokenizer, prompts[3], max_tokens=MAX_TOKENS, sampler=make_sampler(0.0)
        )
    ]
    assert tokens == expected[3]


SCHEDULES = {
    # vLLM's defaults: async scheduling on, one prefill chunk per prompt.
    "defaults": dict(max_model_len=256),
    # 16-token steps chunk every prompt but the shortest; 11 usable blocks of 16 cannot hold
    # six growing requests, so vLLM preempts and later resumes some (with a new block table).
    "chunked-preempted-async": dict(max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=12),
    "chunked-preempted-sync": dict(
        max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=12, async_scheduling=False
    ),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_llm_generate_equals_our_engine(schedule, vllm_model_dir, prompts, expected):
    llm = vllm.LLM(model=str(vllm_model_dir), kv_cache_memory_bytes=SMALL_KV, seed=0, **SCHEDULES[schedule])
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == (schedule != "chunked-preempted-sync")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        # Two prompts again: vLLM's prefix cache serves their full blocks (a new request that
        # arrives with num_computed_tokens > 0). The tight pool may have evicted some of them.
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[2:4]], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected[2:4]
        hits = [o.num_cached_tokens > 0 for o in again]
        assert all(hits) if schedule == "defaults" else any(hits)
        stats = worker_stats(llm)
    finally:
        shut_down(llm)
    assert stats["prefix_hits"] >= sum(hits)
    if schedule != "defaults":
        assert stats["partial_prefills"] > 0, stats
        assert stats["resumed_requests"] > 0, stats


def test_logprobs_and_refused_requests(vllm_model_dir, prompts):
    from vllm_mlx.plugin.platform import UnsupportedVllmFeatureError

    (ours,) = our_greedy(vllm_model_dir, prompts[1:2], 4, logprobs=3)
    llm = vllm.LLM(model=str(vllm_model_dir), kv_cache_memory_bytes=SMALL_KV, max_model_len=128)
    try:
        with pytest.raises(UnsupportedVllmFeatureError, match="logit_bias"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], vllm.SamplingParams(logit_bias={5: 1.0}))
        # The engine keeps serving after the refusal; logprobs are our sampler's.
        params = vllm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
        (out,) = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    finally:
        shut_down(llm)
    completion = out.outputs[0]
    assert completion.token_ids == ours.outputs[0].token_ids
    for token_id, theirs, mine in zip(completion.token_ids, completion.logprobs, ours.outputs[0].logprobs):
        assert set(theirs) == set(mine)  # the top 3 (the greedy token among them)
        assert theirs[token_id].rank == 1
        assert {t: lp.logprob for t, lp in theirs.items()} == pytest.approx(mine, abs=1e-5)


def test_tensor_parallel_is_refused(vllm_model_dir):
    # Raised in the platform's config check; vLLM's pydantic config re-raises it as a ValueError.
    with pytest.raises(ValueError, match="does not support: tensor_parallel_size=2"):
        vllm.LLM(model=str(vllm_model_dir), tensor_parallel_size=2)


# -- vllm serve ---------------------------------------------------------------------------------


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the server's PID (it stops its engine-core child); SIGKILL the group if stuck."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def test_vllm_serve_answers_completions(vllm_model_dir, tmp_path):
    (ours,) = our_greedy(vllm_model_dir, [SERVE_PROMPT], 8)
    port = free_port()
    log = tmp_path / "serve.log"
    vllm_bin = Path(sys.executable).parent / "vllm"
    command = [
        str(vllm_bin), "serve", str(vllm_model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "256", "--kv-cache-memory-bytes", str(SMALL_KV),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_health(proc, port, log, timeout=240, what="vllm serve")
        body = {
            "model": str(vllm_model_dir), "prompt": SERVE_PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        reply = post_json(f"http://127.0.0.1:{port}/v1/completions", body)
    finally:
        returncode = stop(proc)
    choice = reply["choices"][0]
    assert choice["token_ids"] == ours.outputs[0].token_ids
    assert choice["text"] == ours.outputs[0].text
    assert returncode == 0, log.read_text()[-4000:]
    # Our worker runs in the engine-core process: nothing may fail there. (On SIGTERM, vLLM's API
    # server may log its own output handler losing the engine core it is stopping.)
    engine_errors = [line for line in log.read_text().splitlines() if "(EngineCore" in line and "ERROR" in line]
    assert not engine_errors, "\n".join(engine_errors)


# -- the default model ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_default_model_through_vllm(default_model_dir):
    """SmolLM2 converted from the GGUF (dequantized to float32 on the CPU) answers a chat prompt
    through vLLM exactly as through our engine (same tokens; the text is not asserted: its first
    answer token is a near tie, see DESIGN.md)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    (ours,) = our_greedy(default_model_dir, [prompt], 8)
    llm = vllm.LLM(model=str(default_model_dir), max_model_len=512, kv_cache_memory_bytes=64 << 20)
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        shut_down(llm)
    assert out.outputs[0].token_ids == ours.outputs[0].token_ids
