#!/usr/bin/env bash
# Installs Debian's `prometheus` package (the server and promtool) for the metrics checks
# (tests/telemetry/test_prometheus_live.py, tests/telemetry/test_alert_rules.py). Debian/Ubuntu
# only; quick when both commands are present; never leaves the packaged service running (the
# tests start their own server on a free port).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-prometheus: no apt-get here (not Debian/Ubuntu); install prometheus yourself" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "install-prometheus: not root and no password-less sudo" >&2
    exit 1
  fi
fi
# policy-rc.d answering 101 keeps the package's init script from starting the service.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=""
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod +x "$POLICY"
  ADDED_POLICY=1
fi
trap '[ -n "$ADDED_POLICY" ] && $SUDO rm -f "$POLICY"' EXIT
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# A service started anyway (a system with systemd): stop it, the tests run their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl stop prometheus || true
  $SUDO systemctl disable prometheus >/dev/null 2>&1 || true
fi
command -v prometheus >/dev/null && command -v promtool >/dev/null
