#!/usr/bin/env bash
# Make .venv with what Tandem needs (idempotent; fast when nothing changed).
# torch: the CPU build 2.13.0 when no torch is importable; any torch>=2.6 you bring is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.tandem-requirements
want=$(cat requirements.txt requirements-test.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install -q torch==2.13.0
  "$VPY" -m pip install -q -r requirements-test.txt
  echo "$want" > "$stamp"
fi
# The native CPU kernels, compiled for this machine (TANDEM_CPU_ARCH picks another level, e.g. x86-64-v3;
# the server falls back to pure torch without them).
arch=${TANDEM_CPU_ARCH:-native}
native=.build/cpu_kernels/.tandem-source-$arch
want_native=$(cat devices/native/* devices/cpu_native.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$native" 2>/dev/null)" != "$want_native" ]; then
  mkdir -p .build/cpu_kernels
  PYTHONPATH=. TANDEM_CPU_ARCH=$arch "$VPY" -m devices.cpu_native && echo "$want_native" > "$native"
fi
