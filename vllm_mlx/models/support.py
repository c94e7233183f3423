"""Which mlx-lm and mlx-vlm architectures the paged engine runs: generated, not claimed.

Every architecture of the *installed* mlx-lm and mlx-vlm is listed with one status:

* ``supported``: a tiny-model oracle test runs it (``TESTED_ARCHITECTURES`` names the test; a
  test of ours checks that every named test exists and that the architecture still classifies
  as runnable);
* ``runs-untested``: the engine accepts it and a probe ran (for a vision architecture: its code
  read), but no test holds it to an oracle;
* ``refused``: the engine refuses it at load, for the reason given (a layer cache kind it does
  not page; a vision-language model that needs more than the generic path passes on);
* ``not-a-generator``: it does not generate text (an image encoder, detector, segmenter or
  classifier with no language model; an embedding or retrieval model): nothing to serve here;
* ``unknown``: no probe could be built or run (the reason is given): a generic tiny config does
  not fit every architecture.

Text architectures (mlx-lm modules with ``Model`` and ``ModelArgs``) are probed in a child
process (``model_probe``): a tiny model of the architecture, ``attention.layer_specs`` to
decide between runs and refused, one token through the engine's own forward path to confirm
that it runs. Vision-language architectures (mlx-vlm packages with a vision tower) run through
a family hook (``vlm_families``) or the generic path (``vlm_generic``), whose refusals are read
off the package's code (``classify_vision``). So support added to ``layer_specs``, the generic
path or a hook shows up here by itself.

Classifying everything takes 15-50 s on two CPU cores; the result is cached per installed
versions, backend and our source (``cache_root()/model_support.json``). ``python -m
vllm_mlx.models.support --write docs/models.md`` regenerates the docs page.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from vllm_mlx.models.probe import HELD_DETAIL, REFUSED, RUNS, UNKNOWN, ProbeWorker

SUPPORTED = "supported"
NOT_GENERATOR = "not-a-generator"
STATUSES = (SUPPORTED, RUNS, REFUSED, NOT_GENERATOR, UNKNOWN)
TEXT, VISION = "mlx-lm", "mlx-vlm"

# mlx-lm architectures with no test of their own that the breadth sweep runs: a tiny model the
# probe builds from the module's own ModelArgs, greedy tokens equal to mlx-lm's, batched and on a
# prefix hit (tests/models/test_architecture_sweep.py); a model served with per-request caches
# (deepseek_v41, longcat_flash_ngram: HELD_DETAIL) sends the prompt again with no hit instead.
SWEPT_TEXT = (
    "afm7", "afmoe", "apertus", "baichuan_m1", "bitnet", "bailing_hybrid", "bailing_moe", "bailing_moe_linear",
    "bailing_moe_v3", "cohere", "cohere2", "dbrx", "deepseek", "deepseek_v2", "deepseek_v32", "deepseek_v41", "dots1",
    "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon_h1", "gear", "gemma3", "gemma3n", "gemma4",
    "gemma4_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt2", "gpt_bigcode", "gpt_neox", "gptj",
    "helium", "hunyuan", "hunyuan_v1_dense", "internlm2", "internlm3", "iquestloopcoder", "jamba", "kimi_k25",
    "kimi_k3", "kimi_linear", "kimi_vl", "Klear", "laguna", "lfm2-vl", "lfm2_moe", "lille-130m", "llama4",
    "llama4_text", "longcat_flash", "longcat_flash_ngram", "mamba", "mamba2", "mellum", "mimo", "mimo_v2_flash",
    "minicpm", "minicpm3", "minimax", "minimax_m3_vl", "ministral3", "mistral3", "mistral4", "mixtral", "muse_glimmer",
    "muse_spark", "nanbeige", "nanochat", "nemotron", "nemotron-nas", "olmo3", "olmo_hybrid", "openelm", "phi3small",
    "phimoe", "phixtral", "pixtral", "plamo", "plamo2", "plamo3", "prism_hadamard_qwen35", "qwen", "qwen2_vl",
    "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "recurrent_gemma", "rwkv7", "seed_oss", "spark2_5", "step3p5", "talkie",
    "telechat3", "youtu_llm",
)  # fmt: skip

# The swept architectures the engine serves with per-request caches: their probe says HELD_DETAIL (the
# engine decides at load from their cache classes; this names what tests/models/test_model_support.py expects).
HELD_TEXT = ("deepseek_v41", "longcat_flash_ngram")
# The tested mlx-vlm families served so (MiniMax-M3-VL's MiniMaxM3KVCache, Qwen4-Exp's QSAKVCache and state
# caches, GLM-5-Next's indexer and state caches; mllama's, for its per-request cross-attention states;
# Florence-2's encoder outputs; Zaya1-VL's CacheList of mlx-vlm's KVCache and
# ArraysCache): the code reader cannot see it.
HELD_VISION = ("minimax_m3_vl", "qwen4_exp",
               "florence2",
               "mllama",
               "glm5_next",
               "nemotron_parse",
               "zaya1_vl")

# Architecture -> the tiny-model oracle test (pytest node id) that runs it in the engine.
# Add a line with the test; tests/models/test_model_support.py checks every node id collects.
TESTED_ARCHITECTURES: dict[str, dict[str, str]] = {
    TEXT: {
        "llama": "tests/engine/test_sliding_window.py::test_default_block_size_equals_mlx_lm[llama]",
        "gemma3_text": "tests/engine/test_sliding_window.py::test_default_block_size_equals_mlx_lm[gemma3_text]",
        "gpt_oss": "tests/engine/test_sliding_window.py::test_default_block_size_equals_mlx_lm[gpt_oss]",
        "qwen2": "tests/engine/test_engine.py::test_another_architecture_runs_unmodified",
        **{name: f"tests/models/test_gguf_architectures.py::test_engine_greedy_equals_mlx_lm_on_the_converted_model[{gguf}]"
           for name, gguf in (("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe"), ("gemma2", "gemma2"), ("phi3", "phi3"),
                              ("granite", "granite"), ("gemma", "gemma"), ("qwen2_moe", "qwen2moe"),
                              ("olmo2", "olmo2"), ("olmoe", "olmoe"), ("granitemoe", "granitemoe"),
                              ("stablelm", "stablelm"), ("starcoder2", "starcoder2"), ("phi", "phi2"),
                              ("smollm3", "smollm3"), ("ernie4_5", "ernie4_5"))},
        "deepseek_v3": "tests/core/test_kv_sizing.py::test_latent_attention_equals_mlx_lm",
        **{name: f"tests/engine/test_recurrent.py::test_staggered_arrivals_and_preemption_equal_mlx_lm[{name}]"
           for name in ("lfm2", "qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_h")},
        **{name: f"tests/models/test_architecture_sweep.py::test_engine_equals_mlx_lm[{name}]" for name in SWEPT_TEXT},
    },
    VISION: {
        "qwen2_vl": "tests/multimodal/test_multimodal.py::test_greedy_tokens_equal_mlx_vlm[qwen2_vl]",
        "qwen2_5_vl": "tests/multimodal/test_multimodal.py::test_greedy_tokens_equal_mlx_vlm[qwen2_5_vl]",
        "llava": "tests/multimodal/test_multimodal.py::test_greedy_tokens_equal_mlx_vlm[llava]",
        **{name: f"tests/multimodal/test_vlm_families.py::test_one_image_equals_mlx_vlm[{name}]"
           for name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "mistral3", "smolvlm",
                        "idefics3", "pixtral", "glm4v", "glm4v_moe", "glm_ocr", "llava_onevision", "aya_vision",
                        "lfm2_vl", "kimi_vl", "llama4", "gemma4",
                        "internvl", "internvl_chat", "nemotron_h_nano_omni",
                        "idefics2",
                        "muse_glimmer", "d1", "muse_spark",
                        "mage_vl", "llmjpvl",
                        "molmo2",
                        "dots_ocr", "clef", "indic_ocr", "prism_hadamard_qwen35",
                        "kimi_k25", "mimo_v2", "kimi_k3",
                        "llava_next", "granite_vision",
                        "cohere_compass",
                        "granite4_vision",
                        "minicpmo", "minicpmv4_6", "minicpmv4_7",
                        "paddleocr_vl",
                        "qwen3_omni_moe", "step3p7",
                        "deepseek_vl_v2",
                        "gemma4_unified",
                        "falcon_ocr",
                        "phi4mm", "llava_bunny",
                        "locateanything", "inkling",
                        "hunyuan_vl",
                        "multi_modality",
                        "molmo", "moondream3", "got",
                        "paligemma",
                        "fastvlm",
                        "plamo2vl",
                        "jina_vlm",
                        "ernie4_5_moe_vl",
                        "minimax_m3_vl", "qwen4_exp",
                        "phi4_siglip",
                        "phi3_v",
                        "florence2",
                        "mllama",
                        "glm5_next",
                        "nemotron_parse",
                        "zaya1_vl",
                        "deepseekocr",
                        "moondream2",
                        "falcon_perception",
                        "gemma3n",
                        )},
    },
}

REFUSED_AT_LOAD_TEST = (
    "tests/multimodal/test_vlm_families.py::test_a_family_the_generic_path_cannot_drive_is_refused_at_load_saying_why"
)
# mlx-vlm architectures the engine refuses at load, found on a tiny model of their own (what their
# code does that the code reader above cannot see): the reason, in a line. The test (its
# REFUSED_AT_LOAD, by name) holds the engine to it; the table calls them refused, naming the test.
REFUSED_AT_LOAD: dict[str, str] = {
    "unlimited_ocr": "its decode steps attend to the whole prompt plus a ring of the last generated tokens "
    "(RingSlidingKVCache, a cache class of mlx-vlm's own), which a cache held per request cannot rebuild after a "
    "preemption",
}

# mlx-vlm architectures the generic path takes (the check at load decides on a real checkpoint) that
# no test here holds to mlx-vlm, and why: what keeps a tiny model of them out of the suite. The table
# keeps them runs-untested with this reason.
WHY_UNTESTED: dict[str, str] = {
    "youtu_vl": "mlx-vlm ships no processor for it: the checkpoint's own remote code is its processor (loaded "
    "with --trust-remote-code, then the check at load decides); without that code the engine raises "
    "ModelSourceError at load (transformers finds no processing class)",
    # DeepSeek-OCR's SAM and 1024 px view shrink in its tests (tests/tiny_vlm_ocr.py); OCR 2's sizes are literals.
    "deepseekocr_2": "no tiny model: mlx-vlm builds its Qwen2 vision encoder at full size whatever the config says "
    "(VisionConfig.from_dict writes 24 layers 4864 wide, ~360M parameters; its width must be SAM's output, which the "
    "model fixes at 896), and its encoder's queries fit a 768 or 1024 px view only; one forward takes minutes on a CPU",
}

# mlx-vlm architectures whose processor needs a package that may be missing: (package, why). Without
# it the engine raises ModelSourceError at load saying so, which the named test holds it to.
PROCESSOR_NEEDS: dict[str, tuple[str, str, str]] = {
    "mistral_large3": (
        "torchvision",
        "mlx-vlm leaves it transformers' PixtralProcessor, which needs torch and torchvision",
        "tests/multimodal/test_vlm_families.py::"
        "test_mistral_large3_without_torch_is_refused_saying_its_processor_needs_it",
    ),
}

CACHE_FILE = "model_support.json"


@dataclass(frozen=True)
class Architecture:
    """One architecture's row: ``name`` is the module (mlx-lm) or package (mlx-vlm) name,
    ``aliases`` the other ``model_type`` values the package maps to it, ``detail`` the layer
    kinds (runs) or the reason (refused, unknown), ``test`` the oracle test (supported)."""

    name: str
    source: str
    status: str
    detail: str
    aliases: tuple[str, ...] = ()
    test: str | None = None


# -- what is installed ---------------------------------------------------------------------------


def text_architectures() -> list[str]:
    """mlx-lm's model modules (those that define ``Model`` and ``ModelArgs``), by name."""
    import mlx_lm.models

    root = Path(mlx_lm.models.__path__[0])
    modules = [info.name for info in pkgutil.iter_modules([str(root)]) if not info.ispkg]
    return [name for name in modules if _defines(root / f"{name}.py", "Model", "ModelArgs")]


