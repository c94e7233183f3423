"""Vision-language models in the paged engine, on tiny random-weight VLMs (tests/tiny_vlm.py).

Oracles: the engine's greedy tokens equal mlx-vlm's own generation (Qwen2-VL with its
multi-axis rotary positions, Qwen2.5-VL, LLaVA); batched equals solo; MLLM cache on equals off;
prefix cache on equals off. Plus the cache's identity rules (same pixels by path, bytes or PIL
share an entry; one changed pixel does not; swapped images share no block past the first image),
eviction, snapshots, and bad images failing alone.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the `vlm` extra) is not installed")

from PIL import Image

from factories import png_bytes
from vllm_mlx import LLM, EngineCore, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def picture(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def run_prompts(engine: EngineCore, prompts: list[tuple[str, list]], params: SamplingParams = GREEDY) -> list:
    """Submit every (text, images) prompt, step to the end; final outputs in order."""
    ids = [engine.add_request(text, params, images=images) for text, images in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return [final[i] for i in ids]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def mlx_vlm_greedy(model_dir, text: str, images: list, max_tokens: int) -> list[int]:
    """mlx-vlm's own generation: the reference. It does not stop at an end-of-sequence token
    (as the engine with ``ignore_eos``): a random model writes one now and then."""
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate
    from tiny_vlm import drop_text_kwargs_for_images
    from tiny_vlm_deepseek import spatial_crops_in_bounds

    from vllm_mlx.models.portable_layers import make_portable

    model, processor = load(str(model_dir))
    make_portable(model)  # Muse Spark's Metal kernels on the CPU: as the engine's model (tested on their own)
    drop_text_kwargs_for_images(processor)  # LLaVA + transformers 5 (a no-op for the others)
    spatial_crops_in_bounds(model)  # DeepSeek-VL2 reads past its per-image rows (a no-op for the others)
    # Bunny's and Janus's processor is the tokenizer itself (mlx-vlm's prepare_inputs builds their prompts).
    getattr(processor, "tokenizer", processor).stopping_criteria = lambda token: False
    out = []
    for step in stream_generate(model, processor, text, image=images, max_tokens=max_tokens, temperature=0.0):
        out.append(step.token)
    return out[:max_tokens]


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_vl_dir):
    engine = EngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, block_size=4, force_model_takeover=True)
    yield engine
    engine.shutdown()


# -- engine == mlx-vlm ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_greedy_tokens_equal_mlx_vlm(family, tmp_path):
    import tiny_vlm

    model_dir = getattr(tiny_vlm, f"build_tiny_{family}")(tmp_path / family)
    image = picture(1, (100, 60))
    placeholder = "<image>\n" if family == "llava" else "<|vision_start|><|image_pad|><|vision_end|>"
    text = placeholder + "What is in the picture?"
    expected = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    engine = EngineCore(model=str(model_dir), num_kv_blocks=64, block_size=4, force_model_takeover=True)
    try:
        [out] = run_prompts(engine, [(text, [image])])
        # The engine adds the placeholder itself when the prompt has none.
        [bare] = run_prompts(engine, [("What is in the picture?", [image])])
    finally:
        engine.shutdown()
    assert out.outputs[0].token_ids == expected
    assert bare.outputs[0].token_ids == expected


def test_two_images_in_order_equal_mlx_vlm(tiny_qwen2_vl_dir, qwen):
    a, b = picture(2), picture(3, (100, 60))
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"First {pad} then {pad} compare."
    expected = mlx_vlm_greedy(tiny_qwen2_vl_dir, text, [a, b], max_tokens=8)
    swapped = mlx_vlm_greedy(tiny_qwen2_vl_dir, text, [b, a], max_tokens=8)
    assert tokens(run_prompts(qwen, [(text, [a, b]), (text, [b, a])])) == [expected, swapped]
    assert expected != swapped


# -- batching ----------------------------------------------------------------------------------


def test_batched_image_and_text_requests_equal_solo_runs(tiny_qwen2_vl_dir):
    prompts = [
        ("Describe the image.", [picture(4)]),
        ("Plain text, no image at all.", []),
        ("Two of them:", [picture(5, (100, 60)), picture(6)]),
        ("Another look.", [picture(7, (90, 90))]),
    ]
    # Small steps: prefill chunks end inside images; a small pool forces preemption.
    options = {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 12, "enable_prefix_caching": False}
    engine = EngineCore(model=str(tiny_qwen2_vl_dir), force_model_takeover=True, **options)
    try:
        solo = [tokens(run_prompts(engine, [p]))[0] for p in prompts]
        batched = tokens(run_prompts(engine, prompts))
        preemptions = engine.get_stats()["scheduler"]["preemptions"]
    finally:
        engine.shutdown()
    assert batched == solo
    assert preemptions > 0


# -- caches on == off --------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["enable_mllm_cache", "enable_prefix_caching"])
def test_greedy_output_is_the_same_with_the_cache_off(tiny_qwen2_vl_dir, option):
    image = picture(8)
    prompts = [("Describe it.", [image]), ("And now?", [image]), ("Describe it.", [image])]

    def outputs(enabled: bool):
        engine = EngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, block_size=4,
                            force_model_takeover=True, **{option: enabled})  # fmt: skip
        try:
            return [tokens(run_prompts(engine, [p]))[0] for p in prompts], engine.get_stats()["mllm"]
        finally:
            engine.shutdown()

    (on, on_stats), (off, off_stats) = outputs(True), outputs(False)
    assert on == off
    if option == "enable_mllm_cache":
        # The second prompt's text comes before the image, so no KV prefix covers the image:
        # only the MLLM cache can skip the encoder there. The third is a full prefix hit.
        assert on_stats["encoder_runs"] == 1 and on_stats["hits"] == 1
        assert off_stats["encoder_runs"] == 2 and not off_stats["enabled"]
    else:
        assert on_stats["encoder_runs"] == 1 and off_stats["encoder_runs"] == 1


# -- identity: content, not names --------------------------------------------------------------


def test_same_pixels_by_path_bytes_and_pil_share_one_entry(qwen, tmp_path):
    qwen.mllm_cache.clear()
    image = picture(9)
    path = tmp_path / "cat.png"
    image.save(path)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    # Different leading text each time: no KV prefix reaches the image.
    prompts = [(f"{n} Describe.", [source]) for n, source in
               enumerate([str(path), png_bytes(image), image, data_url])]  # fmt: skip
    before = qwen.mllm_cache.stats()
    outs = run_prompts(qwen, prompts)
    after = qwen.mllm_cache.stats()
    assert len(qwen.mllm_cache) == 1
    assert after.misses - before.misses == 1 and after.hits - before.hits == 3
    assert all(o.error is None for o in outs)

    changed = image.copy()
    changed.putpixel((10, 10), tuple(255 - c for c in image.getpixel((10, 10))))
    run_prompts(qwen, [("5 Describe.", [changed])])
    assert len(qwen.mllm_cache) == 2
    qwen.mllm_cache.check_invariants()


def test_cache_salt_keys_the_mllm_cache(qwen):
    """Tenants with different salts never share an encoder output; one salt shares as before."""
    qwen.mllm_cache.clear()
    image = picture(21)

    def encoder_runs_for(salt: str | None, n: int) -> int:
        before = qwen.runner.vision_encoder_runs
        ids = [qwen.add_request(f"{salt} {i} Describe.", GREEDY, images=[image], cache_salt=salt) for i in range(n)]
        final = {}
        while qwen.has_unfinished_requests():
            final.update({o.request_id: o for o in qwen.step() if o.finished})
        assert all(final[i].error is None for i in ids)
        return qwen.runner.vision_encoder_runs - before

    assert encoder_runs_for(None, 2) == 1
    assert encoder_runs_for("tenant-a", 2) == 1  # not the unsalted entry, but its own, shared
    assert encoder_runs_for("tenant-b", 1) == 1
    assert encoder_runs_for("tenant-a", 1) == 0
    assert len(qwen.mllm_cache) == 3


def test_swapped_images_share_no_block_past_the_first_image(qwen):
    a, b = picture(10), picture(11)
    system = "You are a careful observer of pictures. "  # several 4-token blocks before the images
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"{system}{pad}{pad}Which differs?"
    [first] = run_prompts(qwen, [(text, [a, b])])
    [same] = run_prompts(qwen, [(text, [a, b])])
    [swapped] = run_prompts(qwen, [(text, [b, a])])
    first_image_at = first.prompt_token_ids.index(qwen.vision.image_token_id)
    block = qwen.config.block_size
    assert same.num_cached_tokens >= len(same.prompt_token_ids) - block  # all but the last block
    assert swapped.num_cached_tokens == first_image_at // block * block  # the text blocks only
    assert swapped.outputs[0].token_ids != first.outputs[0].token_ids


# -- the MLLM cache: budget, stats, snapshot ---------------------------------------------------


def test_eviction_under_a_small_budget_and_stats_add_up(tiny_qwen2_vl_dir):
    # A 64x64 image = 4 features x 64 floats x 4 bytes = 1 KiB: the budget holds two.
    engine = EngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, block_size=4,
                        mllm_cache_memory=2048 + 512, force_model_takeover=True)  # fmt: skip
    try:
        images = [picture(20 + i) for i in range(3)]
        for n, image in enumerate([*images, images[2], images[0]]):
            run_prompts(engine, [(f"{n}:", [image])])
        stats = engine.mllm_cache.stats()
        engine.mllm_cache.check_invariants()
        assert stats.evictions >= 1 and stats.num_entries == 2 and stats.memory_used <= 2048 + 512
        assert stats.queries == stats.hits + stats.misses == 5
        assert stats.hits == 1  # image 2 again; image 0 had been evicted
        assert engine.runner.vision_encoder_runs == stats.misses == 4
        assert stats.tokens_saved == 4
    finally:
        engine.shutdown()


def test_snapshot_lists_mllm_entries_with_thumbnails(qwen):
    image = picture(30, (300, 200))
    run_prompts(qwen, [("Snapshot me.", [image])])
    snapshot = qwen.cache_snapshot()
    mllm = snapshot["mllm"]
    assert set(mllm) == {"entries", "stats"}
    entry = next(e for e in mllm["entries"] if (e["width"], e["height"]) == (300, 200))
    assert len(entry["hash"]) == 12 and entry["bytes"] > 0 and entry["num_tokens"] > 0
    assert entry["hits"] == 0 and entry["last_used"] > 0
    thumb = Image.open(io.BytesIO(entry["thumbnail_png"]))
    assert thumb.format == "PNG" and max(thumb.size) <= 96
    json.dumps({**mllm, "entries": [{k: v for k, v in e.items() if k != "thumbnail_png"} for e in mllm["entries"]]})
    assert mllm["stats"]["encoder_runs"] >= 1


def test_text_models_snapshot_an_empty_mllm_cache(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=16, force_model_takeover=True)
    try:
        mllm = llm.cache_snapshot()["mllm"]
        assert mllm["entries"] == [] and mllm["stats"]["enabled"] is False
        with pytest.raises(ValueError, match="text-only"):
            llm.generate({"prompt": "Hi", "multi_modal_data": {"image": picture(0)}})
    finally:
        llm.shutdown()


# -- bad input fails alone ---------------------------------------------------------------------


def test_a_bad_image_fails_its_request_alone(qwen, tmp_path):
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(png_bytes(picture(40))[:100])
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    good = ("Fine.", [picture(41)])
    free_before = qwen.kv_cache.stats().num_free_blocks
    outs = run_prompts(qwen, [good, ("Broken.", [str(truncated)]), ("Empty.", [str(empty)]),
                      ("Missing.", [str(tmp_path / "nope.png")]), ("Bad URL.", ["http://127.0.0.1:9/x.png"]), good])  # fmt: skip
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length"]
    assert outs[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    for out, name in zip(outs[1:5], ["truncated.png", "empty.png", "nope.png", "127.0.0.1"]):
        assert name in out.error
    assert qwen.kv_cache.stats().num_free_blocks == free_before  # nothing leaked


def test_placeholder_count_must_match_the_images(qwen):
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(ValueError, match="2 image placeholder"):
        qwen.add_request(f"{pad}{pad}One image only.", GREEDY, images=[picture(0)])


def test_the_generic_path_takes_deepstack_features_beside_the_embeddings(tmp_path):
    """Qwen3-VL through the generic adapter (not its family hook): its embeddings come with
    deepstack features (a list of rows at the image tokens) and the image-token mask, which the
    generic path now passes on (``vlm_generic.VISUAL_FEATURES``; Cohere Compass's oracle tests run
    it). Deepstack as whole-prompt arrays (Granite 4 Vision's) goes as per-token rows cut per call
    (tests/multimodal/test_vlm_families.py's granite4_vision tests)."""
    from mlx_vlm.utils import load_model, load_processor
    from tiny_vlm import build_tiny_qwen3_vl

    from vllm_mlx.multimodal.vlm_generic import GenericVisionModel

    model_dir = build_tiny_qwen3_vl(tmp_path / "qwen3_vl")
    config = json.loads((model_dir / "config.json").read_text())
    model, processor = load_model(model_dir), load_processor(model_dir, add_detokenizer=False)
    generic = GenericVisionModel(model, processor, config, model_dir)
    depth = len(config["vision_config"]["deepstack_visual_indexes"])
    assert (generic.deepstack_layers, generic.deepstack_width) == (depth, config["text_config"]["hidden_size"])


# -- front doors -------------------------------------------------------------------------------


def test_llm_chat_and_generate_take_images(tiny_qwen2_vl_dir, tmp_path):
    image = picture(50)
    path = tmp_path / "photo.png"
    image.save(path)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    llm = LLM(str(tiny_qwen2_vl_dir), num_kv_blocks=64, block_size=4, force_model_takeover=True)
    try:
        def chat(url):
            parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
            return [{"role": "user", "content": parts}]

        by_path, by_data = llm.chat([chat(str(path)), chat(data_url)], GREEDY)
        prompt = llm.chat_prompt(chat(str(path)))
        [generated] = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"],
                                    "multi_modal_data": {"image": image}}, GREEDY)  # fmt: skip
    finally:
        llm.shutdown()
    assert by_path.outputs[0].token_ids == by_data.outputs[0].token_ids == generated.outputs[0].token_ids
    assert by_path.prompt_token_ids == generated.prompt_token_ids


