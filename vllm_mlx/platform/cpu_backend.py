"""Fast paths for MLX's CPU backend on Linux: an optimised BLAS and the weight format to run.

MLX's Linux CPU wheel links a reference BLAS (``mlx_cpu.libs/libblas-*.so``) and has an
unoptimised quantized-matmul kernel. Two facts follow (numbers in ``bench/cpu_formats.py``):

* ``libmlx.so`` binds ``cblas_sgemm`` dynamically, and the loader searches the global scope first.
  Loading an optimised BLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is first imported makes MLX's
  float32 matmuls run on it (a 1536x576 @ 576x64 matmul: ~14 ms -> ~0.6 ms on 2 cores).
  ``preload_fast_blas()`` does this; ``vllm_mlx/__init__.py`` calls it before any of our code can
  import mlx. It tries Intel's MKL first (PyPI's ``mkl`` wheel, our ``fast-cpu`` extra on x86_64
  Linux, or a system copy), then OpenBLAS (Debian/Ubuntu: ``libopenblas0-pthread``): MKL measured
  faster at decode shapes and as fast at prefill (``bench/blas.py``).
* MLX's quantized-matmul kernel on the CPU is slower than float32 matmul even on the bundled
  reference BLAS (float32 decodes 1.2-1.4x and prefills 1.3x faster, on the default model and on
  a 330M-parameter one), and it gains nothing from batching (~11 tok/s at batch 1, 8 or 32). With
  the optimised BLAS, float32 decodes ~2x faster single-stream, scales with the batch (~110 tok/s
  at batch 8, ~200-275 at batch 32, 2 cores) and prefills ~20x faster. bfloat16 weights (no
  BLAS: MLX's own CPU matmul) sit between: ~1.3-2x faster than the quantized kernel, ~4x slower
  than float32 on the BLAS. So on the CPU backend "auto" means float32 weights, at ~4-6x the
  memory of Q4 weights, when they fit; else bfloat16 (half that); else the quantized checkpoint
  as is. What "fits" means (the weights plus the KV pool within the memory the engine may use)
  is decided above this layer (``engine/weight_plan.py``) and handed in as ``fits``. On Metal
  (and CUDA) quantized weights stay: their kernels are the fast path there.

Switches: ``VLLM_MLX_FAST_BLAS=0`` turns the preload off; ``=mkl`` or ``=openblas`` tries that
provider first; ``=/path/to/lib.so`` tries that library first. An explicit weight format
("quantized", "float32" or "bfloat16") overrides "auto". Threads: MKL runs its sequential layer unless
``MKL_THREADING_LAYER`` says otherwise (see ``_MKL_LAYERS``); OpenBLAS uses one thread per core
unless ``OPENBLAS_NUM_THREADS`` says otherwise (on 2 cores two threads decoded as fast as or
faster than one, so it is left). When no optimised BLAS serves MLX, ``warn_reference_blas()`` prints
the command that fixes it, once per process.

This module must stay cheap to import: no mlx, numpy or torch at module level.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

__all__ = [
    "FAST_BLAS_ENV",
    "BLAS_PROVIDERS",
    "CPU_FORMATS_BY_SPEED",
    "FAST_BLAS_PATH",
    "FAST_BLAS_PROVIDER",
    "WEIGHT_FORMATS",
    "backend_summary",
    "blas_provider",
    "choose_weight_format",
    "describe_backend",
    "preload_fast_blas",
    "prepare_model_weights",
    "reference_blas_warning",
    "warn_reference_blas",
]

FAST_BLAS_ENV = "VLLM_MLX_FAST_BLAS"
WEIGHT_FORMATS = ("auto", "quantized", "float32", "bfloat16")
# What "auto" tries on the CPU backend, fastest first (see the module docstring); the last one,
# the checkpoint as it is, is also what a checkpoint without quantized weights always runs.
CPU_FORMATS_BY_SPEED = ("float32", "bfloat16", "quantized")
# Providers in the order preload_fast_blas() tries them, fastest first as measured by
# bench/blas.py (docs/benchmarks.md): on the 2-core x86_64 test machine MKL ran most of MLX's
# decode-shape matmuls 1.5-3.5x faster than OpenBLAS and prefill shapes as fast, so it goes first
# even when OpenBLAS is installed.
BLAS_PROVIDERS = ("mkl", "openblas")

# The optimised BLAS that preload_fast_blas() made global (path or soname) and its provider.
FAST_BLAS_PATH: str | None = None
FAST_BLAS_PROVIDER: str | None = None
_PRELOAD_DONE = False
_WARNED = False

# Debian/Ubuntu multiarch layout first (pthread build, then OpenMP build), then other distros.
_OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
# MKL's single dynamic library: PyPI's `mkl` wheel puts it in <prefix>/lib (a virtual
# environment's, or the user base's for `pip install --user`); Debian's libmkl-rt and oneAPI.
_MKL_RT = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
_MKL_SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/opt/intel/oneapi/mkl/latest/lib")
# MKL's threading layer. Sequential: on 2 cores two OpenMP threads were no faster at M=1 and
# slower at M=8 and 32 (bench/blas.py), and it keeps Intel's OpenMP runtime (and its spinning
# threads) out of a process that may hold GNU's (torch). MKL_THREADING_LAYER overrides it.
_MKL_LAYERS = {"intel": 0, "sequential": 1, "gnu": 3, "tbb": 4}
MKL_DEFAULT_LAYER = "sequential"


def _mkl_paths() -> list[str]:
    import site  # already imported by the interpreter's start-up: cheap

    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(site.getuserbase(), "lib")]
    dirs += _MKL_SYSTEM_DIRS
    return [os.path.join(d, name) for d in dirs for name in _MKL_RT]


def _find(provider: str) -> list[str]:
    """The existing library files of ``provider``; the loader's search only as a last resort."""
    paths = _OPENBLAS_PATHS if provider == "openblas" else _mkl_paths()
    found = [path for path in paths if os.path.exists(path)]
    if not found:
        import ctypes.util  # runs ldconfig: only when no known path exists

        name = ctypes.util.find_library("openblas" if provider == "openblas" else "mkl_rt")
        found = [name] if name else []
    return found