def vision_architectures() -> list[str]:
    """mlx-vlm's model packages with a vision tower (their code names a ``VisionModel`` or a
    ``VisionConfig``): the ones a model directory with a ``vision_config`` loads. None without
    mlx-vlm (the ``vlm`` extra)."""
    try:
        import mlx_vlm.models
    except ImportError:
        return []

    root = Path(mlx_vlm.models.__path__[0])
    packages = [info.name for info in pkgutil.iter_modules([str(root)]) if info.ispkg]
    tower = r"\bVisionModel\b|class VisionConfig\b"
    return [name for name in packages if any(_mentions(f, tower) for f in (root / name).glob("*.py"))]


def _defines(path: Path, *classes: str) -> bool:
    text = path.read_text(errors="replace")
    return all(re.search(rf"^class {name}\b", text, re.M) for name in classes)


def _mentions(path: Path, pattern: str) -> bool:
    return re.search(pattern, path.read_text(errors="replace")) is not None


def _aliases(source: str) -> dict[str, tuple[str, ...]]:
    """Module -> the model types the package remaps to it (e.g. llama <- mistral)."""
    try:
        remapping = importlib.import_module("mlx_lm.utils" if source == TEXT else "mlx_vlm.utils").MODEL_REMAPPING
    except (ImportError, AttributeError):
        return {}
    aliases: dict[str, list[str]] = {}
    for alias, target in remapping.items():
        if alias != target:
            aliases.setdefault(target, []).append(alias)
    return {target: tuple(sorted(names)) for target, names in aliases.items()}