def test_cli_generate_with_an_image(tiny_qwen2_vl_dir, tmp_path, capsys):
    from vllm_mlx.entrypoints.cli import main

    path = tmp_path / "photo.png"
    picture(60).save(path)
    argv = ["generate", "--model", str(tiny_qwen2_vl_dir), "--image", str(path), "--max-tokens", "6", "What is it?"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip()
    llm = LLM(str(tiny_qwen2_vl_dir), force_model_takeover=True)
    try:
        parts = [{"type": "image_url", "image_url": {"url": str(path)}}, {"type": "text", "text": "What is it?"}]
        [expected] = llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=6, temperature=0))
    finally:
        llm.shutdown()
    assert printed == expected.outputs[0].text.strip()

    assert main([*argv[:3], "--image", str(tmp_path / "nope.png"), "--max-tokens", "2", "Hi"]) == 1
    assert "nope.png" in capsys.readouterr().err


def test_server_chat_with_image_parts(tiny_qwen2_vl_dir):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import httpx
    from live_server import LiveServer

    from vllm_mlx.engine.async_engine import AsyncEngineCore
    from vllm_mlx.entrypoints.openai.server import build_app

    image = picture(70)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    parts = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": parts}]
    llm = LLM(str(tiny_qwen2_vl_dir), force_model_takeover=True)
    try:
        [expected] = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0))
    finally:
        llm.shutdown()

    engine = AsyncEngineCore(model=str(tiny_qwen2_vl_dir), num_kv_blocks=64, force_model_takeover=True).start()
    server = LiveServer(build_app(engine, served_model_name="vlm"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="vlm", messages=messages, max_tokens=6, temperature=0)
        assert reply.choices[0].message.content == expected.outputs[0].text
        chunks = client.chat.completions.create(model="vlm", messages=messages, max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text

        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                            {"type": "text", "text": "What is it?"}]}]  # fmt: skip
        response = httpx.post(server.url + "/v1/chat/completions", json={"messages": bad, "max_tokens": 4}, timeout=30)
        assert response.status_code == 400
        assert "image" in response.json()["error"]["message"].lower()
        assert engine.get_stats()["kv_cache"]["num_free_blocks"] == 63  # all back (block 0 is reserved)
    finally:
        server.stop()
        engine.stop()


