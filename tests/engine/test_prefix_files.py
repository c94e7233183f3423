"""Prefix files (issue #29, snapshots): a prompt's KV blocks saved by one engine and loaded by a
new one give the same tokens as computing them cold, and hit like any cached prefix; a file that
is damaged, truncated, from another model or unwritable is refused whole, and nothing leaks.
Tiny random-weight llamas, real MLX."""

from __future__ import annotations

import os

import pytest
from tiny_model import build_tiny_llama

from vllm_mlx import LLM, SamplingParams
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.engine.prefix_file import PrefixFileError, read_prefix_file

PROMPT = [(7 * i) % 500 + 100 for i in range(70)]  # 4 full blocks of 16, and 6 tokens more
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine_for(model_dir, **options) -> EngineCore:
    return EngineCore(model=str(model_dir), num_kv_blocks=64, force_model_takeover=True, **options)


def run(engine: EngineCore, prompt: list[int], cache_salt: str | None = None):
    request_id = engine.add_request(prompt, GREEDY, cache_salt=cache_salt)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == request_id and o.finished), final)
    return final


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """A prefix file of PROMPT, and the output computed cold (no prefix cache)."""
    cold_engine = engine_for(tiny_model_dir, enable_prefix_caching=False)
    cold = run(cold_engine, PROMPT)
    cold_engine.shutdown()
    engine = engine_for(tiny_model_dir)
    run(engine, PROMPT)
    path = tmp_path_factory.mktemp("prefix") / "prompt.prefix"
    assert engine.save_prefix(PROMPT, path) == 64
    engine.shutdown()
    return path, cold


def test_a_loaded_prefix_gives_the_cold_output_and_skips_the_prefill(tiny_model_dir, saved):
    path, cold = saved
    assert read_prefix_file(path)[0].metadata()["version"] == "1"  # one block group, no state: what older readers read
    engine = engine_for(tiny_model_dir)
    try:
        assert engine.load_prefix(path) == 64
        assert engine.kv_cache.pool.num_cached_blocks(free_only=True) == 4  # cached, held by nobody
        assert sum(bool(b.get("from_disk")) for b in engine.cache_snapshot()["blocks"]) == 4  # marked so
        warm = run(engine, PROMPT)
        assert warm.num_cached_tokens == 64
        assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
        assert engine.load_prefix(path) == 64  # loading again: all cached already, nothing taken
        assert engine.kv_cache.pool.num_cached_blocks() == 4  # 78 tokens: still the prompt's 4 full blocks
        assert run(engine, PROMPT, cache_salt="tenant-b").num_cached_tokens == 0  # another salt: no hit
        assert engine.stats().kv_cache.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_a_salted_prefix_serves_only_that_salt(tiny_model_dir, saved):
    path, cold = saved
    engine = engine_for(tiny_model_dir)
    try:
        engine.load_prefix(path, cache_salt="tenant-a")
        assert run(engine, PROMPT).num_cached_tokens == 0
        warm = run(engine, PROMPT, cache_salt="tenant-a")
        assert warm.num_cached_tokens == 64 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    finally:
        engine.shutdown()