# -- classifying ---------------------------------------------------------------------------------


def _text_row(name: str, worker: ProbeWorker) -> Architecture:
    probe = worker.probe(name)
    return Architecture(name, TEXT, probe.status, probe.detail)


def classify_vision(name: str) -> Architecture:
    """A family hook takes the architecture (runs), or the generic path does (``vlm_generic.py``),
    read off the package's installed code: refused where its model has no
    ``get_input_embeddings``, where the embeddings come with what the text model needs beside
    them (the fields the generic path's check at load refuses; positions are not among them where
    the text model has a ``get_rope_index``, nor the image-token mask and deepstack rows, which
    the generic path passes on in the forms the check at load accepts), or where it keeps
    multi-axis positions as state on its text model with no ``get_rope_index``; runs otherwise,
    and the check at load confirms it on the real model."""
    from vllm_mlx.multimodal.vlm_families import ARCHITECTURE_REFUSALS, FAMILIES
    from vllm_mlx.multimodal.vlm_generic import (
        DECODER_START,
        IGNORED_FEATURES,
        IMAGE_STATES,
        POSITION_FEATURES,
        TOKEN_FEATURES,
        VISION_BLOCKS,
        VISUAL_FEATURES,
        WHOLE_PROMPT,
        both_ways_reason,
    )

    family = next((f for f in FAMILIES if name in f.model_types), None)
    if family is not None:
        return Architecture(name, VISION, RUNS, f"family hook {family.__name__}")
    if name in ARCHITECTURE_REFUSALS:  # what its code does past what can be read off generally
        return Architecture(name, VISION, REFUSED, f"it {ARCHITECTURE_REFUSALS[name]}")
    code = _package_code(name)
    why_not = _why_not_a_generator(name, code)
    if why_not is not None:
        return Architecture(name, VISION, NOT_GENERATOR, why_not)
    embeddings = _method_source(name, "Model", "get_input_embeddings")
    if embeddings is None:
        reason = "its model has no get_input_embeddings, the interface the generic path drives"
        return Architecture(name, VISION, REFUSED, reason)
    both_ways = _bidirectional_by_default(name, code)
    # Image blocks both ways are served, and so is a prefix LM's whole prompt (one span); no other rule.
    if both_ways and both_ways != VISION_BLOCKS and both_ways is not WHOLE_PROMPT:
        return Architecture(name, VISION, REFUSED, both_ways_reason(both_ways))
    rope_index = _defines_method(name, "get_rope_index")
    # Image states beside the embeddings go with a held request's calls (IMAGE_STATES); their per-token masks
    # (STEP_MASKS) only where a family hook builds them, which returned above.
    ignored = IGNORED_FEATURES | TOKEN_FEATURES | VISUAL_FEATURES | {IMAGE_STATES}
    ignored |= POSITION_FEATURES if rope_index else frozenset()
    # The decoder's start token beside the encoder's input: an encoder-decoder, its caches and encoder outputs
    # held per request (vlm_models.encoder_decoder); the check at load decides.
    ignored |= {DECODER_START}
    fields = sorted(set(_keywords(embeddings, "InputEmbeddingsFeatures")) & _feature_fields() - ignored)
    if fields:
        reason = (f"its image embeddings come with {', '.join(fields)}, which its text model needs beside them "
                  "(the generic path passes embeddings and the cache only)")  # fmt: skip
        return Architecture(name, VISION, REFUSED, reason)
    if not rope_index and re.search(r"\._(?:position_ids|rope_deltas)\s*=", code):
        reason = ("it keeps multi-axis rotary positions as state on its text model, with no get_rope_index to "
                  "compute them per request")  # fmt: skip
        return Architecture(name, VISION, REFUSED, reason)
    reason = "generic path, read off its code (get_input_embeddings, then its text model); the check at load decides"
    return Architecture(name, VISION, RUNS, reason)