def _provider_of(path: str) -> str:
    name = os.path.basename(path)
    return "mkl" if "mkl" in name else "openblas" if "openblas" in name else "other"


def _candidates() -> list[tuple[str, str]]:
    """(provider, path) pairs in the order to try: ``VLLM_MLX_FAST_BLAS`` names the first."""
    setting = os.environ.get(FAST_BLAS_ENV, "").strip()
    order = list(BLAS_PROVIDERS)
    if setting.lower() in BLAS_PROVIDERS:  # a provider by name goes first
        order.remove(setting.lower())
        order.insert(0, setting.lower())
    found = [(_provider_of(setting), setting)] if os.sep in setting else []
    return found + [(provider, path) for provider in order for path in _find(provider)]


def _configure_mkl(lib: ctypes.CDLL) -> None:
    """Pick MKL's threading layer before its first call, unless the user's environment did."""
    if "MKL_THREADING_LAYER" not in os.environ:
        lib.MKL_Set_Threading_Layer(_MKL_LAYERS[MKL_DEFAULT_LAYER])


def _load(provider: str, path: str) -> bool:
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
        if provider == "mkl":
            _configure_mkl(lib)  # libmkl_rt loads its other libraries from its own directory
    except (OSError, AttributeError):
        return False
    return True


def preload_fast_blas() -> str | None:
    """Make an optimised BLAS serve MLX's CPU matmuls; return its path, or None.

    Linux only, and only before ``mlx.core`` is imported (MLX binds its BLAS symbols when it is
    loaded). Tries ``BLAS_PROVIDERS`` in order; ``VLLM_MLX_FAST_BLAS`` changes that: ``0`` turns
    it off, ``mkl`` or ``openblas`` tries that provider first, a path tries that library first.
    Cheap (no mlx/numpy import) and never raises. Idempotent: the result is remembered in
    ``FAST_BLAS_PATH`` and ``FAST_BLAS_PROVIDER``.
    """
    global FAST_BLAS_PATH, FAST_BLAS_PROVIDER, _PRELOAD_DONE
    if _PRELOAD_DONE:
        return FAST_BLAS_PATH
    try:
        if not sys.platform.startswith("linux"):
            return None
        if os.environ.get(FAST_BLAS_ENV, "").strip() == "0":
            return None
        if "mlx.core" in sys.modules:
            return None  # too late: MLX has bound its BLAS already
        _PRELOAD_DONE = True
        for provider, path in _candidates():
            if _load(provider, path):
                FAST_BLAS_PATH, FAST_BLAS_PROVIDER = path, provider
                return path
    except Exception:  # never break `import vllm_mlx` over an optimisation
        return None
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def blas_provider(symbol: str = "cblas_sgemm") -> str | None:
    """The file of the library that serves ``symbol`` in the process's global scope, or None.

    MLX's bundled BLAS is loaded locally (with ``libmlx.so``), so None after ``import mlx.core``
    means MLX uses its bundled reference BLAS; a path means a globally loaded BLAS (ours, or one
    the user put in ``LD_PRELOAD``) takes precedence. Linux/glibc only; never raises.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        process = ctypes.CDLL(None)  # lookups in it search the global scope
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p)
    except (OSError, AttributeError):
        return None  # nothing global provides the symbol
    try:
        dladdr = process.dladdr  # in libc since glibc 2.34; libdl before
    except AttributeError:
        try:
            dladdr = ctypes.CDLL("libdl.so.2").dladdr
        except (OSError, AttributeError):
            return None
    try:
        info = _DlInfo()
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.fsdecode(info.dli_fname)
    except Exception:
        return None


def _backend() -> str:
    """'metal', 'cuda' or 'cpu': where MLX runs by default. Imports mlx."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def choose_weight_format(requested: str = "auto", fits: Callable[[str], bool] | None = None) -> str:
    """The weight format to run: "quantized", "float32" or "bfloat16".

    Explicit formats are honoured (whether they fit is the caller's check). "auto" keeps
    quantized weights on Metal and CUDA. On the CPU backend it picks the fastest of
    ``CPU_FORMATS_BY_SPEED`` that ``fits`` (float32, then bfloat16, then the quantized checkpoint):
    dequantized float32 weights were measured faster than MLX's quantized CPU kernel at every
    batch size, with or without the optimised BLAS (which widens the gap from ~1.3x to 1.5-20x;
    see ``bench/cpu_formats.py``), at ~4-6x the memory of Q4 weights. Without ``fits`` (no size
    known) the CPU answer is float32; when nothing fits it is "quantized", the smallest.
    """
    if requested not in WEIGHT_FORMATS:
        allowed = ", ".join(repr(f) for f in WEIGHT_FORMATS)
        raise ValueError(f"unknown weight format {requested!r}; allowed values: {allowed}")
    if requested != "auto":
        return requested
    if _backend() != "cpu":
        return "quantized"
    if fits is None:
        return CPU_FORMATS_BY_SPEED[0]
    return next((fmt for fmt in CPU_FORMATS_BY_SPEED if fits(fmt)), "quantized")


