"""Model coverage is generated, not claimed (vllm_mlx/models/support.py, docs/models.md).

An architecture is listed as supported only with a tiny-model test that exists (collected by
pytest); the tested ones still probe as runnable; refusals and unknowns carry a reason; the docs
table agrees with the code for the tested set (and, on the versions it was generated with, lists
exactly the installed architectures).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mlx.entrypoints.cli import main
from vllm_mlx.models import support
from vllm_mlx.models.probe import HELD_DETAIL, REFUSED, RUNS, UNKNOWN, Probe, ProbeWorker, probe_text
from vllm_mlx.models.support import NOT_GENERATOR, SUPPORTED, TESTED_ARCHITECTURES, TEXT, VISION

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "models.md"


def test_every_tested_architecture_names_a_test_that_exists():
    nodes = sorted({node for tested in TESTED_ARCHITECTURES.values() for node in tested.values()})
    nodes += [f"{support.REFUSED_AT_LOAD_TEST}[{name}]" for name in support.REFUSED_AT_LOAD]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    collected = set(result.stdout.split())
    assert [node for node in nodes if node not in collected] == []


def test_tested_architectures_probe_as_runnable_and_are_supported():
    rows = support.classify({source: list(tested) for source, tested in TESTED_ARCHITECTURES.items()})
    assert {(r.source, r.name) for r in rows} == {(s, n) for s, t in TESTED_ARCHITECTURES.items() for n in t}
    assert all(r.status == SUPPORTED and r.test == TESTED_ARCHITECTURES[r.source][r.name] for r in rows), rows
    # The probe itself says "runs" for each tested text architecture: the test is not all we have.
    with ProbeWorker() as worker:
        probes = {name: worker.probe(name) for name in TESTED_ARCHITECTURES[TEXT]}
    assert {name: probe.status for name, probe in probes.items()} == dict.fromkeys(TESTED_ARCHITECTURES[TEXT], RUNS)
    # Served with per-request caches (executor/held_caches.py): exactly these, and the table says so.
    assert {name for name, probe in probes.items() if probe.detail == HELD_DETAIL} == set(support.HELD_TEXT)
    assert all(r.detail == HELD_DETAIL for r in rows if r.name in support.HELD_TEXT)


def test_refusals_name_the_reason():
    """Vision rows are read off mlx-vlm's code: what the generic path cannot pass on is named."""
    vision = ["florence2", "mllama", "hunyuan_vl", "siglip", "minimax_m3_vl", "glm4v", "gemma3n", "paligemma",
              "llava_next", "phi4_siglip"]  # fmt: skip
    rows = support.classify({TEXT: ["longcat_flash_ngram"], VISION: vision})
    by_name = {row.name: row for row in rows}
    ngram, florence2, mllama, hunyuan_vl, siglip, minimax_m3_vl, glm4v, gemma3n, paligemma, llava_next, phi4_siglip = (
        by_name[name] for name in ("longcat_flash_ngram", *vision)
    )
    # Its config sets use_bidirectional_attention=True when a checkpoint leaves it out: the whole prompt
    # attends both ways (a prefix LM), one span the engine keeps whole; its hook writes its processor's prompt.
    assert paligemma.status == SUPPORTED and paligemma.test.endswith("test_one_image_equals_mlx_vlm[paligemma]")
    # Its logits grow by its image's patches, from state it keeps on the model: refused by name, saying so.
    [molmo_point] = support.classify({VISION: ["molmo_point"]})
    assert molmo_point.status == REFUSED and "point predictor extends the logits" in molmo_point.detail
    # DiffusionGemma denoises a canvas (its config's canvas_length): no token-by-token generation.
    [diffusion] = support.classify({VISION: ["diffusion_gemma"]})
    assert diffusion.status == NOT_GENERATOR and diffusion.detail.startswith("a diffusion decoder")
    # Its n-gram history (an ArraysCache a fixed-size state slot cannot hold) is held per request.
    assert ngram.status == SUPPORTED and ngram.detail == HELD_DETAIL
    assert ngram.test == TESTED_ARCHITECTURES[TEXT]["longcat_flash_ngram"]
    # An encoder-decoder: its prompt through the encoder once, the decoder's caches held per request.
    assert florence2.status == SUPPORTED and florence2.detail == HELD_DETAIL
    assert florence2.test.endswith("test_one_image_equals_mlx_vlm[florence2]")
    # An encoder-decoder whose encoder reads the image alone, the prompt's ids seeding its decoder.
    [nemotron_parse] = support.classify({VISION: ["nemotron_parse"]})
    assert nemotron_parse.status == SUPPORTED and nemotron_parse.detail == HELD_DETAIL
    assert nemotron_parse.test.endswith("test_one_image_equals_mlx_vlm[nemotron_parse]")
    # Its cross-attention states (and per-token masks: its hook) go with each call of its held caches.
    assert mllama.status == SUPPORTED and mllama.detail == HELD_DETAIL
    assert mllama.test.endswith("test_one_image_equals_mlx_vlm[mllama]")
    # Its positions are kept as state on its text model: its family hook passes its processor's with every call.
    assert hunyuan_vl.status == SUPPORTED and hunyuan_vl.test.endswith("test_one_image_equals_mlx_vlm[hunyuan_vl]")
    assert siglip.status == NOT_GENERATOR and siglip.detail.startswith("no language model: an image encoder")
    # Its sparse-attention layers keep the indexer's keys in a cache class of mlx-vlm's own: held per request.
    assert minimax_m3_vl.status == SUPPORTED and minimax_m3_vl.detail == HELD_DETAIL
    # Its processor wraps a prompt in its chat template: its hook writes that prompt (the oracle test is named).
    assert phi4_siglip.status == SUPPORTED and phi4_siglip.test.endswith("test_one_image_equals_mlx_vlm[phi4_siglip]")
    # Its per_layer_inputs travel with the embeddings (TOKEN_FEATURES); its hook scales the text rows mlx-vlm's
    # prompt embeddings leave unscaled (vlm_families.Gemma3nModel; the oracle test is named).
    assert gemma3n.status == SUPPORTED and gemma3n.test.endswith("test_one_image_equals_mlx_vlm[gemma3n]")
    assert glm4v.status == SUPPORTED  # positions from its own get_rope_index: tests/multimodal/test_vlm_families.py
    assert llava_next.status == SUPPORTED  # its model decides an image's length: the engine measures it