_EMBEDDER_NAME = re.compile(r"embedding|^col(?=[a-z])")  # ColPali's ColQwen2.5, ColIdefics3: retrieval


def _why_not_a_generator(name: str, code: str) -> str | None:
    """Why an mlx-vlm package generates no text, read off its name and code; None for a generator.

    A package whose code has no ``language_model`` is a vision model alone (SigLIP's encoder,
    RF-DETR's and RT-DETR's detectors, SAM 3's segmenters, a decision head); an embedding or
    late-interaction retrieval model (``*embedding*``, ColPali's ``col*``) has a language model
    but returns vectors; a diffusion decoder (DiffusionGemma) generates, but a canvas at a time."""
    if _EMBEDDER_NAME.search(name):
        return "an embedding (retrieval) model: it returns vectors, not text"
    if "language_model" not in code:
        return "no language model: an image encoder, detector, segmenter or classifier"
    if _DIFFUSION_CANVAS in _config_fields(name):
        return ("a diffusion decoder (its config's canvas_length): mlx-vlm fills a masked canvas of tokens "
                "in denoising steps, not one token after another")  # fmt: skip
    return None


_DIFFUSION_CANVAS = "canvas_length"
"""A ``ModelConfig`` field of mlx-vlm's diffusion decoders (DiffusionGemma): its generation reads
it as the length of the canvas it denoises (``generate.diffusion._has_engine_diffusion_config``)."""


