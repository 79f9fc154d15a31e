"""The native CPU kernels (devices/native/), built once with torch.utils.cpp_extension.

    kernels = cpu_kernels("auto")     # the module, or None: the pure-torch path

`scripts/bootstrap.sh` builds them at set-up (`python -m devices.cpu_native`), so a server finds them
ready. The build targets one instruction-set level, `TANDEM_CPU_ARCH` (default `native`: this machine's
own; on x86 also `x86-64-v2` (SSE4.2, no AVX2), `x86-64-v3` (AVX2, FMA, F16C) and `x86-64-v4` (AVX-512),
any `-march` value GCC takes), each in its own folder under `.build/cpu_kernels/`, so that one machine can
build and test the paths of older CPUs (`TANDEM_CPU_ARCH=x86-64-v3 pytest tests/test_cpu_kernels.py`). A
level the CPU cannot run is refused with the features it lacks.

Choices, from `--cpu-kernels`: "auto" uses them when they build and says so in the log, else falls back to
pure torch with the reason; "native" insists (an error if they do not build); "torch" never loads them.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import platform
import re
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("native")
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
DEFAULT_BUILD_ROOT = Path(__file__).resolve().parents[1] / ".build" / "cpu_kernels"
BUILD_ROOT = Path(os.environ.get("TANDEM_NATIVE_BUILD_DIR", DEFAULT_BUILD_ROOT))
CHOICES = ("auto", "native", "torch")
# The x86 levels and the /proc/cpuinfo flags a CPU needs to run code built for each.
X86_LEVELS = {
    "x86-64-v2": {"sse4_2", "popcnt", "ssse3"},
    "x86-64-v3": {"sse4_2", "popcnt", "ssse3", "avx2", "fma", "f16c", "bmi2", "movbe"},
    "x86-64-v4": {"sse4_2", "popcnt", "ssse3", "avx2", "fma", "f16c", "bmi2", "movbe", "avx512f", "avx512bw",
                  "avx512cd", "avx512dq", "avx512vl"},
}
# -fno-math-errno / -fno-trapping-math let loops of floor, division and exp vectorize; they change no result.
# -ffp-contract=fast: a multiply and add are one FMA wherever the build has FMA (the products count on it).
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-Wno-psabi"]


class NativeKernelsUnavailable(RuntimeError):
    """--cpu-kernels native, but the kernels did not build or load."""


def build_arch() -> str:
    """The instruction-set level the kernels are built for (TANDEM_CPU_ARCH, default native)."""
    return os.environ.get("TANDEM_CPU_ARCH", "native").strip() or "native"


def arch_flags(arch: str) -> list[str]:
    if arch == "native" and platform.machine() in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return [f"-march={arch}"]


def build_dir(arch: str | None = None) -> Path:
    return BUILD_ROOT / re.sub(r"[^A-Za-z0-9_.+-]", "_", arch or build_arch())


def check_cpu_runs(arch: str) -> None:
    """Refuse an x86 level this CPU cannot run (its code would die on an illegal instruction)."""
    needed = X86_LEVELS.get(arch)
    if needed is None:
        return
    missing = sorted(needed - cpu_flags())
    if missing:
        raise NativeKernelsUnavailable(f"this CPU cannot run kernels built for {arch}: it lacks {', '.join(missing)}")


@functools.cache
def build() -> ModuleType:
    """Compile (or reuse the up-to-date build) and import the extension for build_arch(); raises on failure."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise NativeKernelsUnavailable("no C++ compiler (set CXX or install g++)")
    arch = build_arch()
    check_cpu_runs(arch)
    from torch.utils.cpp_extension import load

    folder = build_dir(arch)
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        log.info("building the native CPU kernels for %s in %s (once; about a minute)", arch, folder)
    name = "tandem_cpu_kernels_" + re.sub(r"[^A-Za-z0-9]", "_", arch)
    with builder_lock(folder):
        return load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=COMMON_FLAGS + arch_flags(arch),
                    extra_include_paths=[str(SOURCE_DIR)], extra_ldflags=["-fopenmp"], build_directory=str(folder),
                    verbose=False)


@contextlib.contextmanager
def builder_lock(folder: Path):
    """One builder per folder, by a lock the kernel drops when its holder dies. torch's own lock is a file
    that a build killed midway leaves behind, and every later build waits on it forever: whoever holds this
    lock is the only builder, so a `lock` file it finds is such a leftover and goes."""
    with open(folder / ".builder", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_features() -> list[str]:
    """The CPU's vector features that matter to the kernels and to torch's products."""
    names = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve")
    return [name for name in names if name in cpu_flags()]


def built_features(kernels) -> list[str]:
    """What the kernels were compiled for (not what this CPU has): their ISA extensions."""
    features = kernels.build_features()
    names = ("avx2", "fma", "avx512", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return [name for name in names if features[name]] or [f"{features['vector_bits']}-bit vectors"]


def auto_cpu_dtype(choice: str = "auto", quantization: str | None = None):
    """--dtype auto on the CPU: bfloat16 where the native kernels multiply bf16 pairs in hardware (AVX512-BF16
    or AMX: half the bytes of float32 read, and as fast or faster at every batch shape), else float32: without
    them a bf16 weight is widened to float32 as it is read, and torch's bf16 products are slow at a few rows.
    Quantized weights keep float32 activations, the path their products were measured on."""
    import torch

    if quantization is not None:
        return torch.float32
    kernels = cpu_kernels(choice)
    return torch.bfloat16 if kernels is not None and kernels.bf16_native() else torch.float32


def packed_formats(model) -> list[str]:
    """The formats of the model's packed weights: what each module that runs a native product says of
    itself (`packed_format`: NativeLinear, the quantized linears), in order, once each."""
    found = []
    for module in model.modules():
        name = module.packed_format() if hasattr(module, "packed_format") else None
        if name is not None and name not in found:
            found.append(name)
    return found


def describe_cpu_path(model, threads: int | None = None) -> str:
    """The start-up log's line: which path the layers run, where their products run, and what the build
    and the CPU offer. `threads`: the stream's (default: this thread's torch threads)."""
    import torch

    kernels = next((m.kernels for m in model.modules() if getattr(m, "kernels", None) is not None), None)
    cpu = ", ".join(cpu_features()) or "no AVX2"
    if kernels is None:
        return f"pure torch; torch {torch.__version__} products; CPU features: {cpu}"
    formats = packed_formats(model)
    products = "; ".join(f"{name} products on {kernels.product_path(name)}" for name in formats)
    threads = threads or torch.get_num_threads()
    team = f"; each layer stack in one parallel region of {threads} threads" if formats and threads > 1 else ""
    return (f"native kernels built for {build_arch()} ({', '.join(built_features(kernels))}) for norms, SwiGLU, "
            f"attention and products at every row count{'; ' + products if products else ''}{team}; "
            f"CPU features: {cpu}")


def return_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). Loading copies, stacks and packs
    every weight, and glibc keeps the freed copies' pages for later allocations of their size (its threshold
    for mapping a block apart grows with the blocks freed): a few hundred MB of a served model's memory."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()                                    # the copies cycles may still hold
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):               # not glibc: nothing to hand back this way
        return
    if trim is not None:
        trim(0)


@functools.cache
def log_fallback(reason: str) -> None:
    log.warning("native CPU kernels unavailable (%s): running the pure-torch path", reason)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build()
        print(f"native CPU kernels built for {build_arch()} in {build_dir()}")
    except Exception as error:                  # set-up goes on: the server falls back to pure torch
        print(f"warning: native CPU kernels did not build ({error}); the server will run the pure-torch path")
        raise SystemExit(1) from None
