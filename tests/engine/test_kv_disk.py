"""The KV disk tier, on real MLX and a real folder: output with prompt blocks served from disk is
token for token the output computed cold, in a later engine (as after a restart), and every
fault (damaged files, a folder that is gone or cannot be made, a full or read-only disk, two
processes sharing a folder) leaves serving going on, without a block served wrongly.

Engines here are built on the tiny llama with a 16-token block size; one engine per model and
process, so each test's engines run one after the other (the second is the "restarted" one).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest
from tiny_model import build_tiny_llama

from vllm_mlx import SamplingParams
from vllm_mlx.engine import kv_disk
from vllm_mlx.engine.observation import EngineStats

PROMPT = "The lighthouse on Gull Point was built in 1871 from granite quarried on the island. " * 6
OTHER = "Margaret Hale rowed to the mainland for oil and glass, and the lamp was burning again. " * 5
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def disk(tmp_path):
    return tmp_path / "kv-disk"


@pytest.fixture
def engines(engine_factory):
    """``make(model_dir=None, **options)``: an engine on the tiny llama with a 128-block pool
    (taking the model over from the test's previous engine)."""

    def make(model_dir=None, **options):
        return engine_factory(model_dir, **{"num_kv_blocks": 128, "force_model_takeover": True, **options})

    return make


def run(engine, prompts, params=GREEDY, **request_options) -> list:
    ids = [engine.add_request(p, params, **request_options) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return [final[i] for i in ids]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def served(engine, prompts, **request_options) -> tuple[list, kv_disk.DiskTierStats]:
    """Outputs of ``prompts`` and the tier's stats; the engine is shut down (its writes flushed)."""
    outputs = run(engine, prompts, **request_options)
    engine.shutdown()
    return outputs, engine.disk.tier.stats()


def test_blocks_from_disk_give_the_cold_output_in_a_later_engine(engines, disk):
    cold = tokens(run(engines(), [PROMPT, OTHER]))
    first, wrote = served(engines(kv_disk_path=str(disk)), [PROMPT, OTHER])
    assert tokens(first) == cold and wrote.blocks_written > 0 and wrote.blocks_read == 0
    again, read = served(engines(kv_disk_path=str(disk)), [PROMPT, OTHER])
    assert tokens(again) == cold
    assert read.blocks_read == wrote.blocks_written and read.blocks_written == 0  # nothing written twice
    assert all(o.num_cached_tokens >= 96 for o in again)  # the prompts' full blocks, from disk
    assert [o.metrics.num_disk_tokens for o in again] == [o.num_cached_tokens for o in again]
    assert all(o.metrics.num_disk_tokens == 0 for o in first)


def test_sliding_window_groups_come_back_from_disk(engines, disk, tiny_gemma3_dir):
    """Every group's blocks of a prompt go to disk; a later engine resumes from them (group 0's
    chain and the window group's last blocks), the whole prompt and a prompt that leaves it half
    way (a hit point whose window blocks had left the window when they were written), each with
    the output computed cold."""
    branch = PROMPT[: len(PROMPT) // 2] + "Nobody has kept the light since the storm of 1911."
    options = {"block_size": 4, "max_num_batched_tokens": 32}
    cold = tokens(run(engines(tiny_gemma3_dir, **options), [PROMPT, OTHER, branch]))
    writer = engines(tiny_gemma3_dir, kv_disk_path=str(disk), **options)
    assert writer.kv_cache.group_windows == (None, 8)  # two block groups: the case under test
    first, wrote = served(writer, [PROMPT, OTHER])
    assert tokens(first) == cold[:2] and wrote.blocks_written > 0
    again, read = served(engines(tiny_gemma3_dir, kv_disk_path=str(disk), **options), [PROMPT, OTHER, branch])
    assert tokens(again) == cold
    full_blocks = [(len(o.prompt_token_ids) - 1) // 4 for o in again]
    assert [o.num_cached_tokens for o in again[:2]] == [4 * n for n in full_blocks[:2]]  # the whole prompts
    assert again[2].num_cached_tokens >= 4 * (len(writer.tokenizer.encode(PROMPT[: len(PROMPT) // 2])) // 4 - 1)
    assert [o.metrics.num_disk_tokens for o in again[:2]] == [o.num_cached_tokens for o in again[:2]]
    # The branch's chain was in memory already (the first prompt's, read back): only the window's
    # blocks at its hit point came from disk, and without them it would have had no hit at all.
    assert again[2].metrics.num_disk_tokens == 0
    assert read.blocks_read > sum(o.num_cached_tokens for o in again[:2]) // 4  # the window group's blocks too


def test_a_hybrid_models_state_checkpoints_come_back_from_disk(engines, disk, tiny_qwen3_5_dir):
    """Qwen3.5 (delta-net and attention layers): a hit point needs the recurrent state after its
    last block, so the checkpoints kept at the prompts' boundaries are written beside their
    blocks, and a later engine resumes each prompt from its blocks and checkpoint read back,
    with the output computed cold; a prompt that leaves one half way has no checkpoint there
    and is computed."""
    branch = PROMPT[: len(PROMPT) // 2] + "Nobody has kept the light since the storm of 1911."
    cold = tokens(run(engines(tiny_qwen3_5_dir), [PROMPT, OTHER, branch]))
    first, wrote = served(engines(tiny_qwen3_5_dir, kv_disk_path=str(disk)), [PROMPT, OTHER])
    assert tokens(first) == cold[:2]
    engine = engines(tiny_qwen3_5_dir, kv_disk_path=str(disk))
    again, read = served(engine, [PROMPT, OTHER, branch])
    assert tokens(again) == cold
    full_blocks = [(len(o.prompt_token_ids) - 1) // 16 for o in again]
    assert [o.num_cached_tokens for o in again[:2]] == [16 * n for n in full_blocks[:2]]
    assert [o.metrics.num_disk_tokens for o in again[:2]] == [o.num_cached_tokens for o in again[:2]]
    assert read.blocks_read == sum(full_blocks[:2]) + 2  # each prompt's blocks and one state
    assert wrote.blocks_written >= read.blocks_read
    engine.kv_cache.check_invariants()


def test_a_hybrid_model_without_checkpoints_starts_without_the_tier(engines, disk, tiny_qwen3_5_dir, caplog):
    engine = engines(tiny_qwen3_5_dir, kv_disk_path=str(disk), max_state_checkpoints=0)
    assert engine.disk is None and "KV disk tier is off" in caplog.text and "state checkpoints" in caplog.text
    assert len(run(engine, [PROMPT])[0].outputs[0].token_ids) == GREEDY.max_tokens  # serving goes on
    assert not disk.exists()


def test_a_waiting_requests_view_says_what_came_from_disk(engines, disk):
    """The inspector's source: a request's view counts its prompt tokens read from disk."""
    served(engines(kv_disk_path=str(disk)), [PROMPT])
    engine = engines(kv_disk_path=str(disk), max_num_batched_tokens=16)
    request_id = engine.add_request(PROMPT, GREEDY)
    engine.step()
    view = engine.snapshot(include_blocks=False).requests[request_id]
    assert view.num_disk_tokens == view.num_cached_tokens >= 96
    assert view.to_dict()["num_disk_tokens"] == view.num_disk_tokens
    blocks = engine.cache_snapshot()["blocks"]  # the grid marks the blocks read back (until evicted)
    from_disk = [b["id"] for b in blocks if b.get("from_disk")]
    assert len(from_disk) * engine.config.block_size == view.num_disk_tokens
    assert set(from_disk) <= set(engine.snapshot().requests[request_id].block_ids)
    run(engine, [])


def test_a_prompt_extending_a_saved_one_hits_its_blocks_and_chunked_prefill_agrees(engines, disk):
    served(engines(kv_disk_path=str(disk)), [PROMPT])
    longer = PROMPT + "Today the tower is a museum, and visitors can climb its steps."
    cold = tokens(run(engines(max_num_batched_tokens=32), [longer]))
    outputs, stats = served(engines(kv_disk_path=str(disk), max_num_batched_tokens=32), [longer])
    assert tokens(outputs) == cold and stats.blocks_read > 0 and outputs[0].num_cached_tokens >= 96


def test_salts_and_models_never_share_blocks(engines, disk, default_model_dir, tmp_path):
    served(engines(kv_disk_path=str(disk)), [PROMPT], cache_salt="tenant-a")
    outputs, stats = served(engines(kv_disk_path=str(disk)), [PROMPT], cache_salt="tenant-b")
    assert stats.blocks_read == 0 and outputs[0].num_cached_tokens == 0
    other_model = build_tiny_llama(tmp_path / "other", default_model_dir, seed=7)
    outputs, stats = served(engines(other_model, kv_disk_path=str(disk)), [PROMPT], cache_salt="tenant-a")
    assert stats.blocks_read == 0 and outputs[0].num_cached_tokens == 0  # another model: another folder
    outputs, stats = served(engines(kv_disk_path=str(disk)), [PROMPT], cache_salt="tenant-a")
    assert stats.blocks_read > 0


def block_files(disk) -> list:
    return sorted(disk.glob("*/*.safetensors"))


def forge(target) -> None:
    """Zero one KV array of a block file and recompute its SHA-256, as whoever can write the
    folder (but not read its key) could: only the MAC still tells."""
    from safetensors import safe_open
    from safetensors.numpy import load, save_file

    with safe_open(str(target), framework="np") as file:
        metadata = file.metadata()
    arrays = {name: array.copy() for name, array in load(target.read_bytes()).items()}
    arrays[sorted(arrays)[0]][...] = 0
    metadata["checksum"] = kv_disk.BlockBytes(b"", (), arrays, json.loads(metadata["dtypes"])).checksum()
    save_file(arrays, str(target), metadata=metadata)


def declare_huge(target) -> None:
    """A header declaring a 4 GiB array, in a sparse file of that size (nothing on disk)."""
    header = json.dumps({"keys.0": {"dtype": "U8", "shape": [1 << 32], "data_offsets": [0, 1 << 32]}}).encode()
    with open(target, "wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + (1 << 32))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty", "swapped", "forged", "huge"])
def test_damaged_files_are_never_served(engines, disk, damage):
    cold = tokens(run(engines(), [PROMPT]))
    served(engines(kv_disk_path=str(disk)), [PROMPT, OTHER])
    files = block_files(disk)
    target = files[2]
    data = target.read_bytes()
    if damage == "flipped":
        target.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
    elif damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "swapped":  # another block's file under this name: its key and tokens say so
        target.write_bytes(files[3].read_bytes())
    elif damage == "forged":
        forge(target)
    else:
        declare_huge(target)
    outputs, stats = served(engines(kv_disk_path=str(disk)), [PROMPT, OTHER])
    assert tokens(outputs)[0] == cold[0]
    assert stats.blocks_rejected == 1 and stats.blocks_written >= 1  # deleted, computed and written again
    _, again = served(engines(kv_disk_path=str(disk)), [PROMPT, OTHER])
    assert again.blocks_rejected == 0 and again.blocks_read == len(files)


def test_a_folder_that_cannot_be_made_turns_the_tier_off(engines, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    engine = engines(kv_disk_path=str(blocker / "kv"))
    outputs, stats = served(engine, [PROMPT])
    assert not stats.enabled and "cannot use" in stats.disabled_reason
    assert len(outputs[0].outputs[0].token_ids) == 8
    assert "KV disk tier is off" in caplog.text


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failed_write_pauses_writing_then_writing_resumes(engines, disk, monkeypatch, code):
    """A full or read-only disk: the write fails, writing pauses (the tier stays on, serving
    goes on); once the pause is over and the disk has room, blocks are written again."""
    cold = tokens(run(engines(), [PROMPT, OTHER]))
    engine = engines(kv_disk_path=str(disk))
    tier, real_write = engine.disk.tier, kv_disk.write_atomically

    def failing(path, write, suffix=""):
        raise OSError(code, "injected", str(path))

    monkeypatch.setattr(kv_disk, "write_atomically", failing)  # fault injection: every write fails
    assert tokens(run(engine, [PROMPT])) == cold[:1]
    assert tier.flush(timeout=60)
    stats = tier.stats()
    assert stats.enabled and stats.write_errors >= 1 and stats.blocks_written == 0
    monkeypatch.setattr(kv_disk, "write_atomically", real_write)  # room again
    monkeypatch.setattr(tier, "_clock", lambda: time.monotonic() + kv_disk.MAX_WRITE_RETRY_S)  # the pause is over
    outputs, stats = served(engine, [OTHER])
    assert tokens(outputs) == cold[1:] and stats.enabled and stats.blocks_written > 0


def test_a_directory_planted_under_a_blocks_name_fails_that_block_alone(engines, disk):
    cold = tokens(run(engines(), [PROMPT, OTHER]))
    served(engines(kv_disk_path=str(disk)), [PROMPT])
    target = block_files(disk)[-1]
    target.unlink()
    target.mkdir()
    outputs, stats = served(engines(kv_disk_path=str(disk)), [PROMPT, OTHER])
    assert tokens(outputs) == cold and stats.enabled and stats.write_errors >= 1 and target.is_dir()


def test_a_key_or_folder_that_others_may_write_turns_the_tier_off(engines, disk):
    """The MAC's key is private to its owner (0600); a key others may read, or a folder others
    may write, is refused with the fix, and serving goes on."""
    served(engines(kv_disk_path=str(disk)), [PROMPT])
    key = disk / kv_disk.KEY_FILE
    assert key.stat().st_mode & 0o777 == 0o600 and disk.stat().st_mode & 0o077 == 0
    key.chmod(0o644)
    outputs, stats = served(engines(kv_disk_path=str(disk)), [PROMPT])
    assert not stats.enabled and "chmod 600" in stats.disabled_reason and len(outputs[0].outputs[0].token_ids) == 8
    key.chmod(0o600)
    disk.chmod(0o777)
    _, stats = served(engines(kv_disk_path=str(disk)), [PROMPT])
    assert not stats.enabled and "writable by other users" in stats.disabled_reason
    disk.chmod(0o700)
    if os.geteuid() == 0:  # root can hand the key to another user
        os.chown(key, 12345, -1)
        _, stats = served(engines(kv_disk_path=str(disk)), [PROMPT])
        assert not stats.enabled and "another user" in stats.disabled_reason


def test_a_folder_removed_while_serving_turns_the_tier_off(engines, disk):
    import shutil

    engine = engines(kv_disk_path=str(disk))
    shutil.rmtree(disk)
    outputs, stats = served(engine, [PROMPT])
    assert len(outputs[0].outputs[0].token_ids) == 8 and not stats.enabled


def test_the_size_budget_keeps_the_folder_small(engines, disk):
    _, first = served(engines(kv_disk_path=str(disk)), [PROMPT])
    per_block = first.bytes_written // first.blocks_written
    _, stats = served(engines(kv_disk_path=str(disk), kv_disk_budget=3 * per_block), [OTHER, PROMPT + " More."])
    on_disk = sum(f.stat().st_size for f in block_files(disk))
    assert on_disk <= 3 * per_block and stats.files_evicted > 0 and stats.bytes_on_disk == on_disk


def test_the_write_budget_holds(engines, disk):
    _, first = served(engines(kv_disk_path=str(disk) + "-probe"), [PROMPT])
    per_block = first.bytes_written // first.blocks_written
    _, stats = served(engines(kv_disk_path=str(disk), kv_disk_write_budget=2 * per_block + 10), [PROMPT, OTHER])
    assert stats.blocks_written == 2 and stats.writes_skipped > 0
    assert len(block_files(disk)) == 2


def test_the_stats_travel_as_plain_data(engines, disk):
    engine = engines(kv_disk_path=str(disk))
    run(engine, [PROMPT])
    stats = engine.stats()
    assert stats.kv_disk is not None and stats.kv_disk.enabled
    assert EngineStats.from_dict(stats.to_dict()) == stats
    assert "kv_disk" not in engines().stats().to_dict()  # no tier: no key


TWO_WRITERS = """
import sys
from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore
model, disk, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
engine = EngineCore(model=model, num_kv_blocks=128, kv_disk_path=disk)
for i in range(3):
    request = engine.add_request(prompt + " " * i, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
engine.shutdown()
print(engine.disk.tier.stats().blocks_written)
"""


def test_two_processes_share_a_folder(engines, disk, tiny_model_dir):
    """Two engines writing the same prompts into one folder at once: every file is whole, and a
    third engine reads them all."""
    script = textwrap.dedent(TWO_WRITERS)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tiny_model_dir), str(disk), text],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for text in (PROMPT, PROMPT)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    cold = tokens(run(engines(), [PROMPT]))
    outputs, stats = served(engines(kv_disk_path=str(disk)), [PROMPT])
    assert tokens(outputs) == cold and stats.blocks_read >= 6 and stats.blocks_rejected == 0


@pytest.mark.parametrize("disclosed", [False, True])
def test_the_server_shows_the_tier_without_telling_of_other_prompts(tiny_model_dir, disk, disclosed):
    """``/v1/cache/stats`` and ``/metrics``: the tier's budgets always; its counters (which move
    with hits) only where the operator discloses hits; never its folder."""
    httpx = pytest.importorskip("httpx")
    from live_server import LiveServer

    from vllm_mlx.config import ServingOptions
    from vllm_mlx.engine.async_engine import AsyncEngineCore
    from vllm_mlx.entrypoints.openai.server import build_app

    engine = AsyncEngineCore(model=str(tiny_model_dir), num_kv_blocks=128, kv_disk_path=str(disk),
                             force_model_takeover=True).start()  # fmt: skip
    options = ServingOptions(enable_cache_stats_disclosure=disclosed)
    live = LiveServer(build_app(engine, served_model_name="tiny", options=options))
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 200
        stats = httpx.get(live.url + "/v1/cache/stats", timeout=30).json()["kv_disk"]
        metrics = httpx.get(live.url + "/metrics", timeout=30).text
    finally:
        live.stop()
        engine.stop()
    assert stats["enabled"] is True and stats["budget_bytes"] == 8 << 30 and "path" not in stats
    assert ("blocks_written" in stats) == disclosed and ("vllm:kv_disk_blocks_written" in metrics) == disclosed
    assert "vllm:kv_disk_enabled" in metrics and str(disk) not in metrics


def test_a_fault_in_the_tier_itself_never_fails_a_step(engines, disk, caplog):
    cold = tokens(run(engines(), [PROMPT]))
    served(engines(kv_disk_path=str(disk)), [PROMPT])
    engine = engines(kv_disk_path=str(disk))

    def broken(block_ids, arrays):
        raise RuntimeError("injected pool fault")

    engine.runner.pool.write_blocks = broken  # fault injection: importing blocks read from disk fails
    outputs, stats = served(engine, [PROMPT])
    assert tokens(outputs) == cold and outputs[0].num_cached_tokens == 0
    assert not stats.enabled and "injected pool fault" in stats.disabled_reason
    engine.kv_cache.check_invariants()  # the blocks reserved for the import went back
    assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_usable_blocks


def test_image_prompts_take_part_and_their_images_key_the_blocks(tiny_qwen2_vl_dir, disk):
    """A prompt with an image: its blocks from disk give the cold output (the encoder does not
    run: the hit covers the image); the same text with another image hits nothing past it."""
    pytest.importorskip("mlx_vlm")
    import numpy as np
    from PIL import Image

    from vllm_mlx.engine.core import EngineCore

    def picture(seed: int):
        return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (64, 64, 3), dtype=np.uint8))

    text = "Describe the picture in detail, then say what it reminds you of. " * 3

    def run_vlm(image, **options):
        engine = EngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, block_size=4, force_model_takeover=True,
                            **options)  # fmt: skip
        try:
            request = engine.add_request(text, GREEDY, images=[image])
            final = {}
            while engine.has_unfinished_requests():
                final.update((o.request_id, o) for o in engine.step() if o.finished)
            disk_stats = engine.disk.tier.stats() if engine.disk is not None else None
            return final[request], engine.get_stats()["mllm"]["encoder_runs"], disk_stats
        finally:
            engine.shutdown()

    cold, _, _ = run_vlm(picture(1))
    first, _, wrote = run_vlm(picture(1), kv_disk_path=str(disk))
    again, encoder_runs, read = run_vlm(picture(1), kv_disk_path=str(disk))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == cold.outputs[0].token_ids
    assert wrote.blocks_written > 0 and read.blocks_read > 0 and again.num_cached_tokens > 8
    assert encoder_runs == 0
    other, _, _ = run_vlm(picture(2), kv_disk_path=str(disk))
    assert other.num_cached_tokens < 8  # at most the blocks before the image (the image comes first)


def test_a_queued_requests_read_goes_on_beside_the_batch(engines, disk):
    """With the batch full, a queued request's blocks are read while the running one decodes,
    and imported before it is admitted: it still starts from disk."""
    served(engines(kv_disk_path=str(disk)), [PROMPT])
    engine = engines(kv_disk_path=str(disk), max_num_seqs=1)
    long_one = engine.add_request(OTHER, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    queued = engine.add_request(PROMPT, GREEDY)
    engine.step()  # the first is admitted; the second waits, its read started
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert final[queued].metrics.num_disk_tokens >= 96 and final[long_one].metrics.num_disk_tokens == 0
