"""Which mlx-lm and mlx-vlm architectures the paged engine runs: generated, not claimed.

Every architecture of the *installed* mlx-lm and mlx-vlm is listed with one status:

* ``supported``: a tiny-model oracle test runs it (``TESTED_ARCHITECTURES`` names the test; a
  test of ours checks that every named test exists and that the architecture still classifies
  as runnable);
* ``runs-untested``: the engine accepts it and a probe ran, but no test holds it to an oracle;
* ``refused``: the engine refuses it at load, for the reason given (a layer cache kind it does
  not page; a vision-language family without an adapter);
* ``unknown``: no probe could be built or run (the reason is given): a generic tiny config does
  not fit every architecture.

Text architectures (mlx-lm modules with ``Model`` and ``ModelArgs``) are probed: the module's
``Model`` is built from a tiny config (small sizes for the usual keys; required fields filled
by type; ``PROBE_OVERRIDES`` for the few that need structure), ``attention.layer_specs``
decides between runs and refused, and one token through the engine's own forward path
(``model_runner.measure_kv_layout``) confirms that it runs. Vision-language architectures
(mlx-vlm packages with a vision tower) run when ``vlm_models`` has an adapter for them. So
support added to ``layer_specs`` or ``vlm_models.FAMILIES`` shows up here by itself.

The classification takes ~a minute and is cached per installed versions and per our source
(``cache_root()/model_support.json``). ``python -m vllm_mlx.model_support --write
docs/models.md`` regenerates the docs page.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import pkgutil
import re
import sys
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

SUPPORTED, RUNS, REFUSED, UNKNOWN = "supported", "runs-untested", "refused", "unknown"
STATUSES = (SUPPORTED, RUNS, REFUSED, UNKNOWN)
TEXT, VISION = "mlx-lm", "mlx-vlm"

# Architecture -> the tiny-model oracle test (pytest node id) that runs it in the engine.
# Add a line with the test; tests/test_model_support.py checks every node id collects.
TESTED_ARCHITECTURES: dict[str, dict[str, str]] = {
    TEXT: {
        "llama": "tests/test_sliding_window.py::test_default_block_size_equals_mlx_lm[llama]",
        "gemma3_text": "tests/test_sliding_window.py::test_default_block_size_equals_mlx_lm[gemma3_text]",
        "gpt_oss": "tests/test_sliding_window.py::test_default_block_size_equals_mlx_lm[gpt_oss]",
        "qwen2": "tests/test_engine.py::test_another_architecture_runs_unmodified",
    },
    VISION: {
        "qwen2_vl": "tests/test_multimodal.py::test_greedy_tokens_equal_mlx_vlm[qwen2_vl]",
        "qwen2_5_vl": "tests/test_multimodal.py::test_greedy_tokens_equal_mlx_vlm[qwen2_5_vl]",
        "llava": "tests/test_multimodal.py::test_greedy_tokens_equal_mlx_vlm[llava]",
    },
}

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
    "nemotron_h": {"hybrid_override_pattern": "M*M*", "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "ssm_state_size": 8, "n_groups": 1, "conv_kernel": 4, "chunk_size": 16},
}  # fmt: skip
PROBE_MAX_PARAMETERS = 10_000_000  # a config the tiny values do not shrink is not probed
PROBE_TIMEOUT_S = 120.0
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


def classify_text(name: str) -> Architecture:
    """Build a tiny ``name`` model, ask ``layer_specs`` and run one token (see the module doc)."""
    from vllm_mlx.attention import UnsupportedModelError, layer_specs
    from vllm_mlx.model_runner import measure_kv_layout

    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except (Exception, SystemExit) as exc:  # some modules exit when an optional package is missing
        return Architecture(name, TEXT, UNKNOWN, f"the module does not import: {_reason(exc)}")
    try:
        model = module.Model(module.ModelArgs.from_dict(tiny_config(module, name)))
    except Exception as exc:
        return Architecture(name, TEXT, UNKNOWN, f"could not build a probe: {_reason(exc)}")
    size = _num_parameters(model)
    if size > PROBE_MAX_PARAMETERS:
        reason = f"could not build a probe: the tiny config still has {size:,} parameters"
        return Architecture(name, TEXT, UNKNOWN, reason)
    try:
        specs = layer_specs(model, name)
    except UnsupportedModelError as exc:
        return Architecture(name, TEXT, REFUSED, str(exc))
    if not specs:
        return Architecture(name, TEXT, UNKNOWN, "could not build a probe: the tiny config has no layers")
    try:
        layout = measure_kv_layout(model)
    except Exception as exc:
        reason = f"a one-token forward through the paged cache failed: {_reason(exc)}"
        return Architecture(name, TEXT, UNKNOWN, reason)
    kinds = [group.to_dict(num_blocks=0)["kind"].replace("_", " ") for group in layout.groups]
    return Architecture(name, TEXT, RUNS, " + ".join(kinds))


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


def classify_vision(name: str) -> Architecture:
    """Runs when a ``vlm_models`` family adapter takes the architecture; refused otherwise."""
    from vllm_mlx.vlm_models import FAMILIES, supported_model_types

    family = next((f for f in FAMILIES if name in f.model_types), None)
    if family is None:
        return Architecture(name, VISION, REFUSED, f"no adapter (adapters: {', '.join(supported_model_types())})")
    return Architecture(name, VISION, RUNS, f"adapter {family.__name__}")


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
            row = worker.classify_text(name) if source == TEXT else classify_vision(name)
            rows.append(_with_evidence(dataclasses.replace(row, aliases=aliases[source].get(name, ()))))
    return rows


class ProbeWorker:
    """A child process that runs ``classify_text`` for one name at a time (``--probe-worker``).

    Protocol: the parent writes a name per line; the child answers one JSON row per line on its
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

    def classify_text(self, name: str) -> Architecture:
        import select

        if self.process is None:
            self._start()
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], self.timeout)
        line = self.answers.readline() if ready else ""
        if line:
            return Architecture(**json.loads(line))
        how = "took longer than {:.0f} s".format(self.timeout) if not ready else "crashed the process"
        self._stop()
        return Architecture(name, TEXT, UNKNOWN, f"the probe {how}")

    def _start(self) -> None:
        import os
        import subprocess

        read_fd, write_fd = os.pipe()
        here = str(Path(__file__).resolve().parent.parent)  # this copy of vllm_mlx, installed or not
        path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm_mlx.model_support", "--probe-worker", str(write_fd)],
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


