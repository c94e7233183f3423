"""Probing one mlx-lm architecture: does the paged engine run it?

``probe_text(name)`` builds the module's ``Model`` from a tiny config (``PROBE_CONFIG``'s small
sizes for the usual keys, required ``ModelArgs`` fields filled with small values of their type,
``PROBE_OVERRIDES`` for the few layer stacks a generic config cannot describe, and the config
repaired from the model's own code where building fails: ``repair_config``), asks
``attention.layer_specs`` (refused: a cache kind the engine does not page), and runs one token
through the engine's own forward path (``model_runner.measure_kv_layout``). Every failure to
build or run the probe is an ``unknown`` with its reason: it says nothing about a real
checkpoint, only that this generic probe does not fit.

Model code is foreign: a module may exit on import, a kernel may crash the process, a config may
build a huge model. So ``ProbeWorker`` runs the probes in a child process (``python -m
vllm_mlx.models.probe FD``), and models too large for a probe are never allocated (MLX is lazy:
the parameter count is known before any memory is).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

RUNS, REFUSED, UNKNOWN = "runs-untested", "refused", "unknown"

# The tiny config every text probe starts from (ModelArgs.from_dict drops keys it does not know).
PROBE_CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256, "n_positions": 256,
    "n_ctx": 256,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "sliding_window": 8, "sliding_window_pattern": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 4,
    "swa_head_dim": 16, "swa_v_head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "partial_rotary_factor": 1.0,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # The same sizes under the other names configs give them (GPT-2's n_embd, DBRX's d_model, ...).
    "n_embd": 64, "d_model": 64, "model_dim": 64, "hidden_dim": 64, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "n_layer": 4, "n_layers": 4, "num_layers": 4, "n_kv_heads": 2, "num_kv_heads": 2, "num_vocab": 128,
    "kv_channels": 16, "rotary_dim": 8, "n_shared_head": 2, "global_head_dim": 32, "intermediate_size_mlp": 128,
    "attention_window_size": 8, "attention_chunk_size": 8, "num_experts_per_token": 2,
    "num_kv_shared_layers": 2, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16,
}  # fmt: skip
# Architectures whose layer stack the generic config cannot describe.
PROBE_OVERRIDES: dict[str, dict] = {
    "lfm2": {"full_attn_idxs": [1, 3], "conv_L_cache": 3, "conv_bias": False, "block_dim": 64,
             "block_ff_dim": 128, "block_multiple_of": 16, "block_auto_adjust_ff_dim": False},
    "lfm2_moe": {"full_attn_idxs": [1, 3], "conv_L_cache": 3, "conv_bias": False, "num_dense_layers": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 16, "mamba_expand": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
                         "mamba_n_groups": 1, "shared_intermediate_size": 128, "position_embedding_type": "rope"},
    "nemotron_h": {"hybrid_override_pattern": "M*M*", "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "ssm_state_size": 8, "n_groups": 1, "conv_kernel": 4, "chunk_size": 16},
    # transformers checks hidden_size * expand (2) == num_heads * head_dim when the directory loads.
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1, "conv_kernel": 4,
               "time_step_limit": [0.0, 1000.0]},
    # Its sanitize adds lm_head.weight whatever tie_word_embeddings says: a tied model does not load.
    "minicpm": {"tie_word_embeddings": False},
    "baichuan_m1": {"tie_word_embeddings": False},  # its __call__ uses lm_head whatever that says
    "gemma3n": {"activation_sparsity_pattern": [0.0] * 4, "final_logit_softcapping": 30.0},  # 0: dense
    # A string of L (local) and G (global) layers, as EXAONE 4.0's own config writes it.
    # (transformers derives layer_types from the pattern as a number unless they are given, as they are).
    "exaone4": {"sliding_window_pattern": "LLLG", "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    # Muse Spark: transformers checks, when the tokenizer's config loads, that the audio encoder's
    # output width (8192 by default) is the text model's hidden size. A layer of RoPE theta 0 has
    # no RoPE (its own kernel, qk_norm): the checkpoint mixes both kinds, so does the probe.
    "muse_spark": {"audio_config": {"out_hidden_size": 64},
                   "text_config": {"layer_rope_theta": [10000.0, 10000.0, 10000.0, 0.0]}},
    # A Hadamard-rotated 2-bit pack: one packed layer, its input 512 wide so that a rotation block fits.
    "prism_hadamard_qwen35": {
        "schema_version": 1, "tensor_namespace": "mlx-lm-text", "quantization": {"bits": 2, "group_size": 128,
        "mode": "affine"}, "text_config": {"shared_expert_intermediate_size": 512},
        "modules": [{"path": "model.layers.3.mlp.shared_expert.down_proj", "embedding": False, "dtype": "float16",
                     "block": 512}],
    },
    # Its logits mask the ids 100256..100351 (Phi-3-small's dummy tokens) by index: a smaller vocabulary is
    # written out of bounds (memory corruption, "double free or corruption"). Tied: 6.4M parameters.
    "phi3small": {"vocab_size": 100352},
    "dbrx": {"tie_word_embeddings": False},  # transformers' DbrxConfig refuses tied embeddings
    # Its sanitize reads lm_head whatever its text model's tie_word_embeddings says.
    "qwen3_vl_moe": {"text_config": {"tie_word_embeddings": False}},
    # Griffin's stack is a list of block kinds (its code cycles through it), recurrent and local attention.
    # Gemma's soft cap (30): the generic 1.0 squeezes the logits into near-ties that greedy choices flip on.
    "recurrent_gemma": {"block_types": ["recurrent", "recurrent", "attention"], "conv1d_width": 4,
                        "logits_soft_cap": 30.0},
    # One block config per layer (each its own attention and FFN sizes), as Nemotron-NAS configs have.
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}}] * 4},
}  # fmt: skip
# mlx-lm modules that exit on import unless a package is installed that their code never calls (an
# availability check): the module it would import -> the package a user installs. The probe stands an
# empty module in for it, so the architecture itself is probed; its row says what to install.
IMPORT_GATES: dict[str, tuple[str, str]] = {"olmo": ("hf_olmo", "ai2-olmo")}
PROBE_MAX_PARAMETERS = 10_000_000  # a config the tiny values do not shrink is not probed
PROBE_TIMEOUT_S = 120.0
CRASHED = "the probe crashed the process"


@dataclass(frozen=True)
class Probe:
    """What a probe found: ``status`` (RUNS, REFUSED or UNKNOWN) and ``detail``, the layer kinds
    (e.g. "sliding window + full attention") or the reason."""

    status: str
    detail: str


def probe_text(name: str) -> Probe:
    """Build a tiny ``name`` model, ask ``layer_specs`` and run one token (see the module doc)."""
    from vllm_mlx.core.kv.spec import is_held
    from vllm_mlx.executor.attention import UnsupportedModelError, layer_specs
    from vllm_mlx.executor.model_runner import measure_kv_layout

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), stand_in_for_import_gate(name):
            module = importlib.import_module(f"mlx_lm.models.{name}")
    except (Exception, SystemExit) as exc:  # some modules exit when an optional package is missing
        said = printed.getvalue().strip().splitlines()  # what the module printed before it exited
        return Probe(UNKNOWN, f"the module does not import: {_reason(exc)}" + (f" ({said[-1]})" if said else ""))
    try:
        model = build_tiny_model(module, name).model
    except Exception as exc:
        return Probe(UNKNOWN, f"could not build a probe: {_reason(exc)}")
    size = _num_parameters(model)
    if size > PROBE_MAX_PARAMETERS:
        reason = f"could not build a probe: the tiny config still has {size:,} parameters"
        return Probe(UNKNOWN, reason)
    try:
        specs = layer_specs(model, name)
    except UnsupportedModelError as exc:
        return Probe(REFUSED, str(exc))
    if not specs:
        return Probe(UNKNOWN, "could not build a probe: the tiny config has no layers")
    if is_held(specs):
        return _probe_held(model)
    try:
        layout = measure_kv_layout(model)
    except Exception as exc:
        reason = f"a one-token forward through the paged cache failed: {_reason(exc)}"
        return Probe(UNKNOWN, reason)
    kinds = [group.view(layout.dtype, num_blocks=0).kind.replace("_", " ") for group in layout.groups]
    gate = IMPORT_GATES.get(name)
    needs = f" (mlx-lm imports it only where {gate[1]} is installed: pip install {gate[1]})" if gate else ""
    return Probe(RUNS, " + ".join(kinds) + needs)


HELD_DETAIL = "per-request cache: no prefix caching"
"""The detail of a model whose caches the engine holds per request (``executor/held_caches.py``)."""


def _probe_held(model) -> Probe:
    """A held-cache model's probe: its caches measured (``PROBE_TOKENS`` tokens through them)."""
    from vllm_mlx.executor.held_caches import measure_held

    try:
        measure_held(model)
    except Exception as exc:  # foreign model code: any failure is an unknown, as the paged probe's
        return Probe(UNKNOWN, f"a forward through the model's own caches failed: {_reason(exc)}")
    return Probe(RUNS, HELD_DETAIL)


