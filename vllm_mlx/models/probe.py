"""Probing one mlx-lm architecture: does the paged engine run it?

``probe_text(name)`` builds the module's ``Model`` from a tiny config (``PROBE_CONFIG``'s small
sizes for the usual keys, required ``ModelArgs`` fields filled with small values of their type,
``PROBE_OVERRIDES`` for the few layer stacks a generic config cannot describe), asks
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

import dataclasses
import importlib
import json
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

RUNS, REFUSED, UNKNOWN = "runs-untested", "refused", "unknown"

# The tiny config every text probe starts from (ModelArgs.from_dict drops keys it does not know).
PROBE_CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "sliding_window": 8, "sliding_window_pattern": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
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
}  # fmt: skip
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
    from vllm_mlx.executor.attention import UnsupportedModelError, layer_specs
    from vllm_mlx.executor.model_runner import measure_kv_layout

    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except (Exception, SystemExit) as exc:  # some modules exit when an optional package is missing
        return Probe(UNKNOWN, f"the module does not import: {_reason(exc)}")
    try:
        model = build_tiny_model(module, name)
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
    try:
        layout = measure_kv_layout(model)
    except Exception as exc:
        reason = f"a one-token forward through the paged cache failed: {_reason(exc)}"
        return Probe(UNKNOWN, reason)
    kinds = [group.view(layout.dtype, num_blocks=0).kind.replace("_", " ") for group in layout.groups]
    return Probe(RUNS, " + ".join(kinds))


def build_tiny_model(module, name: str):
    """``module.Model`` from ``tiny_config``; when that fails and the args have ``layer_types``,
    once more with a stack that alternates the attention kinds the module's code names (e.g.
    sliding, full): many architectures derive their layers from that list. Raises the first
    attempt's error when both fail."""
    config = tiny_config(module, name)
    try:
        return module.Model(module.ModelArgs.from_dict(config))
    except Exception as first:
        stack = _layer_stack(module, config["num_hidden_layers"])
        if stack is None:
            raise
        try:
            return module.Model(module.ModelArgs.from_dict({**config, "layer_types": stack}))
        except Exception:
            raise first from None


def _layer_stack(module, num_layers: int) -> list[str] | None:
    """``num_layers`` layer types cycling through the ``"..._attention"`` kinds the module's source
    names (full attention last), or None when its args take no ``layer_types`` or it names none."""
    if "layer_types" not in {field.name for field in dataclasses.fields(module.ModelArgs)}:
        return None
    source = Path(module.__file__).read_text(errors="replace")
    kinds = sorted(set(re.findall(r"[\"'](\w+_attention)[\"']", source)), key=lambda k: (k == "full_attention", k))
    return [kinds[i % len(kinds)] for i in range(num_layers)] if kinds else None


def tiny_config(module, name: str, args_class=None) -> dict:
    """``PROBE_CONFIG`` and ``name``'s overrides, and a small value of the declared type for
    every other field of ``args_class`` (default ``module.ModelArgs``) without a default. A
    ``text_config`` field gets the same treatment for the module's ``TextConfig``/``TextArgs``."""
    args_class = args_class or module.ModelArgs
    config = {**PROBE_CONFIG, **PROBE_OVERRIDES.get(name, {}), "model_type": name}
    text_class = getattr(module, "TextConfig", None) or getattr(module, "TextArgs", None)
    for field in dataclasses.fields(args_class):
        if field.name == "text_config":
            nested = dataclasses.is_dataclass(text_class) and text_class is not args_class
            tiny = tiny_config(module, name, text_class) if nested else {**PROBE_CONFIG, "model_type": name}
            config[field.name] = tiny
        elif field.name not in config and _required(field):
            config[field.name] = _small_value(field.name, field.type)
    return config


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _small_value(name: str, annotation) -> object:
    text = str(annotation)
    if annotation is bool or text == "bool":
        return False
    if annotation is int or text == "int":
        return 2
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


def _reason(exc: BaseException) -> str:
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
