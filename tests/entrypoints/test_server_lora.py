"""The server with LoRA adapters (``--lora-modules``), through the official ``openai`` client on
127.0.0.1: a request's ``model`` picks an adapter, and its text is mlx-lm's for that adapter
alone; ``/v1/models`` lists the adapters with their base; an unknown name is a 404."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from live_server import LiveServer  # noqa: E402
from lora_adapters import write_mlx_lm_adapter  # noqa: E402
from oracles import mlx_lm_tokens  # noqa: E402

from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: E402
from vllm_mlx.entrypoints.openai.server import build_app  # noqa: E402
from vllm_mlx.lora import LoRARequest  # noqa: E402

PROMPT = "Tell me about lighthouses."


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    loras = [
        LoRARequest("first", 1, str(write_mlx_lm_adapter(tiny_model_dir, root / "first", rank=4, scale=2.0, seed=1))),
        LoRARequest("second", 2, str(write_mlx_lm_adapter(tiny_model_dir, root / "second", rank=8, scale=1.0, seed=2))),
    ]
    engine = AsyncEngineCore(model=str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                             num_kv_blocks=128, force_model_takeover=True).start()  # fmt: skip
    live = LiveServer(build_app(engine, served_model_name="tiny", lora_modules=loras))
    yield live, loras, engine
    live.stop()
    engine.stop()


def expected_text(model_dir, adapter_path) -> str:
    from vllm_mlx.models import load_model

    tokens = mlx_lm_tokens(model_dir, [PROMPT], 8, adapter_path=adapter_path)[0]
    return load_model(model_dir).tokenizer.decode(tokens)


def test_the_model_field_picks_the_adapter(served, tiny_model_dir):
    live, loras, _ = served
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    texts = {}
    for model in ("tiny", "first", "second"):
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        texts[model] = answer.choices[0].text
    assert texts["tiny"] == expected_text(tiny_model_dir, None)
    assert texts["first"] == expected_text(tiny_model_dir, loras[0].lora_path)
    assert texts["second"] == expected_text(tiny_model_dir, loras[1].lora_path)
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None


def test_models_lists_the_adapters_and_unknown_names_are_404(served):
    live, _, _ = served
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "first", "second"}
    assert cards["first"].parent == "tiny" and getattr(cards["tiny"], "parent", None) is None
    with pytest.raises(openai.NotFoundError, match="first"):
        client.completions.create(model="third", prompt=PROMPT, max_tokens=2)


def test_the_lora_modules_flag():
    from vllm_mlx.entrypoints.cli import build_parser
    from vllm_mlx.entrypoints.openai.cli_args import lora_requests, serve_engine_options

    args = build_parser().parse_args(["serve", "default", "--lora-modules", "sql=/a/sql", "chat=/a/chat"])
    assert serve_engine_options(args)["enable_lora"] is True
    assert lora_requests(args) == [LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "default", "--lora-modules", "no-path"])
    twice = build_parser().parse_args(["serve", "default", "--lora-modules", "a=/x", "a=/y"])
    with pytest.raises(SystemExit, match="twice"):
        lora_requests(twice)
    assert "enable_lora" not in serve_engine_options(build_parser().parse_args(["serve", "default"]))


def test_lora_modules_keep_the_default_slots_and_add_what_more_adapters_need():
    """Two adapters named at start leave the default four slots (runtime loads share them);
    more adapters than ``--max-loras`` get a slot each."""
    from vllm_mlx.config import EngineConfig
    from vllm_mlx.entrypoints.cli import build_parser, engine_options
    from vllm_mlx.entrypoints.openai.cli_args import serve_engine_options, with_adapter_slots

    def slots(*flags: str) -> int | None:
        args = build_parser().parse_args(["serve", "default", *flags])
        options = {**engine_options(args), **serve_engine_options(args)}
        return with_adapter_slots(options, len(args.lora_modules or [])).get("max_loras")

    assert slots("--lora-modules", "a=/x", "b=/y") == EngineConfig.max_loras == 4
    assert slots("--lora-modules", "a=/x", "b=/y", "--max-loras", "1") == 2
    assert slots("--lora-modules", *(f"m{i}=/p{i}" for i in range(6))) == 6
    assert slots("--max-loras", "3") == 3 and slots() == 4  # no modules: the flags as given


def test_an_adapter_that_does_not_fit_stops_the_server_at_start(tiny_model_dir, tmp_path, capsys):
    import shutil

    from vllm_mlx.entrypoints.cli import build_parser, run_serve

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")  # its own path: no other engine owns it
    args = build_parser().parse_args(["serve", str(model), "--num-kv-blocks", "32", "--lora-modules", f"broken={tmp_path}"])
    assert run_serve(args) == 2
    assert "--lora-modules broken" in capsys.readouterr().err


def test_adapters_load_and_unload_at_runtime_inside_the_allowed_folder(tiny_model_dir, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: off by default (404); with a
    folder, adapters inside it load (and then serve), anything outside is 403, a broken one 400."""
    httpx = pytest.importorskip("httpx")
    allowed = tmp_path / "allowed"
    inside = write_mlx_lm_adapter(tiny_model_dir, allowed / "fresh", rank=4, scale=2.0, seed=5)
    outside = write_mlx_lm_adapter(tiny_model_dir, tmp_path / "elsewhere", rank=4, scale=2.0, seed=6)
    (allowed / "broken").mkdir()
    engine = AsyncEngineCore(model=str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                             num_kv_blocks=64, force_model_takeover=True).start()  # fmt: skip
    off = LiveServer(build_app(engine, served_model_name="tiny"))
    try:
        response = httpx.post(off.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(inside)})
        assert response.status_code == 404 and "--enable-lora-loading" in response.text
    finally:
        off.stop()
    live = LiveServer(build_app(engine, served_model_name="tiny", lora_loading_dir=allowed))
    try:
        def load(name, path):
            return httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

        assert load("fresh", inside).status_code == 200
        assert load("fresh", inside).status_code == 400  # already loaded
        assert load("far", outside).status_code == 403
        assert load("sneaky", allowed / ".." / "elsewhere").status_code == 403  # resolved before the check
        assert load("broken", allowed / "broken").status_code == 400
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        assert "fresh" in {m.id for m in client.models.list().data}
        answer = client.completions.create(model="fresh", prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        assert answer.choices[0].text == expected_text(tiny_model_dir, inside)
        unload = httpx.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh"})
        assert unload.status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="fresh", prompt=PROMPT, max_tokens=2)
        assert httpx.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh"}).status_code == 404
    finally:
        live.stop()
        engine.stop()