@contextlib.contextmanager
def stand_in_for_import_gate(name: str):
    """An empty module in ``sys.modules`` for the package ``name``'s import gate checks
    (``IMPORT_GATES``) while the block runs, where that package does not import; nothing otherwise."""
    gate = IMPORT_GATES.get(name)
    if gate is None or gate[0] in sys.modules or importlib.util.find_spec(gate[0]) is not None:
        yield
        return
    sys.modules[gate[0]] = types.ModuleType(gate[0])
    try:
        yield
    finally:
        del sys.modules[gate[0]]


MAX_REPAIRS = 8
"""Repairs of the tiny config ``build_tiny_model`` tries, one per failure, before it gives up."""


@dataclass
class TinyModel:
    """A tiny random-weight model and the config that built it (``config.json`` of a directory
    mlx-lm loads it from)."""

    model: typing.Any  # mlx.nn.Module; mlx is imported lazily here
    config: dict


def build_tiny_model(module, name: str) -> TinyModel:
    """``module.Model`` from ``tiny_config``, repaired from each failure the model's own code gives
    (``repair_config``: a config dict it reads a key of, a per-layer list it indexes), up to
    ``MAX_REPAIRS`` times; when the args have ``layer_types``, each attempt is tried once more with
    a stack that alternates the attention kinds the module's code names (e.g. sliding, full): many
    architectures derive their layers from that list. Raises the first attempt's error when
    nothing builds (the last, where the repairs got as far as a kernel only Metal has)."""
    config = tiny_config(module, name)
    first = None
    for _ in range(MAX_REPAIRS + 1):
        try:
            return _build(module, config)
        except Exception as exc:
            first = first or exc
            config = repair_config(module, config, exc)
            if config is None:  # the config is not what stops a Metal-only kernel: say that
                raise (exc if _NO_METAL in str(exc) else first) from None
    raise first