def test_models_that_generate_no_text_are_told_apart_from_refusals():
    """Encoders, detectors and segmenters (no language model) and embedding or retrieval models
    are not refusals: there is nothing to generate with. A generator is never among them."""
    names = ["siglip", "rfdetr", "sam3", "colqwen2_5", "qwen3_vl_embedding", "qwen2_vl", "llava"]
    rows = {row.name: row for row in support.classify({VISION: names})}
    assert {name for name, row in rows.items() if row.status == NOT_GENERATOR} == set(names[:5])
    assert rows["colqwen2_5"].detail.startswith("an embedding (retrieval) model")
    assert rows["rfdetr"].detail.startswith("no language model")


def test_installed_architectures_are_listed_and_helpers_are_not():
    text, vision = support.text_architectures(), support.vision_architectures()
    assert {"llama", "qwen2", "gemma3_text", "mamba"} <= set(text)
    assert not {"base", "cache", "rope_utils", "switch_layers"} & set(text)
    assert {"qwen2_vl", "qwen2_5_vl", "llava", "gemma3"} <= set(vision)
    assert "llama" not in vision  # mlx-vlm's text-only language models are not vision architectures


def test_a_probe_that_hangs_is_unknown_and_the_worker_recovers():
    with ProbeWorker(timeout=0.001) as worker:
        assert worker.probe("llama") == Probe(UNKNOWN, "the probe took longer than 0 s")
        worker.timeout = 120
        assert worker.probe("llama") == Probe(RUNS, "full attention")


def mlx_has_metal() -> bool:
    import mlx.core as mx

    return mx.metal.is_available()