def _is_quantized(module) -> bool:
    import mlx.nn as nn

    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return True
    return hasattr(module, "scales") and hasattr(module, "bits") and hasattr(module, "group_size")


def _weights_dtype(model) -> str:
    """The dtype name of the model's floating-point weights (the largest group by element count)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sizes: dict[str, int] = {}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            name = str(value.dtype).removeprefix("mlx.core.")
            sizes[name] = sizes.get(name, 0) + value.size
    return max(sizes, key=sizes.get) if sizes else "float32"


def prepare_model_weights(model, weight_format: str) -> str:
    """Put ``model``'s weights in ``weight_format`` in place; return the format actually used.

    "float32" and "bfloat16" dequantize every quantized layer (``QuantizedLinear``,
    ``QuantizedEmbedding`` — tied output heads go through the embedding's ``as_linear`` — and
    mlx-lm's ``QuantizedSwitchLinear``) and cast the floating-point parameters to that dtype.
    Dequantization is exact, so float32 logits only change by summation order; bfloat16 rounds
    each weight to 8 bits of mantissa. A quantized layer of a kind the model defines itself is
    kept as it is, scales included (its own code computes it). "quantized" leaves the model as it is. A model without
    quantized layers is never changed; the return value is then its weights' dtype (e.g.
    "float32", "bfloat16"). "auto" is resolved with ``choose_weight_format`` first (by speed
    only: the engine decides by memory before loading, ``engine/weight_plan.py``).

    Layers are converted one at a time, each evaluated before the next, so memory peaks at the
    converted copy plus one layer's quantized weights, not at both whole copies.
    """
    if weight_format not in WEIGHT_FORMATS:
        choose_weight_format(weight_format)  # raises the ValueError naming the allowed values
    if weight_format == "auto":
        weight_format = choose_weight_format("auto")

    names = [name for name, m in model.named_modules() if _is_quantized(m)]
    if not names:
        return _weights_dtype(model)
    if weight_format == "quantized":
        return "quantized"

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    dtype = getattr(mx, weight_format)
    for name in names:
        _dequantize_layer(model, name, dtype)
    # Layers of a quantized kind the model defines itself (PRISM's Hadamard-rotated 2-bit pack,
    # whose input is rotated before the product) stay as they are: only their own code computes them.
    kept = {id(value) for name, m in model.named_modules() if _is_quantized(m) for _, value in tree_flatten(m)}
    casts = [
        (name, value.astype(dtype))
        for name, value in tree_flatten(model.parameters())
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != dtype and id(value) not in kept
    ]
    if casts:
        model.update(tree_unflatten(casts))
    mx.eval(model.parameters())
    mx.clear_cache()
    return weight_format


def _submodule(model, name: str):
    """The module at dotted path ``name`` (lists of layers indexed by number)."""
    module = model
    for part in name.split("."):
        module = module[int(part)] if isinstance(module, list) else module[part]
    return module


def _dequantize_layer(model, name: str, dtype) -> None:
    """Replace the quantized layer at ``name`` by its float twin in ``dtype`` (as mlx-lm's
    ``dequantize_model`` builds it), evaluated at once; a layer of another kind is left for the
    caller's check. Only the path is held, never the old module, so its quantized arrays are
    freed as soon as the layer is replaced."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    module = _submodule(model, name)
    bias = "bias" in module
    if isinstance(module, nn.QuantizedLinear):
        cls, kwargs = nn.Linear, {"bias": bias}
    elif isinstance(module, nn.QuantizedEmbedding):
        cls, kwargs = nn.Embedding, {}
    elif isinstance(module, QuantizedSwitchLinear):
        cls, kwargs = SwitchLinear, {"bias": bias}
    else:
        return
    weight = mx.dequantize(
        module.weight, module.scales, module.get("biases"), module.group_size, module.bits, module.mode
    ).astype(dtype)
    replacement = cls(*weight.shape[::-1], **kwargs)  # its random init is never evaluated
    replacement.weight = weight
    if bias:
        replacement.bias = module.bias.astype(dtype)
    mx.eval(replacement.parameters())
    del module
    model.update_modules(tree_unflatten([(name, replacement)]))
    mx.clear_cache()  # the quantized buffers just freed go back to the system, not MLX's cache