def _build(module, config: dict) -> TinyModel:
    try:
        return _built_and_run(module, config)
    except Exception:
        stack = _layer_stack(module, config["num_hidden_layers"])
        if stack is None or config.get("layer_types") == stack:
            raise
        try:
            return _built_and_run(module, {**config, "layer_types": stack})
        except Exception:
            pass
        raise


def _built_and_run(module, config: dict) -> TinyModel:
    """The model of ``config``, once it took a token with mlx-lm's own caches: some models read
    a field only in their forward (e.g. a scale set only when its flag is on), and a config
    that builds but cannot run says nothing of the paged engine. Too large a model is returned
    unrun (the caller refuses it, and MLX has allocated nothing yet)."""
    import mlx.core as mx

    from vllm_mlx.models.portable_layers import make_portable

    model = module.Model(module.ModelArgs.from_dict(config))
    make_portable(model)  # as load_model does: Metal kernels (BitNet, Muse Spark), on a backend without Metal
    if _num_parameters(model) <= PROBE_MAX_PARAMETERS:
        make_cache = getattr(model, "make_cache", None)
        mx.eval(model(mx.array([[1]]), cache=make_cache() if make_cache is not None else None))
    return TinyModel(model, config)


_KEY_READ = re.compile(r"\b(\w+)(?:\[[\"'](\w+)[\"']\]|\.get\([\"'](\w+)[\"'])")
_LAYER_INDEX = re.compile(r"\b(\w+)\[(?:\w*(?:idx|layer|_id|\bi\b|\bj\b)\w*)\]")