def _serve_probes(answer_fd: int) -> None:
    """The child's side of ``ProbeWorker``: a name per stdin line, a JSON row per answer line."""
    with open(answer_fd, "w") as answers:
        for line in sys.stdin:
            row = classify_text(line.strip())
            answers.write(json.dumps(dataclasses.asdict(row)) + "\n")
            answers.flush()


def _with_evidence(row: Architecture) -> Architecture:
    """``supported`` when a test runs a runnable architecture (a tested architecture whose
    probe could not be built keeps the test's word: the test is the stronger evidence)."""
    test = TESTED_ARCHITECTURES.get(row.source, {}).get(row.name)
    if test is None or row.status == REFUSED:
        return row
    return dataclasses.replace(row, status=SUPPORTED, test=test)


# -- the cached full table -----------------------------------------------------------------------


def installed_versions() -> dict[str, str]:
    """The packages the classification depends on, and MLX's backend (a probe can fail on the
    CPU backend for a model that needs a Metal kernel)."""
    from vllm_mlx.cpu_backend import describe_backend

    versions = {}
    for package in ("mlx", "mlx-lm", "mlx-vlm"):
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
    path.write_text(json.dumps({"key": key, "architectures": [dataclasses.asdict(r) for r in rows]}))
    return rows


def _cache_key() -> str:
    """Installed versions and our own source: new support in the engine reclassifies."""
    digest = hashlib.sha256(json.dumps(installed_versions(), sort_keys=True).encode())
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


# -- output --------------------------------------------------------------------------------------


def counts(rows: Sequence[Architecture]) -> dict[str, dict[str, int]]:
    """``{source: {status: count}}``."""
    return {source: {s: sum(r.source == source and r.status == s for r in rows) for s in STATUSES}
            for source in (TEXT, VISION)}  # fmt: skip


def format_table(rows: Sequence[Architecture]) -> str:
    """Plain text for the terminal: one line per architecture, then the counts."""
    lines = []
    for row in rows:
        name = f"{row.name} ({', '.join(row.aliases)})" if row.aliases else row.name
        why = row.test if row.status == SUPPORTED else row.detail
        lines.append(f"{row.source:8s} {name[:40]:40s} {row.status:14s} {why}")
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
    for source, by_status in counts(rows).items():
        summary = ", ".join(f"{n} {status}" for status, n in by_status.items())
        parts.append(f"\n## {source}\n\n{summary}.\n")
        parts.append("| architecture | also | status | detail |\n| --- | --- | --- | --- |")
        for row in (r for r in rows if r.source == source):
            detail = f"`{row.test}`" if row.status == SUPPORTED else row.detail
            also = ", ".join(row.aliases)
            parts.append(f"| `{row.name}` | {also} | {row.status} | {_cell(detail)} |")
    return "\n".join(parts) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


MARKDOWN_HEAD = """# Model coverage

<!-- Generated by `python -m vllm_mlx.model_support --write docs/models.md`: do not edit. -->
<!-- environment: {environment} -->

Every architecture of the installed mlx-lm and mlx-vlm ({versions}), as the paged engine sees it.
The statuses are generated, not claimed (`vllm-mlx models --supported` prints the same list):

- **supported**: a tiny random-weight model of the architecture runs in an oracle test (the test
  is named); the test suite fails if a named test does not exist.
- **runs-untested**: the engine accepts it and a probe ran (text: a tiny model built from the
  module's `ModelArgs` took one token through the paged cache; vision: an adapter exists), but
  no test compares its output with mlx-lm or mlx-vlm.
- **refused**: the engine refuses it at load, for the reason given.
- **unknown**: no probe could be built for it from a generic tiny config (the reason is given);
  the engine decides when it loads a real checkpoint.

Text architectures are mlx-lm's model modules; vision-language ones are mlx-vlm's packages with
a vision tower (a model directory whose config has a `vision_config` loads through mlx-vlm).
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_mlx.model_support", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the Markdown page there (else print the table)")
    parser.add_argument("--refresh", action="store_true", help="classify again, ignoring the cache")
    parser.add_argument("--probe-worker", type=int, metavar="FD", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_worker is not None:
        _serve_probes(args.probe_worker)
        return 0
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
