#!/usr/bin/env bash
# Install what is needed, then serve the embedded model: bash scripts/serve.sh [run.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python run.py "$@"
