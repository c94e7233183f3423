"""``trust_remote_code`` (issue 13 item 6): a model directory that names Python code to run is
refused unless trusted, before any of its code can run; hub downloads skip ``*.py`` otherwise.

The directories are the tiny random-weight models (tests/tiny_vlm.py, tests/tiny_model.py) with a
``custom.py`` that writes a marker file when imported, named by ``model_file`` or ``auto_map``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_mlx.models.hub import allow_patterns
from vllm_mlx.models.trust import check_model_code, named_code
from vllm_mlx.platform.errors import ModelSourceError

REFUSED = r"names Python code to run .*trust_remote_code=True \(CLI: --trust-remote-code\)"


def with_code(source_dir, tmp_path, edit, reexport: str = "mlx_vlm.models.qwen2_vl"):
    """A copy of ``source_dir`` whose configs ``edit(name, config)`` changes, plus ``custom.py``
    (writes ``marker``, then re-exports ``reexport`` so a trusted load can go on)."""
    model = tmp_path / "model"
    shutil.copytree(source_dir, model)
    marker = tmp_path / "marker"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nfrom {reexport} import *\n"
    (model / "custom.py").write_text(code)
    for name in ("config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = model / name
        if file.exists():
            config = json.loads(file.read_text())
            edit(name, config)
            file.write_text(json.dumps(config))
    return model, marker


def model_file(name, config):
    if name == "config.json":
        config["model_file"] = "custom.py"


def nested_auto_map(name, config):
    if name == "config.json":
        config["text_config"] = {**config.get("text_config", {}), "auto_map": {"AutoModel": "custom.Model"}}


def processor_auto_map(name, config):
    if name == "preprocessor_config.json":
        config["auto_map"] = {"AutoImageProcessor": "custom.ImageProcessor"}


@pytest.mark.parametrize("edit", [model_file, nested_auto_map, processor_auto_map])
def test_a_vlm_naming_code_is_refused_before_it_runs(tiny_qwen2_vl_dir, tmp_path, edit):
    from vllm_mlx import LLM, EngineCore

    model, marker = with_code(tiny_qwen2_vl_dir, tmp_path, edit)
    with pytest.raises(ModelSourceError, match=REFUSED):
        EngineCore(model=str(model))
    with pytest.raises(ModelSourceError, match=REFUSED):
        LLM(str(model), trust_remote_code=False)
    assert not marker.exists()


def test_the_message_names_where_the_code_is(tiny_qwen2_vl_dir, tmp_path):
    model, _ = with_code(tiny_qwen2_vl_dir, tmp_path, nested_auto_map)
    with pytest.raises(ModelSourceError, match=r"config\.json: text_config\.auto_map = \{\"AutoModel\""):
        check_model_code(model, trust_remote_code=False)
    check_model_code(model, trust_remote_code=True)
    assert named_code(tiny_qwen2_vl_dir) == []


def test_a_trusted_model_file_runs_and_the_model_loads(tiny_qwen2_vl_dir, tmp_path):
    from vllm_mlx import LLM, SamplingParams

    model, marker = with_code(tiny_qwen2_vl_dir, tmp_path, model_file)
    llm = LLM(str(model), trust_remote_code=True, num_kv_blocks=32, force_model_takeover=True)
    try:
        assert marker.read_text() == "ran"  # mlx-vlm imported custom.py: the user said so
        [out] = llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_a_trusted_auto_map_gets_past_the_check(tiny_qwen2_vl_dir, tmp_path):
    from vllm_mlx import EngineCore

    model, _ = with_code(tiny_qwen2_vl_dir, tmp_path, nested_auto_map)
    engine = EngineCore(model=str(model), trust_remote_code=True, num_kv_blocks=32, force_model_takeover=True)
    try:
        assert engine.supports_images and engine.config.trust_remote_code
    finally:
        engine.shutdown()


def test_a_text_model_file_is_refused_with_our_message(tiny_model_dir, tmp_path):
    from vllm_mlx import EngineCore

    model, marker = with_code(tiny_model_dir, tmp_path, model_file, reexport="mlx_lm.models.llama")
    with pytest.raises(ModelSourceError, match=REFUSED):
        EngineCore(model=str(model))
    assert not marker.exists()


def test_cli_refuses_and_the_flag_reaches_the_engine(tiny_qwen2_vl_dir, tmp_path, capsys):
    from vllm_mlx.entrypoints.cli import build_parser, engine_options, main

    model, marker = with_code(tiny_qwen2_vl_dir, tmp_path, model_file)
    assert main(["generate", "--model", str(model), "--max-tokens", "1", "Hi"]) == 1
    assert "--trust-remote-code" in capsys.readouterr().err and not marker.exists()
    for command in ("generate", "serve"):
        argv = [command, "--trust-remote-code"] + (["Hi"] if command == "generate" else [])
        assert engine_options(build_parser().parse_args(argv))["trust_remote_code"] is True
        assert engine_options(build_parser().parse_args(argv[:1] + argv[2:]))["trust_remote_code"] is False


def test_hub_downloads_skip_python_files_unless_trusted():
    assert "*.py" not in allow_patterns(False)
    assert "*.py" in allow_patterns(True)
    assert {"*.json", "*.safetensors"} <= set(allow_patterns(False))
