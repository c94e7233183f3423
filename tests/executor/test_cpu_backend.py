"""The CPU backend's fast paths: BLAS preload, weight-format choice, dequantization."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mlx.platform import cpu_backend

REPO_ROOT = Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")


def _openblas_installed() -> bool:
    return bool(cpu_backend._find("openblas"))


PROBE = """
import json, sys
import vllm_mlx.engine.core
import mlx.core as mx
from vllm_mlx.platform import cpu_backend
a = mx.ones((64, 64))
mx.eval(a @ a)
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libopenblas" in line]
print(json.dumps({
    "fast_blas": cpu_backend.FAST_BLAS_PATH,
    "fast_blas_provider": cpu_backend.FAST_BLAS_PROVIDER,
    "provider": cpu_backend.blas_provider(),
    "openblas_mapped": sorted(set(maps)),
    "backend": cpu_backend.describe_backend(),
}))
"""


def _run(code: str, fast_blas: str | None, *args: str, cpu_kernels: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (the BLAS is chosen when vllm_mlx is imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_MLX_FAST_BLAS", "LD_PRELOAD")}
    env = {k: v for k, v in env.items() if not k.startswith(("MKL_", "OPENBLAS_", "VLLM_MLX_CPU_KERNELS"))}
    if fast_blas is not None:
        env["VLLM_MLX_FAST_BLAS"] = fast_blas
    if not cpu_kernels:
        env["VLLM_MLX_CPU_KERNELS"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip


@functools.cache
def _probe(fast_blas: str | None) -> dict:
    """What a fresh interpreter with ``VLLM_MLX_FAST_BLAS=fast_blas`` loaded (asked once per value:
    each answer is a new interpreter's, so it cannot change)."""
    return json.loads(_run(PROBE, fast_blas).stdout.strip().splitlines()[-1])


def _mkl_installed() -> bool:
    return bool(cpu_backend._find("mkl"))


# --- choose_weight_format ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["quantized", "float32", "bfloat16"])
def test_explicit_format_is_honoured(fmt):
    assert cpu_backend.choose_weight_format(fmt) == fmt
    assert cpu_backend.choose_weight_format(fmt, fits=lambda _: False) == fmt  # fitting: the caller's check


def test_bad_format_names_the_allowed_values():
    with pytest.raises(ValueError) as info:
        cpu_backend.choose_weight_format("int8")
    message = str(info.value)
    assert "'int8'" in message
    for allowed in ("auto", "quantized", "float32", "bfloat16"):
        assert repr(allowed) in message


def test_auto_is_float32_on_cpu_and_quantized_on_accelerators(monkeypatch):
    monkeypatch.setattr(cpu_backend, "_backend", lambda: "cpu")
    assert cpu_backend.choose_weight_format() == "float32"
    assert cpu_backend.choose_weight_format("auto") == "float32"
    for device in ("metal", "cuda"):
        monkeypatch.setattr(cpu_backend, "_backend", lambda device=device: device)
        assert cpu_backend.choose_weight_format("auto") == "quantized"
        assert cpu_backend.choose_weight_format("float32") == "float32"


def test_auto_on_cpu_is_the_fastest_format_that_fits(monkeypatch):
    monkeypatch.setattr(cpu_backend, "_backend", lambda: "cpu")
    for fitting, expected in [
        ({"float32", "bfloat16", "quantized"}, "float32"),
        ({"bfloat16", "quantized"}, "bfloat16"),
        ({"quantized"}, "quantized"),
        (set(), "quantized"),  # nothing fits: the smallest, for the caller to refuse with its figures
    ]:
        assert cpu_backend.choose_weight_format("auto", fits=fitting.__contains__) == expected
    monkeypatch.setattr(cpu_backend, "_backend", lambda: "metal")
    assert cpu_backend.choose_weight_format("auto", fits=lambda _: True) == "quantized"


def test_auto_matches_this_machine():
    import mlx.core as mx

    expected = "quantized" if mx.metal.is_available() or mx.cuda.is_available() else "float32"
    assert cpu_backend.choose_weight_format() == expected


# --- BLAS preload -----------------------------------------------------------------------------


def test_preload_is_a_no_op_once_mlx_is_imported(monkeypatch):
    import mlx.core  # noqa: F401

    monkeypatch.setattr(cpu_backend, "_PRELOAD_DONE", False)
    monkeypatch.setattr(cpu_backend, "FAST_BLAS_PATH", None)
    monkeypatch.delenv("VLLM_MLX_FAST_BLAS", raising=False)
    assert cpu_backend.preload_fast_blas() is None


def test_preload_never_raises(monkeypatch):
    monkeypatch.setattr(cpu_backend, "_PRELOAD_DONE", False)
    monkeypatch.setattr(cpu_backend, "FAST_BLAS_PATH", None)
    monkeypatch.setattr(cpu_backend, "_candidates", lambda: 1 / 0)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    monkeypatch.delenv("VLLM_MLX_FAST_BLAS", raising=False)
    assert cpu_backend.preload_fast_blas() is None


@pytest.mark.skipif(not LINUX, reason="the BLAS preload is Linux-only")
def test_switch_off_keeps_the_bundled_blas():
    info = _probe("0")
    assert info["fast_blas"] is None
    assert info["openblas_mapped"] == []
    assert info["provider"] is None
    assert info["backend"]["blas"] == "bundled"


@pytest.mark.skipif(not LINUX, reason="the BLAS preload is Linux-only")
@pytest.mark.skipif(
    LINUX and not _openblas_installed(),
    reason="no optimised BLAS installed (Debian/Ubuntu: apt-get install libopenblas0-pthread)",
)
def test_importing_the_package_preloads_openblas_for_mlx():
    info = _probe("openblas")  # MKL, when installed, comes first by default
    assert info["fast_blas"]
    assert info["fast_blas_provider"] == "openblas"
    assert info["openblas_mapped"], "libopenblas is not mapped in the process"
    # The library MLX's cblas_sgemm binds to is the preloaded one, not the bundled reference BLAS.
    assert info["provider"] and "libopenblas" in Path(info["provider"]).name
    assert info["backend"]["blas"] == info["provider"]


@pytest.mark.skipif(not (LINUX and _mkl_installed()), reason="PyPI's mkl (the fast-cpu extra) is not installed")
def test_mkl_is_the_default_and_the_provider_switch_works():
    info = _probe(None)
    assert info["fast_blas_provider"] == "mkl"
    assert "libmkl_rt" in Path(info["provider"]).name  # MLX's cblas_sgemm binds to MKL
    assert info["backend"]["blas_provider"] == "mkl"
    assert info["backend"]["mkl_threading"] == cpu_backend.MKL_DEFAULT_LAYER
    assert _probe("MKL")["fast_blas_provider"] == "mkl"
    if _openblas_installed():
        assert _probe("openblas")["fast_blas_provider"] == "openblas"


# The oracle across BLAS libraries: fixed matmuls and a tiny model's greedy tokens.
ORACLE = """
import json, sys
import numpy as np
from vllm_mlx import LLM, SamplingParams
from vllm_mlx.platform import cpu_backend
import mlx.core as mx
rng = np.random.default_rng(0)
out = {"provider": cpu_backend.FAST_BLAS_PROVIDER, "products": {}}
for m, k, n in [(1, 576, 1536), (8, 1536, 576), (33, 576, 300)]:
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    out["products"][f"{m}x{k}x{n}"] = np.array(mx.array(a) @ mx.array(b).T).tolist()
llm = LLM(sys.argv[1], enable_prefix_caching=False)
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
prompts = [[5, 17, 99, 300], [1000, 42], list(range(200, 300))]  # 100 tokens: both CPU streams
out["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
llm.shutdown()
print(json.dumps(out))
"""


@pytest.mark.skipif(not (LINUX and _mkl_installed()), reason="PyPI's mkl (the fast-cpu extra) is not installed")
def test_every_blas_and_the_stock_kernels_give_the_same_tokens(tiny_model_dir):
    """MKL, OpenBLAS (when installed) and the reference BLAS, with our CPU kernels, and the
    reference BLAS with MLX's stock kernels: the same products and greedy tokens."""
    import numpy as np

    def oracle(blas: str, cpu_kernels: bool = True) -> dict:
        return json.loads(_run(ORACLE, blas, str(tiny_model_dir), cpu_kernels=cpu_kernels).stdout.splitlines()[-1])

    ref, stock = oracle("0"), oracle("0", cpu_kernels=False)
    assert ref["provider"] is None and stock["tokens"] == ref["tokens"]
    for blas in ("mkl", "openblas") if _openblas_installed() else ("mkl",):
        run = oracle(blas)
        assert run["provider"] == blas
        for shape, expected in ref["products"].items():
            np.testing.assert_allclose(run["products"][shape], expected, rtol=1e-4, atol=1e-3)
        assert run["tokens"] == ref["tokens"], blas


def test_reference_blas_warning_is_printed_once(monkeypatch, capsys):
    reference = {"device": "cpu", "mlx_version": "x", "fast_blas": None, "blas": "bundled", "blas_provider": "reference"}
    monkeypatch.setattr(cpu_backend, "describe_backend", lambda: reference)
    monkeypatch.setattr(cpu_backend, "_WARNED", False)
    monkeypatch.delenv("VLLM_MLX_FAST_BLAS", raising=False)
    assert "reference BLAS" in cpu_backend.backend_summary("float32")
    assert cpu_backend.warn_reference_blas() is LINUX
    assert cpu_backend.warn_reference_blas() is False
    lines = [line for line in capsys.readouterr().err.splitlines() if "reference BLAS" in line]
    assert len(lines) == (1 if LINUX else 0)
    if LINUX:
        fix = "pip install mkl" if os.uname().machine == "x86_64" else "apt-get install libopenblas0-pthread"
        assert lines[0].endswith(fix)
    monkeypatch.setattr(cpu_backend, "describe_backend", lambda: {**reference, "blas_provider": "mkl"})
    assert cpu_backend.reference_blas_warning() is None


@pytest.mark.skipif(not LINUX, reason="the BLAS preload is Linux-only")
def test_generate_says_which_blas_runs(tiny_model_dir):
    code = "import sys; from vllm_mlx.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ("generate", "--model", str(tiny_model_dir), "--max-tokens", "2", "hi")
    err = _run(code, "0", *args).stderr
    assert "BLAS: MLX's reference BLAS (slow)" in err
    assert err.count("warning: MLX's CPU matmuls run on its reference BLAS") == 1
    assert "unset VLLM_MLX_FAST_BLAS" in err
    if _mkl_installed():
        err = _run(code, "mkl", *args).stderr
        assert "BLAS: MKL (sequential)" in err and "reference BLAS" not in err


def test_fast_blas_matmul_is_correct():
    """Whatever BLAS serves MLX in this process, a float32 matmul matches numpy."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((96, 576), dtype=np.float32)
    b = rng.standard_normal((576, 160), dtype=np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)


def test_describe_backend():
    import mlx.core as mx

    info = cpu_backend.describe_backend()
    assert info["mlx_version"] == mx.__version__
    assert info["device"] in ("cpu", "metal", "cuda")
    assert info["fast_blas"] == cpu_backend.FAST_BLAS_PATH
    json.dumps(info)


# --- prepare_model_weights --------------------------------------------------------------------


def _tiny_llama(seed: int = 0):
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-5, vocab_size=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _quantized_layers(model) -> list[str]:
    return [name for name, m in model.named_modules() if cpu_backend._is_quantized(m)]


def test_dequantized_model_gives_the_quantized_logits():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = _tiny_llama()
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)  # tied head is quantized too
    tokens = mx.array([[1, 5, 9, 42, 7, 200, 3, 3]])
    expected = model(tokens)
    mx.eval(expected)

    assert cpu_backend.prepare_model_weights(model, "quantized") == "quantized"
    assert _quantized_layers(model)

    assert cpu_backend.prepare_model_weights(model, "float32") == "float32"
    assert _quantized_layers(model) == []
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    got = model(tokens)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


def test_float16_scales_dequantize_to_float32():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = _tiny_llama()
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[4, 8, 15, 16, 23, 42]])
    expected = model(tokens).astype(mx.float32)
    assert cpu_backend.prepare_model_weights(model, "float32") == "float32"
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    # The quantized model computed in float16; the float32 one is at least as accurate.
    assert mx.allclose(model(tokens), expected, atol=5e-2, rtol=5e-2).item()


def test_bfloat16_dequantizes_every_layer():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = _tiny_llama()
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[1, 5, 9, 42, 7, 200, 3, 3]])
    expected = model(tokens).astype(mx.float32)
    weights = {k: v for k, v in tree_flatten(model.parameters())}
    dequantized = mx.dequantize(
        weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.scales"],
        weights["model.layers.0.mlp.up_proj.biases"], 32, 4,
    )  # fmt: skip
    assert cpu_backend.prepare_model_weights(model, "bfloat16") == "bfloat16"
    assert _quantized_layers(model) == []
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert mx.array_equal(model.model.layers[0].mlp.up_proj.weight, dequantized).item()  # bfloat16 scales: exact
    # The same weights; only the arithmetic differs (bfloat16 matmuls vs the quantized kernel's
    # float accumulation): logits up to ~3.3 moved by at most 0.08 when measured.
    assert mx.allclose(model(tokens).astype(mx.float32), expected, atol=0.1, rtol=0).item()


def test_float32_weights_dequantize_to_bfloat16_by_rounding():
    import mlx.core as mx
    import mlx.nn as nn

    model = _tiny_llama()
    nn.quantize(model, group_size=32, bits=4)
    exact = mx.dequantize(model.model.embed_tokens.weight, model.model.embed_tokens.scales,
                          model.model.embed_tokens.biases, 32, 4)  # fmt: skip
    assert cpu_backend.prepare_model_weights(model, "bfloat16") == "bfloat16"
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert mx.array_equal(model.model.embed_tokens.weight, exact.astype(mx.bfloat16)).item()


@pytest.mark.parametrize("fmt", ["float32", "quantized", "auto", "bfloat16"])
def test_float_model_is_left_unchanged(fmt):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = _tiny_llama()
    before = {k: v for k, v in tree_flatten(model.parameters())}
    assert cpu_backend.prepare_model_weights(model, fmt) == "float32"
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)

    model.set_dtype(mx.bfloat16)
    assert cpu_backend.prepare_model_weights(model, fmt) == "bfloat16"


def test_prepare_rejects_unknown_format():
    with pytest.raises(ValueError, match="allowed values"):
        cpu_backend.prepare_model_weights(_tiny_llama(), "fp8")