def repair_config(module, config: dict, exc: Exception) -> dict | None:
    """``config`` with what the failing line of the model's code asked of it and did not find;
    None when that line reads nothing of the config we can fill. A field of the text model's
    config (``text_config``) is repaired there.

    * a config dict read by key (``args.rope_scaling["alpha"]``, ``config.rope_scaling.get(...)``)
      while the field is None or lacks the key, or a check that names the keys it wants
      (``rope_scaling must contain keys {'type', 'factor'}``): the keys, with small values for
      their names;
    * a per-layer list indexed by a layer (``args.layer_types[layer_idx]``) that is None or too
      short: one entry per layer (the module's attention kinds for ``layer_types``, else its
      present entries repeated, else a small value for its name);
    * a check of a field against a literal (``assert config.topk_method == "noaux_tc"``, or
      ``assert self.top_k == 1`` after ``self.top_k = args.num_experts_per_tok``): that literal;
    * a check that names the layer kinds missing from a RoPE dict (``Missing RoPE parameters for
      layer types: [...]``), or a RoPE dict read by a layer kind: default RoPE for each kind;
    * an attribute the model sets only when a flag of the config is on (``if args.scale_q:
      self.scale_q = ...``, read unconditionally): the flag on.

    A name the failing function bound to a config field (``cfg = args.linear_attn_config``) counts
    as that field.
    """
    text_class = getattr(module, "TextConfig", None) or getattr(module, "TextArgs", None)
    text_module = module
    if not dataclasses.is_dataclass(text_class) and (sibling := _text_module(module)) is not None:
        text_module, text_class = sibling, sibling.ModelArgs  # ``lfm2.ModelArgs.from_dict(args.text_config)``
    if isinstance(config.get("text_config"), dict) and dataclasses.is_dataclass(text_class):
        nested = _repair(text_module, text_class, config["text_config"], exc)
        if nested is not None:
            return {**config, "text_config": nested}
    return _repair(module, module.ModelArgs, config, exc)


def _repair(module, args_class, config: dict, exc: Exception) -> dict | None:
    fields = {field.name: field for field in dataclasses.fields(args_class)}
    line = _failing_line(exc)
    aliases = _aliases(exc)  # ``cfg = args.linear_attn_config`` above the failing ``cfg["num_heads"]``
    if isinstance(exc, (TypeError, AttributeError, KeyError)):
        reads = [(field, key or got) for field, key, got in _KEY_READ.findall(line)]
        if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):  # the key on the next line
            reads += [(field, exc.args[0]) for field in re.findall(r"\b(\w+)\[\s*$", line)]
            # or a key held in a variable: ``args.rope_parameters[layer_type]``
            reads += [(field, exc.args[0]) for field in re.findall(r"\b(\w+)\[[a-z_]\w*\]", line)]
        if isinstance(exc, AttributeError) and "'NoneType' object has no attribute 'get'" in str(exc):
            reads += [(field, None) for field in re.findall(r"\b(\w+)\.get\(", line)]
        for field, key in reads:
            field = field if field in fields else aliases.get(field, field)
            present = config.get(field)
            if field in fields and isinstance(present, (dict, type(None))) and (present is None or key not in present):
                return {**config, field: {**(present or {}), **({key: _small_value_for(key, field)} if key else {})}}
    missing = re.search(r"has no attribute '(\w+)'", str(exc)) if isinstance(exc, AttributeError) else None
    if missing and missing[1] in fields and config.get(missing[1]) is False:  # set only when the flag is on
        return {**config, missing[1]: True}
    if isinstance(exc, (IndexError, TypeError)):
        for field in _LAYER_INDEX.findall(line):
            entries = config.get(field)
            if field in fields and not (isinstance(entries, list) and len(entries) >= config["num_hidden_layers"]):
                return {**config, field: _per_layer(module, fields[field], config)}
    if isinstance(exc, (AssertionError, ValueError)):
        for field, literal in _LITERAL_CHECK.findall(line):
            field = field if field in fields else aliases.get(field, field)
            literal = ast.literal_eval(literal) if literal[0] not in "\"'" else literal[1:-1]
            if field in fields and config.get(field) != literal:
                return {**config, field: literal}
        kinds = re.findall(r"[\"'](\w+_attention)[\"']", str(exc))
        rope = [field for field in fields if "rope" in field and isinstance(config.get(field), (dict, type(None)))]
        if kinds and rope and "rope" in str(exc).lower():  # ``Missing RoPE parameters for layer types: [...]``
            present = config.get(rope[0]) or {}
            return {**config, rope[0]: {**present, **{kind: _small_value_for(kind, rope[0]) for kind in kinds}}}
        for field, value in _INDEX_OF.findall(line):  # ``layers.index("sliding_attention")`` found none
            entries = config.get(field)
            if field in fields and isinstance(entries, list) and entries and str(exc).endswith("is not in list"):
                value = ast.literal_eval(value)
                if value not in entries:
                    return {**config, field: [value, *entries[1:]]}
        wanted = _KEY_SET.search(str(exc))
        named = [field for field in fields if field in str(exc) and isinstance(config.get(field), (dict, type(None)))]
        if wanted and named:
            keys = re.findall(r"[\"'](\w+)[\"']", wanted.group(0))
            present = config.get(named[0]) or {}
            if any(key not in present for key in keys):
                return {**config, named[0]: {**present, **{k: _small_value_for(k) for k in keys if k not in present}}}
    return None