def test_notebook_image_cells_and_a_chat_that_keeps_its_image(tiny_qwen2_vl_dir):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    image = picture(80)
    turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]
    llm = LLM(str(tiny_qwen2_vl_dir), force_model_takeover=True)
    try:
        [expected] = llm.generate(llm.chat_prompt(turn), SamplingParams(max_tokens=6, temperature=0))
    finally:
        llm.shutdown()

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "vllm_mlx_jupyter")
    try:
        shell.run_line_magic("config", f"GenerateMagics.model = {str(tiny_qwen2_vl_dir)!r}")
        options = {"num_kv_blocks": 64, "block_size": 4, "force_model_takeover": True}
        shell.run_line_magic("config", f"GenerateMagics.engine_options = {options!r}")
        shell.user_ns["photo"] = image
        flags = "--chat look --max-tokens 6 --temperature 0 --wait"
        with capture_output():
            first = shell.run_cell_magic("generate", f"--image photo {flags}", "What is it?")
            second = shell.run_cell_magic("generate", flags, "And why?")
        assert first.text == expected.outputs[0].text
        # The second turn's prompt starts with the first (image included): served from the cache.
        assert second.output.num_cached_tokens >= len(first.output.prompt_token_ids) - 4
    finally:
        shell.run_line_magic("unload_ext", "vllm_mlx_jupyter")


def test_the_cache_inspector_shows_the_cached_image(qwen):
    pytest.importorskip("anywidget")
    from vllm_mlx_jupyter.views.inspector import CacheInspector

    run_prompts(qwen, [("Inspect me.", [picture(90, (120, 80))])])
    inspector = CacheInspector(qwen, interval=3600)  # refreshes once now; the engine is not shared
    try:
        entry = next(e for e in inspector.mllm if (e["width"], e["height"]) == (120, 80))
        thumbnail = Image.open(io.BytesIO(base64.b64decode(entry["thumbnail_base64"])))
        assert thumbnail.size == (96, 64) and len(entry["hash"]) == 12
    finally:
        inspector.close()