def damaged_copies(path, tmp_path) -> dict[str, object]:
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # inside the last array's bytes
    copies = {"flipped byte": bytes(flipped), "truncated": data[: len(data) // 2], "empty": b"", "not one": b"{}"}
    out = {}
    for name, content in copies.items():
        out[name] = tmp_path / name.replace(" ", "-")
        out[name].write_bytes(content)
    out["missing"] = tmp_path / "missing"
    return out


def test_a_damaged_file_is_refused_whole_and_the_engine_serves_on(tiny_model_dir, saved, tmp_path):
    path, cold = saved
    engine = engine_for(tiny_model_dir)
    try:
        for name, bad in damaged_copies(path, tmp_path).items():
            with pytest.raises(PrefixFileError):
                engine.load_prefix(bad)
            assert engine.kv_cache.pool.num_cached_blocks() == 0, name  # nothing of it entered
        assert engine.stats().kv_cache.num_used_blocks == 0
        served = run(engine, PROMPT)
        assert served.num_cached_tokens == 0 and served.outputs[0].token_ids == cold.outputs[0].token_ids
    finally:
        engine.shutdown()


def test_a_file_from_another_model_is_refused(tiny_model_dir, default_model_dir, saved, tmp_path):
    path, _ = saved
    other = engine_for(build_tiny_llama(tmp_path / "other", default_model_dir, seed=1))
    try:
        with pytest.raises(PrefixFileError, match="another model"):
            other.load_prefix(path)
        assert other.kv_cache.pool.num_cached_blocks() == 0
    finally:
        other.shutdown()


def test_saving_is_atomic_and_refuses_an_uncached_prompt(tiny_model_dir, saved, tmp_path):
    path, _ = saved
    engine = engine_for(tiny_model_dir)
    try:
        with pytest.raises(ValueError, match="generate from it first"):
            engine.save_prefix(PROMPT, tmp_path / "never")
        engine.load_prefix(path)
        target = tmp_path / "kept.prefix"
        target.write_bytes(b"the old file")
        in_the_way = tmp_path / "a-directory.prefix"  # the final rename fails: the data was written
        (in_the_way / "inside").mkdir(parents=True)
        with pytest.raises(OSError):
            engine.save_prefix(PROMPT, in_the_way)
        with pytest.raises(OSError):
            engine.save_prefix(PROMPT, tmp_path / "no-such-folder" / "x.prefix")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
        assert engine.save_prefix(PROMPT, target) == 64  # replaces the old file whole
        header, _ = read_prefix_file(target)
        assert header.token_ids == PROMPT[:64]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", ["hybrid", "sliding"])
def test_hybrid_and_sliding_window_models_resume_from_a_prefix_file(model, tiny_qwen3_5_dir, tiny_gemma3_dir, tmp_path):
    """Version 2 files: a hybrid model's file carries the recurrent state after its last block,
    a sliding-window model's the blocks its window group reaches there; loaded by a new engine,
    the prompt resumes from them with the output computed cold."""
    model_dir, options = (tiny_qwen3_5_dir, {}) if model == "hybrid" else (tiny_gemma3_dir, {"block_size": 4})
    cold_engine = engine_for(model_dir, enable_prefix_caching=False, **options)
    cold = run(cold_engine, PROMPT)
    cold_engine.shutdown()
    path = tmp_path / f"{model}.prefix"
    engine = engine_for(model_dir, **options)
    try:
        run(engine, PROMPT)
        saved = engine.save_prefix(PROMPT, path)
    finally:
        engine.shutdown()
    header, arrays = read_prefix_file(path)
    assert header.version == 2 and saved == len(header.token_ids) >= 48
    if model == "hybrid":
        assert header.has_state and header.groups == () and any(n.startswith("state.") for n in arrays)
    else:
        assert not header.has_state and header.groups == ((1, header.num_blocks - 2),)  # window 8: 2 blocks
    engine = engine_for(model_dir, **options)
    try:
        assert engine.load_prefix(path) == saved
        warm = run(engine, PROMPT)
        assert warm.num_cached_tokens == saved and warm.outputs[0].token_ids == cold.outputs[0].token_ids
        engine.kv_cache.check_invariants()
    finally:
        engine.shutdown()


def test_a_hybrid_model_without_checkpoints_says_prefix_files_resume_nothing(tiny_qwen3_5_dir, tmp_path):
    engine = engine_for(tiny_qwen3_5_dir, max_state_checkpoints=0)
    try:
        run(engine, PROMPT)
        with pytest.raises(ValueError, match="keeps no state checkpoints"):
            engine.save_prefix(PROMPT, tmp_path / "hybrid.prefix")
        with pytest.raises(ValueError, match="recurrent layers"):
            engine.kv_cache.reserve_import([])
        assert not (tmp_path / "hybrid.prefix").exists()
    finally:
        engine.shutdown()


def test_llm_saves_a_chat_and_a_new_llm_loads_it(tiny_model_dir, tmp_path):
    messages = [{"role": "system", "content": "You answer questions about lighthouses. " * 6}]
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, force_model_takeover=True)
    try:
        saved = llm.save_prefix(messages, tmp_path / "chat.prefix")  # computed first: not cached before
        assert saved >= 16 and saved % 16 == 0
        prompt = llm.apply_chat_template(messages + [{"role": "user", "content": "How tall?"}])
        cold = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    finally:
        llm.shutdown()
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, force_model_takeover=True)
    try:
        assert llm.load_prefix(tmp_path / "chat.prefix") == saved
        warm = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert warm.num_cached_tokens > 0 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_version_2_headers_that_disagree_with_their_arrays_are_refused(tmp_path):
    """Hostile or damaged version 2 files: block groups outside the chain, a state flag without
    state tensors, a tensor of a group the header does not name, a malformed groups list."""
    import mlx.core as mx

    from vllm_mlx.engine.prefix_file import PrefixHeader, checksum, write_prefix_file

    tokens = list(range(8))  # 2 blocks of 4
    kv = {"keys.0": mx.zeros((1, 8, 2)), "values.0": mx.zeros((1, 8, 2))}
    window = {"group1.keys.0": mx.zeros((1, 4, 2)), "group1.values.0": mx.zeros((1, 4, 2))}
    cases = {
        "outside": (kv | window, {"groups": ((1, 5),)}, "block groups"),
        "no-state": (kv, {"has_state": True}, "token slots"),
        "stray-group": (kv | {"group2.keys.0": mx.zeros((1, 4, 2))}, {"groups": ((1, 1),)}, "token slots"),
        "short-group": (kv | {"group1.keys.0": mx.zeros((1, 8, 2))}, {"groups": ((1, 1),)}, "token slots"),
    }
    for name, (arrays, fields, message) in cases.items():
        header = PrefixHeader("digest", "float32", 4, tokens, checksum(arrays), **fields)
        write_prefix_file(tmp_path / name, header, arrays)
        with pytest.raises(PrefixFileError, match=message):
            read_prefix_file(tmp_path / name)
    header = PrefixHeader("digest", "float32", 4, tokens, checksum(kv | window), ((1, 1),))
    metadata = header.metadata() | {"groups": '[["one", {}]]'}
    mx.save_safetensors(str(tmp_path / "malformed.safetensors"), kv | window, metadata=metadata)
    with pytest.raises(PrefixFileError, match="damaged prefix file header"):
        read_prefix_file(tmp_path / "malformed.safetensors")
    write_prefix_file(tmp_path / "sound", header, kv | window)
    assert read_prefix_file(tmp_path / "sound")[0].groups == ((1, 1),)  # the same arrays, told right


