#!/usr/bin/env bash
# The prepared check for a machine with a CUDA GPU, in under 10 minutes:
#   1. the CUDA-marked tests: graphs on and off for every speculative algorithm, lossless against plain
#      greedy decoding (tests/test_cuda_graphs.py), and overlapped EAGLE (tests/test_cuda_engine.py);
#   2. decode tok/s at concurrency 1 and 16, graphs on (the default) and off (--disable-cuda-graph), on a
#      Llama-shaped model of ~1B parameters with random weights made on the spot (bench/compare.py);
#   3. DP attention across two processes on the one GPU (bench/dp_check.py): NCCL where it allows two ranks
#      on one device, else gloo beside CUDA tensors (the JSON says which, and why), output against one engine;
#   4. everything in one JSON file: $OUT/gpu_check.json when $OUT is set, else bench/results/gpu_check.json
#      (the logs beside it, in gpu_check_logs/).
#
#   bash bench/gpu_check.sh
#
# The machine needs CUDA torch, aiohttp, uvloop and transformers. What the check needs beyond those
# (msgspec, prometheus-client, pytest, pytest-asyncio, openai) is installed, when missing, from wheels
# in ./wheels or ../wheels (or $WHEELS), without an index. Download them where there is a network, for
# the GPU machine's Python and platform, e.g.:
#   pip download -d wheels --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \
#       msgspec prometheus-client pytest pytest-asyncio openai
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULT_DIR=${OUT:-bench/results}
START=$(date +%s)
TESTS_RC="" BENCH_RC="" DP_RC=""

log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*"; }

summarize() {
  "$PY" bench/gpu_check.py summarize --out "$RESULT_DIR/gpu_check.json" --junit "$WORK/junit.xml" \
    ${TESTS_RC:+--tests-rc "$TESTS_RC"} --compare "$WORK/compare.jsonl" ${BENCH_RC:+--bench-rc "$BENCH_RC"} \
    --dp "$WORK/dp_check.json" ${DP_RC:+--dp-rc "$DP_RC"} \
    --model "$WORK/llama-1b" --seconds "$(( $(date +%s) - START ))"
  mkdir -p "$RESULT_DIR/gpu_check_logs"
  cp -r "$WORK"/*.log "$WORK/servers" "$RESULT_DIR/gpu_check_logs/" 2>/dev/null || true
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: no CUDA device visible to $PY (torch with CUDA and a GPU are needed)" >&2
  exit 2
fi
WORK=$(mktemp -d -t tandem-gpu-check-XXXX)           # the model (~2 GB) and the raw results; removed at exit
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULT_DIR"

# ---- what the check needs beyond the machine's packages, from local wheels -----------------
missing=()
for spec in msgspec:msgspec prometheus_client:prometheus-client pytest:pytest pytest_asyncio:pytest-asyncio \
            openai:openai; do
  "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  wheels=${WHEELS:-}
  for candidate in wheels ../wheels; do
    [ -z "$wheels" ] && [ -d "$candidate" ] && wheels=$candidate
  done
  if [ -z "$wheels" ]; then
    echo "error: missing ${missing[*]} and no wheels/ folder beside the checkout (see the top of $0)" >&2
    exit 2
  fi
  log "installing ${missing[*]} from $wheels"
  "$PY" -m pip install --no-index --find-links "$wheels" "${missing[@]}" || { echo "error: pip failed" >&2; exit 2; }
fi

# ---- 1. the CUDA-marked tests (graphs on and off, every algorithm) ------------------------------
log "CUDA tests"
timeout 225 env PYTHONPATH=. "$PY" -m pytest -m cuda tests/test_cuda_graphs.py tests/test_cuda_engine.py -q -rs \
  -p no:cacheprovider --junitxml "$WORK/junit.xml" 2>&1 | tee "$WORK/tests.log" | tail -20
TESTS_RC=${PIPESTATUS[0]}
log "tests exit code $TESTS_RC"
summarize >/dev/null             # a partial result even if the benchmark does not finish

# ---- 2. decode tok/s with and without graphs on a ~1B Llama with random weights -----------------
log "making the model"
"$PY" bench/gpu_check.py make-model --out "$WORK/llama-1b" --device cuda 2>&1 | tee "$WORK/model.log"
log "benchmark"
timeout 190 "$PY" bench/compare.py --model-path "$WORK/llama-1b" \
  --config "graphs=" --config "eager=--disable-cuda-graph" \
  --server-args "--device cuda --dtype bfloat16 --speculative-algorithm none --max-running-requests 32" \
  --max-concurrency 1,16 --rounds 3 --num-prompts 16 --dataset-name random --random-input-len 128 \
  --random-output-len 128 --random-range-ratio 1 --health-timeout 150 --log-dir "$WORK/servers" \
  --output-file "$WORK/compare.jsonl" 2>&1 | tee "$WORK/bench.log" | tail -25
BENCH_RC=${PIPESTATUS[0]}
log "benchmark exit code $BENCH_RC"

# ---- 3. DP attention: two ranks in two processes on the one GPU ---------------------------------
log "DP attention across two processes"
timeout 120 "$PY" bench/dp_check.py --device cuda --timeout 45 --out "$WORK/dp_check.json" 2>&1 \
  | tee "$WORK/dp.log" | tail -5
DP_RC=${PIPESTATUS[0]}
log "DP attention exit code $DP_RC"

summarize
cat "$RESULT_DIR/gpu_check.json"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$DP_RC" = 0 ]
