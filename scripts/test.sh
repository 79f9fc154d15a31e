#!/usr/bin/env bash
# Install what is needed, then run the test suite: bash scripts/test.sh [pytest args]
# On an x86 CPU with AVX-512 the kernel tests run a second time on kernels built for x86-64-v3 (AVX2),
# with torch held to AVX2 as well, so the paths of AVX2-only CPUs are tested here too (TANDEM_LEVELS
# overrides the extra levels: a space-separated list, or "" for none).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh || exit 1
.venv/bin/ruff check . || { echo "error: ruff check failed (configuration in pyproject.toml)" >&2; exit 1; }
PYTHONPATH=. .venv/bin/python -m pytest "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
default_levels=""
if [ "$(uname -m)" = x86_64 ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null; then default_levels="x86-64-v3"; fi
for level in ${TANDEM_LEVELS-$default_levels}; do
  case $level in              # torch held to the same level: ATen's kernels and oneDNN's
    x86-64-v2) torch_level="ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41" ;;
    x86-64-v3) torch_level="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" ;;
    *) torch_level="" ;;
  esac
  echo "== kernel tests on kernels built for $level ($torch_level)"
  TANDEM_CPU_ARCH=$level bash scripts/bootstrap.sh || exit 1
  env TANDEM_CPU_ARCH="$level" $torch_level PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_cpu_kernels.py \
    tests/test_quant.py tests/test_bench.py -k "cpu or quant or verify_rows or draft_chain or perplexity" || code=1
done
exit "$code"