_INDEX_OF = re.compile(r"\b(\w+)\.index\(([\"']?[\w.-]+[\"']?)\)")
_LITERAL_CHECK = re.compile(r"\b\w+\.(\w+)\s*==\s*([\"'][\w.-]+[\"']|\d+(?:\.\d+)?\b)")
_KEY_SET = re.compile(r"\{\s*[\"']\w+[\"'](?:\s*,\s*[\"']\w+[\"'])*\s*\}")


def _failing_line(exc: Exception) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].line or "" if frames else ""


def _aliases(exc: Exception) -> dict[str, str]:
    """Names the failing function gave config fields before its failing line: ``cfg =
    args.linear_attn_config`` (cfg -> linear_attn_config), ``self.top_k = args.num_experts_per_tok``
    (top_k -> num_experts_per_tok)."""
    import linecache
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return {}
    frame = frames[-1]
    lines = [linecache.getline(frame.filename, n) for n in range(max(1, frame.lineno - 40), frame.lineno)]
    start = max((i for i, text in enumerate(lines) if re.match(r"\s*def ", text)), default=0)
    found = {}
    for text in lines[start:]:
        assigned = re.match(r"\s*(?:self\.)?(\w+)\s*=\s*(?:self\.)?(?:args|config|cfg|params)\.(\w+)\s*$", text)
        if assigned:
            found[assigned[1]] = assigned[2]
    return found


def _per_layer(module, field: dataclasses.Field, config: dict) -> list:
    layers = config["num_hidden_layers"]
    kinds = _attention_kinds(module) if field.name == "layer_types" else []
    if kinds:
        return [kinds[i % len(kinds)] for i in range(layers)]
    present = config.get(field.name)
    if present is None and field.default_factory is not dataclasses.MISSING:
        present = field.default_factory()
    elif present is None:
        present = field.default
    if not (isinstance(present, (list, tuple)) and present):
        small = _small_value_for(field.name)
        present = small if isinstance(small, list) else [small]
    return [present[i % len(present)] for i in range(layers)]


