#!/usr/bin/env bash
# DP attention's per-step costs under load: start a server, run bench/serving.py, and print the
# deltas of the tandem_dp_* counters over the run (the exchange's time per step, the idle share).
# usage: bash bench/dp_step_cost.sh PORT [run.py flags...]   (run from the repository root)
set -euo pipefail
PORT=$1; shift
PY=${PYTHON:-.venv/bin/python}
setsid "$PY" run.py --port "$PORT" "$@" > "/tmp/tandem-dp-$PORT.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
scrape() { curl -s "127.0.0.1:$PORT/metrics" | grep -E '^tandem_dp_(sync_seconds|exchanges|steps|idle_steps|padding_tokens)_total'; }
"$PY" bench/serving.py --backend tandem --port "$PORT" --num-prompts 8 --max-concurrency 8 --disable-tqdm > /dev/null
before=$(scrape)
"$PY" bench/serving.py --backend tandem --port "$PORT" --num-prompts 64 --max-concurrency 32 --disable-tqdm \
    | grep -E "Output token throughput|Median ITL|P99 ITL|Median TTFT"
after=$(scrape)
"$PY" - "$before" "$after" <<'PYEOF'
import sys
parse = lambda text: {line.split()[0]: float(line.split()[1]) for line in text.splitlines()}
before, after = parse(sys.argv[1]), parse(sys.argv[2])
delta = {k.removeprefix("tandem_dp_").removesuffix("_total"): after[k] - before[k] for k in after}
print(f"per-step exchange: {1000 * delta['sync_seconds'] / max(delta['exchanges'], 1):.2f} ms (rank-summed "
      f"{delta['sync_seconds']:.2f} s over {delta['exchanges']:.0f} exchanges); idle steps: "
      f"{delta['idle_steps']:.0f} of {delta['steps']:.0f} ({delta['idle_steps'] / max(delta['steps'], 1):.1%}); "
      f"padding rows: {delta['padding_tokens']:.0f}")
PYEOF