def test_runtime_loading_keeps_the_operators_names_and_refuses_what_would_hang_or_lie(tiny_model_dir, tmp_path):
    """The base model's name, ``default`` and the ``--lora-modules`` names can be neither loaded
    over nor unloaded (403); names that are not plain text are 400; a FIFO in an adapter folder is
    400 at once (the engine keeps serving: no read waits on it); of two loads of one name at
    once, one wins; a response names the adapter that answered; an unloaded adapter's memory is
    given back by the engine."""
    import concurrent.futures
    import os

    httpx = pytest.importorskip("httpx")
    allowed = tmp_path / "allowed"
    fixed = LoRARequest("fixed", 1, str(write_mlx_lm_adapter(tiny_model_dir, tmp_path / "fixed", rank=4, scale=2.0, seed=1)))
    fresh = write_mlx_lm_adapter(tiny_model_dir, allowed / "fresh", rank=4, scale=2.0, seed=5)
    stalled = allowed / "stalled"
    stalled.mkdir()
    (stalled / "adapter_config.json").write_text((fresh / "adapter_config.json").read_text())
    os.mkfifo(stalled / "adapters.safetensors")
    engine = AsyncEngineCore(model=str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                             num_kv_blocks=64, force_model_takeover=True).start()  # fmt: skip
    engine.register_lora(fixed)
    live = LiveServer(build_app(engine, served_model_name="tiny", lora_modules=[fixed], lora_loading_dir=allowed))
    try:
        def load(name, path=fresh):
            return httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                              timeout=60)  # fmt: skip

        def unload(name):
            return httpx.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)

        for name in ("tiny", "default", "fixed"):
            assert load(name).status_code == 403 and unload(name).status_code == 403
        for name in ("a\0b", "../up", "x/./y", " padded", "tab\there", "x" * 300):
            assert load(name).status_code == 400, name
        refused = load("stalled", stalled)
        assert refused.status_code == 400 and "not a regular file" in refused.text
        assert httpx.get(live.url + "/health").status_code == 200
        assert httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "nul", "lora_path": "a\0b"}).status_code == 400
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            codes = sorted(r.status_code for r in pool.map(lambda _: load("twice"), range(2)))
        assert codes == [200, 400]
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        answer = client.completions.create(model="twice", prompt=PROMPT, max_tokens=4)
        assert answer.model == "twice"
        chat = client.chat.completions.create(model="fixed", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.model == "fixed"
        assert client.completions.create(model="default", prompt=PROMPT, max_tokens=2).model == "tiny"
        assert unload("twice").status_code == 200
        known = engine.call(lambda core: set(core.lora.known))
        assert known == {fixed.lora_int_id}  # the unloaded adapter's factors are gone
    finally:
        live.stop()
        engine.stop()