def rewritten(path, out, metadata=None, arrays=None, recompute_checksum=True):
    """A copy of the prefix file at ``path`` with some metadata fields or arrays replaced (the
    checksum recomputed: a file made to lie, not a damaged one)."""
    import mlx.core as mx

    from vllm_mlx.engine.prefix_file import checksum

    original, fields = mx.load(str(path), format="safetensors", return_metadata=True)
    arrays = {**original, **(arrays or {})}
    fields = {**fields, **(metadata or {})}
    if recompute_checksum:
        fields["checksum"] = checksum(arrays)
    mx.save_safetensors(str(out), arrays, metadata=fields)
    return out.with_suffix(".safetensors")


def test_files_that_lie_about_their_size_tokens_or_values_are_refused(tiny_model_dir, saved, tmp_path):
    """A header declaring 10 million tokens (its size alone is refused) or more blocks than the
    pool holds (refused before any array is made), a sparse file larger than the pool could use (refused before it is read), token ids that are
    negative, fractional or outside the vocabulary, KV that is NaN: each a PrefixFileError, and
    the engine serves on."""
    import json

    import mlx.core as mx

    path, cold = saved
    engine = engine_for(tiny_model_dir)
    tokens = json.loads(mx.load(str(path), format="safetensors", return_metadata=True)[1]["token_ids"])
    huge = 10_000_000
    nan_keys = {"keys.0": mx.full(mx.load(str(path), format="safetensors")["keys.0"].shape, float("nan"))}
    cases = {
        "tokens": (rewritten(path, tmp_path / "a", {"token_ids": json.dumps(list(range(huge))), "num_blocks": str(huge // 16)}), "at most"),
        "blocks": (rewritten(path, tmp_path / "f", {"token_ids": json.dumps(list(range(70 * 16))), "num_blocks": "70"}), "pool has"),
        "negative": (rewritten(path, tmp_path / "b", {"token_ids": json.dumps([-1, *tokens[1:]])}), "non-negative"),
        "fraction": (rewritten(path, tmp_path / "c", {"token_ids": json.dumps([1.5, *tokens[1:]])}), "non-negative integers"),
        "vocabulary": (rewritten(path, tmp_path / "d", {"token_ids": json.dumps([10**6, *tokens[1:]])}), "vocabulary"),
        "nan": (rewritten(path, tmp_path / "e", arrays=nan_keys), "not finite"),
    }  # fmt: skip
    sparse = tmp_path / "sparse"
    sparse.write_bytes(path.read_bytes())
    os.truncate(sparse, engine._prefix_transfer.max_file_bytes + 1)
    cases["sparse"] = (sparse, "at most")
    try:
        for name, (bad, message) in cases.items():
            with pytest.raises(PrefixFileError, match=message):
                engine.load_prefix(bad)
            assert engine.kv_cache.pool.num_cached_blocks() == 0, name
        assert run(engine, PROMPT).outputs[0].token_ids == cold.outputs[0].token_ids
    finally:
        engine.shutdown()