def _config_fields(package: str) -> set[str]:
    """The field names of the package's ``ModelConfig`` dataclass (none where it has none)."""
    config = getattr(_package_module(package), "ModelConfig", None)
    return {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()


def _bidirectional_by_default(package: str, code: str) -> object:
    """The package's text config default for ``use_bidirectional_attention`` (Gemma 4 unified's
    ``"vision"``), or True where its code sets it when a checkpoint leaves it out (PaliGemma);
    None otherwise (the check at load still reads a checkpoint's own value)."""
    if re.search(r"""\[["']use_bidirectional_attention["']\]\s*=\s*True""", code):
        return True
    text_config = getattr(_package_module(package), "TextConfig", None)
    fields = {f.name: f for f in dataclasses.fields(text_config)} if dataclasses.is_dataclass(text_config) else {}
    field = fields.get("use_bidirectional_attention")
    return field.default if field is not None and field.default is not dataclasses.MISSING else None


def _defines_method(package: str, method: str) -> bool:
    """Whether a class ``mlx_vlm.models.<package>`` exports has ``method`` (inherited ones too)."""
    module = _package_module(package)
    return module is not None and any(isinstance(v, type) and hasattr(v, method) for v in vars(module).values())


def _package_module(package: str):
    """``mlx_vlm.models.<package>``, or None where it does not import here."""
    try:
        return importlib.import_module(f"mlx_vlm.models.{package}")
    except ImportError:
        return None


def _feature_fields() -> set[str]:
    """The fields of mlx-vlm's ``InputEmbeddingsFeatures`` (what ``get_input_embeddings`` returns)."""
    try:
        from mlx_vlm.models.base import InputEmbeddingsFeatures
    except ImportError:  # no vision architectures to classify then
        return set()
    return {field.name for field in dataclasses.fields(InputEmbeddingsFeatures)}


def _package_code(name: str) -> str:
    try:
        import mlx_vlm.models
    except ImportError:  # no vision architectures to classify then
        return ""
    root = Path(mlx_vlm.models.__path__[0]) / name
    return "\n".join(path.read_text(errors="replace") for path in sorted(root.glob("*.py")))


def _method_source(package: str, cls: str, method: str) -> str | None:
    """The source of ``mlx_vlm.models.<package>.<cls>.<method>``, inherited ones included; None
    where the package, class or method is missing."""
    owner = getattr(_package_module(package), cls, None)
    try:
        return inspect.getsource(getattr(owner, method)) if owner is not None and hasattr(owner, method) else None
    except (OSError, TypeError):  # no source
        return None


def _keywords(code: str, callee: str) -> list[str]:
    """The keyword arguments of every ``callee(...)`` call in ``code``."""
    names = []
    for match in re.finditer(rf"\b{callee}\(", code):
        depth, index = 1, match.end()
        while depth and index < len(code):
            depth += {"(": 1, ")": -1}.get(code[index], 0)
            index += 1
        names += re.findall(r"(?:^|[(,\s])(\w+)\s*=(?!=)", code[match.end() : index - 1])
    return names


def classify(
    names: dict[str, Iterable[str]] | None = None, progress: Callable[[Iterable], Iterable] | None = None
) -> list[Architecture]:
    """The rows for ``names`` (``{source: [architecture, ...]}``; None: every installed one),
    text then vision, by name; tested runnable ones become ``supported``. ``progress`` wraps
    the work list (e.g. ``tqdm``). Text probes run in a child process (``ProbeWorker``): a
    model that crashes or hangs the process is recorded as unknown, and the caller's process
    never imports or builds those models."""
    if names is None:
        names = {TEXT: text_architectures(), VISION: vision_architectures()}
    work = [(source, name) for source in (TEXT, VISION) for name in sorted(names.get(source, ()), key=str.lower)]
    aliases = {source: _aliases(source) for source in (TEXT, VISION) if names.get(source)}
    rows = []
    with ProbeWorker() as worker:
        for source, name in progress(work) if progress else work:
            row = _text_row(name, worker) if source == TEXT else classify_vision(name)
            rows.append(_with_evidence(dataclasses.replace(row, aliases=aliases[source].get(name, ()))))
    return rows


def _with_evidence(row: Architecture) -> Architecture:
    """``supported`` when a test runs a runnable architecture (a tested architecture whose
    probe could not be built keeps the test's word: the test is the stronger evidence);
    ``refused`` when a test finds the engine refuses it at load (``REFUSED_AT_LOAD``)."""
    if row.source == VISION and row.status == RUNS and row.name in WHY_UNTESTED:
        return dataclasses.replace(row, detail=WHY_UNTESTED[row.name])
    missing = _missing_processor_package(row)
    if missing is not None:
        return dataclasses.replace(row, status=REFUSED, detail=missing)
    refused = REFUSED_AT_LOAD.get(row.name) if row.source == VISION and row.status == RUNS else None
    if refused is not None:
        detail = f"{refused} (refused at load: `{REFUSED_AT_LOAD_TEST}[{row.name}]`)"
        return dataclasses.replace(row, status=REFUSED, detail=detail)
    test = TESTED_ARCHITECTURES.get(row.source, {}).get(row.name)
    if test is None or row.status == REFUSED:
        return row
    detail = HELD_DETAIL if row.source == VISION and row.name in HELD_VISION else row.detail
    return dataclasses.replace(row, status=SUPPORTED, test=test, detail=detail)


def _missing_processor_package(row: Architecture) -> str | None:
    """Why ``row``'s processor cannot load in this environment (``PROCESSOR_NEEDS``: a package
    missing here), naming the test that holds the engine's ModelSourceError to it; None otherwise."""
    need = PROCESSOR_NEEDS.get(row.name) if row.source == VISION and row.status == RUNS else None
    if need is None or importlib.util.find_spec(need[0]) is not None:
        return None
    package, why, test = need
    return f"{why}; {package} is not installed here: ModelSourceError at load, saying so (`{test}`)"


# -- the cached full table -----------------------------------------------------------------------


def installed_versions() -> dict[str, str]:
    """The packages the classification depends on, and MLX's backend (a probe can fail on the
    CPU backend for a model that needs a Metal kernel)."""
    from vllm_mlx.platform.cpu_backend import describe_backend

    versions = {}
    needed = sorted({need[0] for need in PROCESSOR_NEEDS.values()})  # a processor's package: installed or not
    for package in ("mlx", "mlx-lm", "mlx-vlm", *needed):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {**versions, "backend": describe_backend()["device"]}


def all_architectures(
    progress: Callable[[Iterable], Iterable] | None = None, refresh: bool = False
) -> list[Architecture]:
    """``classify()`` of everything installed, cached until a version or our code changes."""
    from vllm_mlx.models.store import cache_root

    path = cache_root() / CACHE_FILE
    key = _cache_key()
    if not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return [Architecture(**{**row, "aliases": tuple(row["aliases"])}) for row in cached["architectures"]]
        except (ValueError, TypeError, KeyError):
            pass  # unreadable: classify again
    rows = classify(progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # another process may be writing it too
    partial.write_text(json.dumps({"key": key, "architectures": [dataclasses.asdict(r) for r in rows]}))
    partial.replace(path)
    return rows


def _cache_key() -> str:
    """Installed versions and our own source: new support in the engine reclassifies."""
    digest = hashlib.sha256(json.dumps(installed_versions(), sort_keys=True).encode())
    for path in sorted(Path(__file__).parents[1].rglob("*.py")):  # all of vllm_mlx/
        digest.update(path.read_bytes())
    return digest.hexdigest()


# -- output --------------------------------------------------------------------------------------


def counts(rows: Sequence[Architecture]) -> dict[str, dict[str, int]]:
    """``{source: {status: count}}``."""
    return {source: {s: sum(r.source == source and r.status == s for r in rows) for s in STATUSES}
            for source in (TEXT, VISION)}  # fmt: skip


def gguf_architectures(row: Architecture) -> list[str]:
    """The GGUF ``general.architecture`` values that convert to this row's mlx-lm architecture."""
    from vllm_mlx.models.gguf.architectures import ARCHITECTURES

    if row.source != TEXT:
        return []
    names = {row.name, *row.aliases}
    return [gguf.name for gguf in ARCHITECTURES.values() if gguf.model_type in names]


def format_table(rows: Sequence[Architecture]) -> str:
    """Plain text for the terminal: one line per architecture, then the counts."""
    lines = []
    for row in rows:
        name = f"{row.name} ({', '.join(row.aliases)})" if row.aliases else row.name
        why = f"{row.test}{_held_note(row)}" if row.status == SUPPORTED else row.detail
        gguf = ",".join(gguf_architectures(row)) or "-"
        lines.append(f"{row.source:8s} {name[:40]:40s} {row.status:14s} gguf:{gguf:10s} {why}")
    for source, by_status in counts(rows).items():
        if any(by_status.values()):
            lines.append(f"{source}: " + ", ".join(f"{n} {status}" for status, n in by_status.items()))
    return "\n".join(lines)


def markdown_page(rows: Sequence[Architecture]) -> str:
    """The docs page: what the statuses mean, the counts, and one table per package."""
    environment = installed_versions()
    versions = ", ".join(f"{k} {v}" for k, v in environment.items() if k != "backend")
    versions += f"; MLX backend: {environment['backend']}"
    parts = [MARKDOWN_HEAD.format(versions=versions, environment=json.dumps(environment, sort_keys=True))]
    parts.append(gguf_architecture_table())
    for source, by_status in counts(rows).items():
        summary = ", ".join(f"{n} {status}" for status, n in by_status.items())
        parts.append(f"\n## {source}\n\n{summary}.\n")
        parts.append("| architecture | also | GGUF | status | detail |\n| --- | --- | --- | --- | --- |")
        for row in (r for r in rows if r.source == source):
            detail = f"`{row.test}`{_held_note(row)}" if row.status == SUPPORTED else row.detail
            also = ", ".join(row.aliases)
            gguf = ", ".join(f"`{name}`" for name in gguf_architectures(row))
            parts.append(f"| `{row.name}` | {also} | {gguf} | {row.status} | {_cell(detail)} |")
    return "\n".join(parts) + "\n"


def gguf_architecture_table() -> str:
    """The GGUF architectures that convert, with the mlx-lm model each becomes."""
    from vllm_mlx.models.gguf.architectures import ARCHITECTURES

    rows = [f"| `{a.name}` | `{a.model_type}` | {a.families} |" for a in ARCHITECTURES.values()]
    head = "The GGUF architectures that convert:\n\n| `general.architecture` | mlx-lm model | models |\n| --- | --- | --- |"
    return "\n".join([head, *rows])


def _held_note(row: Architecture) -> str:
    """What a supported row served with per-request caches adds to its test (``HELD_DETAIL``)."""
    return f" ({HELD_DETAIL})" if row.detail == HELD_DETAIL else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


MARKDOWN_HEAD = """# Model coverage

<!-- Generated by `python -m vllm_mlx.models.support --write docs/models.md`: do not edit. -->
<!-- environment: {environment} -->

Every architecture of the installed mlx-lm and mlx-vlm ({versions}), as the paged engine sees it.
The statuses are generated, not claimed (`vllm-mlx models --supported` prints the same list):

- **supported**: a tiny random-weight model of the architecture runs in an oracle test (the test
  is named); the test suite fails if a named test does not exist.
- **runs-untested**: the engine accepts it and a probe ran (text: a tiny model built from the
  module's `ModelArgs` took one token through the paged cache; vision: a family hook takes it,
  or its code shows nothing the generic path cannot pass on, and the check at load decides), but
  no test compares its output with mlx-lm or mlx-vlm.
- **refused**: the engine refuses it at load, for the reason given.
- **not-a-generator**: it generates no text (an image encoder, detector, segmenter or
  classifier; an embedding or retrieval model), so there is nothing to serve (the reason is given).
- **unknown**: no probe could be built for it from a generic tiny config (the reason is given);
  the engine decides when it loads a real checkpoint.

Text architectures are mlx-lm's model modules; vision-language ones are mlx-vlm's packages with
a vision tower (a model directory whose config has a `vision_config` loads through mlx-vlm).

The **GGUF** column names the `general.architecture` of the GGUF files (llama.cpp's format) that
convert to the architecture (see [GGUF files](#gguf-files)). A GGUF of another architecture is
refused at load, with the list of those supported.

## GGUF files

`--model FILE.gguf` converts the file once into an MLX model directory in the cache (keyed by the
file's SHA-256, which the directory's manifest records); `vllm-mlx convert FILE.gguf DIR` writes
one where you choose, which mlx-lm loads as it is. Each tensor type becomes:

| GGUF tensor types | in the MLX directory |
| --- | --- |
| F32, F16, BF16 | the same floating-point type |
| Q4_0, Q4_1, Q4_K | 4-bit affine, groups of 32: the same numbers, re-packed bit for bit |
| Q5_0, Q5_1, Q5_K | 5-bit affine, groups of 32: the same numbers |
| Q8_0 | 8-bit affine, groups of 32: the same numbers |
| Q2_K, Q3_K, Q6_K (sub-blocks of 16, which MLX cannot group); IQ1-IQ4, TQ1_0, TQ2_0, MXFP4 (not affine) | dequantized exactly, then 8-bit affine in groups of 32: the one lossy step |

The tokenizer (byte-level BPE or SentencePiece, special and added tokens) and the chat template
come from the file's metadata. On the CPU backend the engine then runs the weights in the format
`weight_format` picks ([Configuration](configuration.md)).
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_mlx.models.support", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the Markdown page there (else print the table)")
    parser.add_argument("--refresh", action="store_true", help="classify again, ignoring the cache")
    args = parser.parse_args(argv)
    rows = all_architectures(progress=progress_bar(), refresh=args.refresh)
    if args.write:
        Path(args.write).write_text(markdown_page(rows))
    else:
        print(format_table(rows))
    return 0


def progress_bar() -> Callable[[Iterable], Iterable] | None:
    """A ``tqdm`` bar on stderr for ``classify``'s work list (None without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return lambda work: tqdm(work, desc="classifying architectures", unit="arch", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
