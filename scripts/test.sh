#!/usr/bin/env bash
# Install what is needed, then run the test suite: bash scripts/test.sh [pytest args]
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
exit "$code"