def _small_value_for(name: str, container: str = "") -> object:
    """A small value for a config key, guessed from its name (and the name of the config dict
    ``container`` it is a key of: a layer kind's RoPE parameters are a dict)."""
    name = name.lower()
    if name.endswith("_attention") and "rope" in container:  # ``rope_parameters["sliding_attention"]``
        return {"rope_type": "default", "rope_theta": PROBE_CONFIG["rope_theta"]}
    if name in PROBE_CONFIG:
        return PROBE_CONFIG[name]
    if "experts" in name:
        return PROBE_CONFIG["num_experts"]
    if "top_k" in name or "topk" in name:
        return PROBE_CONFIG["num_experts_per_tok"]
    if "heads" in name:
        return PROBE_CONFIG["num_key_value_heads" if "kv" in name else "num_attention_heads"]
    if "theta" in name:
        return 10000.0
    if name.endswith("type"):
        return "default"
    if name.endswith("layers"):
        return [1, 3]
    if "max_position" in name:
        return 256
    if any(word in name for word in ("size", "dim", "hidden")):
        return 64
    if any(word in name for word in ("factor", "alpha", "beta", "scale")):
        return 1.0
    return 1


def _layer_stack(module, num_layers: int) -> list[str] | None:
    """``num_layers`` layer types cycling through the ``"..._attention"`` kinds the module's source
    names (full attention last), or None when its args take no ``layer_types`` or it names none."""
    if "layer_types" not in {field.name for field in dataclasses.fields(module.ModelArgs)}:
        return None
    kinds = _attention_kinds(module)
    return [kinds[i % len(kinds)] for i in range(num_layers)] if kinds else None


def _attention_kinds(module) -> list[str]:
    """The ``"..._attention"`` layer kinds the module's source names, full attention last."""
    source = Path(module.__file__).read_text(errors="replace")
    return sorted(set(re.findall(r"[\"'](\w+_attention)[\"']", source)), key=lambda k: (k == "full_attention", k))


def tiny_config(module, name: str, args_class=None) -> dict:
    """``PROBE_CONFIG`` and ``name``'s overrides, and a small value of the declared type for
    every other field of ``args_class`` (default ``module.ModelArgs``) without a default (a
    required ``layer_...`` list: one entry a layer). A ``PROBE_CONFIG`` number is left out where
    the field is declared a list, string or dict. A ``text_config`` field gets the same treatment
    for the module's ``TextConfig``/``TextArgs``, or for the sibling module a wrapper builds its
    text model with (``lfm2.ModelArgs.from_dict(args.text_config)``); an override's
    ``text_config`` entries are merged into it."""
    args_class = args_class or module.ModelArgs
    fields = {field.name: field for field in dataclasses.fields(args_class)}
    generic = {k: v for k, v in PROBE_CONFIG.items() if k not in fields or _fits(v, fields[k].type)}
    config = {**generic, **PROBE_OVERRIDES.get(name, {}), "model_type": name}
    text_class = getattr(module, "TextConfig", None) or getattr(module, "TextArgs", None)
    for field in fields.values():
        if field.name == "text_config":
            nested = dataclasses.is_dataclass(text_class) and text_class is not args_class
            sibling = None if nested else _text_module(module)
            if nested:
                tiny = tiny_config(module, name, text_class)
            elif sibling is not None:  # ``lfm2.ModelArgs.from_dict(args.text_config)``: that module's config
                tiny = tiny_config(sibling, sibling.__name__.rpartition(".")[2])
            else:
                tiny = {**PROBE_CONFIG, "model_type": name}
            config[field.name] = {**tiny, **PROBE_OVERRIDES.get(name, {}).get("text_config", {})}
        elif field.name not in config and _required(field):
            config[field.name] = _small_value(field.name, field.type)
            if field.name.startswith("layer_") and config[field.name] == []:  # per-layer: one entry a layer
                config[field.name] = _per_layer(module, field, config)
    return config


def _fits(value, annotation) -> bool:
    """False when ``value`` (a ``PROBE_CONFIG`` number) is plainly not of the field's declared
    type: a field named like a size that holds a per-layer list (OpenELM's ``num_kv_heads``) or a
    string (EXAONE 4's ``sliding_window_pattern``)."""
    text = str(annotation).lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return not re.match(r"^(typing\.)?(optional\[)?(list|tuple|str|dict)\b", text.replace("<class '", ""))
    return True