def test_probe_details():
    """In this process: a runnable architecture's layer kinds, and why a probe cannot be built."""
    assert probe_text("gemma3_text") == Probe(RUNS, "sliding window + full attention")
    assert probe_text("gear") == Probe(RUNS, "sliding window + full attention")  # built from layer_types
    assert probe_text("lfm2") == Probe(RUNS, "recurrent state + full attention")  # short convolutions
    assert probe_text("deepseek_v41") == Probe(RUNS, HELD_DETAIL)  # its LayerCache, held per request
    # mlx-lm's olmo exits on import without ai2-olmo, which its code never calls: probed with a
    # stand-in for it (and refused: it fails in mlx-lm's own generation).
    assert probe_text("olmo").detail.startswith("architecture 'olmo' is refused: mlx-lm's OLMo (1) attention")
    assert "hf_olmo" not in sys.modules or importlib.util.find_spec("hf_olmo") is not None  # the stand-in is gone
    if not mlx_has_metal():  # BitNet's Metal kernel and Muse Spark's fused kernels have portable twins
        assert probe_text("bitnet") == Probe(RUNS, "full attention")
        assert probe_text("muse_spark") == Probe(RUNS, "sliding window + full attention")
    # A Hadamard-packed 2-bit checkpoint: the override describes one packed layer.
    assert probe_text("prism_hadamard_qwen35") == Probe(RUNS, "recurrent state + full attention")


def page_rows() -> dict[tuple[str, str], dict]:
    """docs/models.md's rows by (source, architecture)."""
    rows, source = {}, None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            source = line[3:].strip()
        match = re.match(r"\| `([^`]+)` \| ([^|]*) \| ([^|]*) \| ([a-z-]+) \| (.*) \|$", line)
        if match:
            rows[(source, match[1])] = {"gguf": match[3].strip(), "status": match[4], "detail": match[5]}
    return rows


def test_docs_page_agrees_with_the_code():
    rows = page_rows()
    supported = {key: row["detail"] for key, row in rows.items() if row["status"] == SUPPORTED}
    expected = {(s, n): f"`{node}`" for s, tested in TESTED_ARCHITECTURES.items() for n, node in tested.items()}
    held = [(TEXT, n) for n in support.HELD_TEXT] + [(VISION, n) for n in support.HELD_VISION]
    expected |= {(s, n): f"`{TESTED_ARCHITECTURES[s][n]}` ({HELD_DETAIL})" for s, n in held}
    assert supported == expected, "regenerate: python -m vllm_mlx.models.support --write docs/models.md"
    environment = json.loads(re.search(r"<!-- environment: (.*) -->", PAGE.read_text())[1])
    if environment != support.installed_versions():
        pytest.skip(f"docs/models.md was generated with {environment}")
    listed = {source: sorted(n for s, n in rows if s == source) for source in (TEXT, VISION)}
    assert listed[TEXT] == sorted(support.text_architectures())
    assert listed[VISION] == sorted(support.vision_architectures())


def test_cli_lists_the_named_architectures(capsys):
    assert main(["models", "--supported", "llama", "qwen2_vl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    named = [line.split()[:2] for line in lines[:3]]
    assert named == [["mlx-lm", "llama"], ["mlx-lm", "qwen2_vl"], ["mlx-vlm", "qwen2_vl"]]
    assert "supported" in lines[0] and lines[0].endswith(TESTED_ARCHITECTURES[TEXT]["llama"])
    assert main(["models", "--supported", "no_such_arch"]) == 1
    assert "no installed mlx-lm or mlx-vlm architecture named no_such_arch" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["hunyuan", "llama4_text", "mimo_v2_flash", "ministral3"])
def test_the_tiny_config_is_repaired_from_what_the_model_code_asks(name):
    """The generic tiny config does not build these (a config dict read by key, a per-layer list
    read by layer, a field checked against a literal, a list searched for an entry); repaired
    from each failure's line of the model's own code, it does, and stays tiny."""
    import importlib

    from vllm_mlx.models import probe

    module = importlib.import_module(f"mlx_lm.models.{name}")
    with pytest.raises(Exception):  # noqa: B017 -- any of the model's own errors
        probe._build(module, probe.tiny_config(module, name))
    model = probe.build_tiny_model(module, name).model
    assert 0 < probe._num_parameters(model) <= probe.PROBE_MAX_PARAMETERS
