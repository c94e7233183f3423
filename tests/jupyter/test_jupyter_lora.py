"""LoRA adapters in the notebook: ``%vllm_mlx adapter load NAME PATH`` and ``%%generate --adapter
NAME``, cells with different adapters (and none) in one batch, each equal to mlx-lm with its
adapter alone; in a real IPython shell, on the tiny llama."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from lora_adapters import write_mlx_lm_adapter
from notebook_shell import generate, loaded_shell
from oracles import mlx_lm_tokens

TIMEOUT = 60.0
PROMPT = "Tell me about lighthouses."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": write_mlx_lm_adapter(tiny_model_dir, root / "sql", rank=4, scale=2.0, seed=1),
        "poet": write_mlx_lm_adapter(tiny_model_dir, root / "poet", rank=8, scale=1.0, seed=2),
    }


def test_cells_with_adapters_share_a_batch_and_match_mlx_lm(tiny_model_dir, adapters):
    options = {"num_kv_blocks": 128, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    with loaded_shell(tiny_model_dir, options, max_tokens=8, temperature=0.0) as ip:
        with capture_output() as out:
            for name, path in adapters.items():
                ip.run_line_magic("vllm_mlx", f"adapter load {name} {path}")
            ip.run_line_magic("vllm_mlx", "adapter list")
        assert "sql" in out.stdout and "poet" in out.stdout
        gens = {name: generate(ip, f"--raw --adapter {name}" if name else "--raw", PROMPT)
                for name in ("sql", "poet", None)}  # fmt: skip
        texts = {name: gen.result(TIMEOUT) for name, gen in gens.items()}
        tokens = {name: gen.output.outputs[0].token_ids for name, gen in gens.items()}
        with pytest.raises(UsageError, match="no such adapter"):
            generate(ip, "--adapter missing", PROMPT)
        ip.user_ns["topics"] = ["lighthouses", "harbours"]
        over_texts = generate(ip, "--over topics --raw --adapter sql", "Tell me about {item}.").result(TIMEOUT)
        with pytest.raises(UsageError, match="no such adapter"):
            generate(ip, "--over topics --adapter missing", "{item}")
        with pytest.raises(UsageError, match="adapter load NAME PATH"):
            ip.run_line_magic("vllm_mlx", "adapter load only-a-name")
    for name in ("sql", "poet", None):
        path = adapters[name] if name else None
        assert tokens[name] == mlx_lm_tokens(tiny_model_dir, [PROMPT], 8, adapter_path=path)[0], name
    assert len(set(texts.values())) == 3
    from vllm_mlx.models import load_model

    tokenizer = load_model(tiny_model_dir).tokenizer
    prompts = [f"Tell me about {topic}." for topic in ("lighthouses", "harbours")]
    expected = mlx_lm_tokens(tiny_model_dir, prompts, 8, adapter_path=adapters["sql"])
    assert over_texts == [tokenizer.decode(tokens) for tokens in expected]  # --over rows run with the adapter