def _text_module(module):
    """The sibling module whose ``ModelArgs`` a wrapper builds its text model from
    (``lfm2.ModelArgs.from_dict(args.text_config)``), or None."""
    source = Path(module.__file__).read_text(errors="replace")
    found = re.search(r"\b(\w+)\.ModelArgs\.from_dict\(\s*\w+\.text_config", source)
    sibling = getattr(module, found[1], None) if found else None
    return sibling if isinstance(sibling, types.ModuleType) and hasattr(sibling, "ModelArgs") else None


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _small_value(name: str, annotation) -> object:
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    if members:  # ``int | str``: a number where one is allowed (a string field's "" is rarely valid)
        ranked = sorted((m for m in members if m is not type(None)), key=lambda m: m not in (int, float, bool))
        return _small_value(name, ranked[0]) if ranked else None
    text = str(annotation)
    if annotation is bool or text == "bool":
        return False
    if annotation is int or text == "int":
        if "vocab" in name:  # a second vocabulary (Gemma 3n's per-layer inputs) takes the same ids
            return PROBE_CONFIG["vocab_size"]
        return 0 if name.endswith(("idx", "index")) else 2
    if annotation is float or text == "float":
        return 1e-5 if "eps" in name else 1.0
    if annotation is str or text == "str":
        return ""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple) or text.lower().startswith(("list", "tuple")):
        return []
    if origin is dict or text.lower().startswith("dict"):
        return {}
    return None


def _num_parameters(model) -> int:
    from mlx.utils import tree_flatten

    return sum(value.size for _, value in tree_flatten(model.parameters()))  # lazy: nothing allocated


_NO_METAL = "No Metal back-end"  # what mx.fast.metal_kernel raises on another backend


def _reason(exc: BaseException) -> str:
    if _NO_METAL in str(exc):  # mx.fast.metal_kernel: a kernel of the model's own
        return "its code runs a Metal kernel of its own, which this MLX backend has not (probe it on Apple silicon)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__


class ProbeWorker:
    """A child process that runs ``probe_text`` for one name at a time.

    Protocol: the parent writes a name per line; the child answers one JSON ``Probe`` per line on its
    own pipe (module imports may print to stdout, so the child's stdout and stderr are dropped).
    A child that dies or stays silent for ``timeout`` seconds is replaced, and the name is
    recorded as unknown with what happened.
    """

    def __init__(self, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.process = None

    def __enter__(self) -> ProbeWorker:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def probe(self, name: str) -> Probe:
        """``probe_text(name)``, run in the child (started on first use, again after a failure).

        A crash is retried once in a fresh child, since the model before may have left the
        child broken (and some crashes are intermittent: both attempts are reported)."""
        first = self._ask(name)
        if first.detail != CRASHED:
            return first
        second = self._ask(name)
        if second.detail == CRASHED:
            return Probe(UNKNOWN, f"{CRASHED} (twice)")
        return Probe(second.status, f"{second.detail} (a first attempt {CRASHED.removeprefix('the probe ')})")

    def _ask(self, name: str) -> Probe:
        import select

        if self.process is None:
            self._start()
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], self.timeout)
        line = self.answers.readline() if ready else ""
        if line:
            return Probe(**json.loads(line))
        self._stop()
        return Probe(UNKNOWN, f"the probe took longer than {self.timeout:.0f} s" if not ready else CRASHED)

    def _start(self) -> None:
        import os
        import subprocess

        read_fd, write_fd = os.pipe()
        here = str(Path(__file__).resolve().parents[2])  # this copy of vllm_mlx, installed or not
        path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm_mlx.models.probe", str(write_fd)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(write_fd,), text=True, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        os.close(write_fd)
        self.answers = os.fdopen(read_fd)

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.answers.close()
            self.process = None


def serve(answer_fd: int) -> None:
    """The child's side of ``ProbeWorker``: a name per stdin line, a JSON ``Probe`` per line."""
    with open(answer_fd, "w") as answers:
        for line in sys.stdin:
            probe = probe_text(line.strip())
            answers.write(json.dumps(dataclasses.asdict(probe)) + "\n")
            answers.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