def _blas_name(path: str | None) -> str:
    """'mkl', 'openblas', 'other' or 'reference': who serves MLX's cblas_sgemm (``path``)."""
    if path is None:
        return "reference"
    return FAST_BLAS_PROVIDER if path == FAST_BLAS_PATH and FAST_BLAS_PROVIDER else _provider_of(path)


def describe_backend() -> dict:
    """Where MLX runs and with what: for stats and benchmark output. Imports mlx."""
    import mlx.core as mx

    device = _backend()
    info = {
        "device": device,
        "mlx_version": mx.__version__,
        "fast_blas": FAST_BLAS_PATH,
    }
    if device == "cpu":
        path = blas_provider()
        info["blas"] = path or "bundled"
        info["blas_provider"] = _blas_name(path)
        if info["blas_provider"] == "mkl":
            info["mkl_threading"] = os.environ.get("MKL_THREADING_LAYER", MKL_DEFAULT_LAYER).lower()
    return info


def backend_summary(weight_format: str | None = None) -> str:
    """One line for start-up output: the device, the BLAS serving MLX's CPU matmuls, the weights."""
    info = describe_backend()
    parts = [f"MLX {info['mlx_version']} on {info['device']}"]
    if info["device"] == "cpu":
        names = {
            "reference": "MLX's reference BLAS (slow)",
            "mkl": f"MKL ({info.get('mkl_threading')})",
            "openblas": "OpenBLAS",
        }
        parts.append(f"BLAS: {names.get(info['blas_provider'], os.path.basename(info['blas']))}")
    if weight_format:
        parts.append(f"{weight_format} weights")
    return ", ".join(parts)


def reference_blas_warning() -> str | None:
    """The warning, with the one command that fixes it, when MLX's CPU matmuls run on its
    reference BLAS (Linux CPU backend only); None otherwise. Imports mlx."""
    info = describe_backend()
    if not sys.platform.startswith("linux") or info.get("blas_provider") != "reference":
        return None
    if os.environ.get(FAST_BLAS_ENV, "").strip() == "0":
        cause, fix = f"{FAST_BLAS_ENV}=0 turned the optimised BLAS off", f"unset {FAST_BLAS_ENV}"
    elif os.uname().machine == "x86_64":
        cause, fix = "no optimised BLAS found", "pip install mkl"
    else:  # PyPI's mkl is x86_64-only
        cause, fix = "no optimised BLAS found", "sudo apt-get install libopenblas0-pthread"
    return (
        f"warning: MLX's CPU matmuls run on its reference BLAS ({cause}): ~10-30x slower "
        f"prefill and ~2-4x slower decoding. Fix: {fix}"
    )


def warn_reference_blas() -> bool:
    """Print ``reference_blas_warning()`` to stderr, once per process; True if it printed."""
    global _WARNED
    if _WARNED:
        return False
    message = reference_blas_warning()
    if message is None:
        return False
    _WARNED = True
    print(f"vllm-mlx: {message}", file=sys.stderr, flush=True)
    return True
