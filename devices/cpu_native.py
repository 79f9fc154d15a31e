"""The native CPU kernels (devices/cpu_kernels.cpp), built once with torch.utils.cpp_extension.

    kernels = cpu_kernels("auto")     # the module, or None: the pure-torch path

`scripts/bootstrap.sh` builds them at set-up (`python -m devices.cpu_native`), so a server finds
them ready; the build lives in `.build/cpu_kernels` (per machine: it is compiled for this CPU).
Choices, from `--cpu-kernels`: "auto" uses them when they build and says so in the log, else
falls back to pure torch with the reason; "native" insists (an error if they do not build);
"torch" never loads them.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
DEFAULT_BUILD_DIR = Path(__file__).resolve().parents[1] / ".build" / "cpu_kernels"
BUILD_DIR = Path(os.environ.get("TANDEM_NATIVE_BUILD_DIR", DEFAULT_BUILD_DIR))
CHOICES = ("auto", "native", "torch")
# -fno-math-errno / -fno-trapping-math let loops of floor, division and exp vectorize; they change no result.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


class NativeKernelsUnavailable(RuntimeError):
    """--cpu-kernels native, but the kernels did not build or load."""


@functools.cache
def build() -> ModuleType:
    """Compile (or reuse the up-to-date build) and import the extension; raises on failure."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise NativeKernelsUnavailable("no C++ compiler (set CXX or install g++)")
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    if not any(BUILD_DIR.glob("*.so")):
        log.info("building the native CPU kernels in %s (once; about 30 s)", BUILD_DIR)
    return load(name="tandem_cpu_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(BUILD_DIR), verbose=False)


def cpu_kernels(choice: str = "auto") -> ModuleType | None:
    """The kernels for a CPU model, or None for the pure-torch path (see the module docstring)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu kernels {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "torch":
        return None
    try:
        return build()
    except Exception as exc:                    # a missing compiler, a failed build: say why, fall back
        if choice == "native":
            raise NativeKernelsUnavailable(f"native CPU kernels unavailable: {exc}") from exc
        log_fallback(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        return None


def cpu_features() -> list[str]:
    """The CPU's vector features that matter to the kernels and to torch's products (Linux)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    have = set(flags.split(":", 1)[1].split())
    return [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if name in have]


def auto_cpu_dtype(choice: str = "auto", quantization: str | None = None):
    """--dtype auto on the CPU: bfloat16 where the native kernels multiply bf16 (AVX512-BF16), else
    float32. Measured on such a CPU (README "The CPU default dtype"): the native bf16 product reads
    half the bytes and ran a one-token forward in 0.45 ms against 0.94 in float32, and as fast or
    faster at every batch shape; its sums do not depend on the number of rows, so speculative
    verify runs keep plain greedy decoding's tokens. torch's own bf16 products (no native kernels,
    no AVX512-BF16) are slower than float32 at one row. int8 weights (--quantization) keep float32
    activations, the path their products were measured on."""
    import torch

    if quantization is not None:
        return torch.float32
    kernels = cpu_kernels(choice)
    return torch.bfloat16 if kernels is not None and kernels.HAS_BF16_PRODUCT else torch.float32


def runs_packed(model, dtype) -> bool:
    """Whether the model's weights of `dtype` run packed (NativeLinear.native_weight): bf16 as
    [N/16, K/32, 16, 16, 2] for AMX tiles, or AVX512-BF16 vectors where the CPU has no AMX
    (kernels.bf16_packed_products); float32 as [N/16, K, 16] for AVX-512 vectors."""
    import torch

    packed_dims = {torch.bfloat16: 5, torch.float32: 3}[dtype]
    weights = (getattr(m, "native_weight", None) for m in model.modules())
    return any(w is not None and w.dim() == packed_dims and w.dtype == dtype for w in weights)


def describe_cpu_path(model, threads: int | None = None) -> str:
    """The start-up log's line: which path the layers run, and what the CPU offers. `threads`: the
    stream's (default: this thread's torch threads)."""
    import torch

    kernels = next((m.kernels for m in model.modules() if getattr(m, "kernels", None) is not None), None)
    features = ", ".join(cpu_features()) or "no AVX2"
    if kernels is None:
        return f"pure torch; torch {torch.__version__} products; CPU features: {features}"
    dtypes = "float32 and bfloat16" if kernels.HAS_BF16_PRODUCT else "float32"
    packed = (f"bfloat16 weights packed for {kernels.bf16_packed_products()}" if runs_packed(model, torch.bfloat16)
              else "float32 weights packed for AVX-512 vectors" if runs_packed(model, torch.float32) else "")
    tiled = f"; {packed}, their products native at every row count" if packed else ""
    w8a8 = describe_w8a8(model, kernels)
    threads = threads or torch.get_num_threads()
    team = (f"; each layer stack in one parallel region of {threads} threads" if (packed or w8a8) and threads > 1
            else "")
    return (f"native kernels ({BUILD_DIR}) for norms, SwiGLU, attention and {dtypes} products of up to "
            f"{kernels.FLOAT_LINEAR_MAX_ROWS} rows; torch {torch.__version__} products above{tiled}"
            f"{w8a8}{team}; CPU features: {features}")


def describe_w8a8(model, kernels) -> str:
    """The log's words for --quantization w8a8_int8's products, where the model has them."""
    from engine.models.quant import W8A8Linear

    if not any(isinstance(m, W8A8Linear) for m in model.modules()):
        return ""
    where = kernels.w8a8_products()
    return f"; w8a8_int8 products (int8 activations, int32 sums) native at every row count, on {where}"


@functools.cache
def log_fallback(reason: str) -> None:
    log.warning("native CPU kernels unavailable (%s): running the pure-torch path", reason)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build()
        print(f"native CPU kernels built in {BUILD_DIR}")
    except Exception as error:                  # set-up goes on: the server falls back to pure torch
        print(f"warning: native CPU kernels did not build ({error}); the server will run the pure-torch path")
        raise SystemExit(1) from None
