#!/usr/bin/env bash
# End-to-end check of the operator on a real Kubernetes cluster (kind, or any cluster such as k3s
# that the current kubeconfig points at): build the image, install the Helm chart with its own
# NATS, apply examples/wavepipeline.yaml, and wait until the pipeline's Ready condition is True.
#
# It cannot run on the project's CI machines (no Docker engine, no API server); it is for users
# and for CI that has Docker. See docs/operator.md for what runs where.
#
# Needs: docker, kind (unless USE_EXISTING_CLUSTER=1), kubectl, npm (for helm).
# Environment:
#   IMAGE=repo/name:tag      use this image instead of building one (must hold the wavepp package)
#   USE_EXISTING_CLUSTER=1   skip kind; use the current kubeconfig context (k3s, minikube, ...)
#   KEEP_CLUSTER=1           do not delete the kind cluster at the end
#   CLUSTER=wavepp-e2e       kind cluster name
#   TIMEOUT=15m              how long the pipeline may take to become Ready
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-wavepp-e2e}
TIMEOUT=${TIMEOUT:-15m}
NAMESPACE=wavepp-system
IMAGE=${IMAGE:-}

die() { echo "kind-e2e.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 not found: $2"; }

need kubectl "https://kubernetes.io/docs/tasks/tools/"
bash scripts/install-helm.sh
HELM=.venv/bin/helm
[ -x "$HELM" ] || HELM=${HELM_INSTALL_DIR:-.venv/bin}/helm

if [ "${USE_EXISTING_CLUSTER:-0}" != 1 ]; then
  need docker "install Docker"
  need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
  if ! kind get clusters | grep -qx "$CLUSTER"; then
    kind create cluster --name "$CLUSTER" --wait 120s
  fi
  kubectl config use-context "kind-$CLUSTER"
  if [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    trap 'kind delete cluster --name "$CLUSTER"' EXIT
  fi
fi

if [ -z "$IMAGE" ]; then
  need docker "install Docker (or set IMAGE to a prebuilt image)"
  IMAGE=wavepp:e2e
  # CPU torch from the PyTorch index (the pinned version in pyproject.toml), then the package.
  docker build -t "$IMAGE" -f - . <<'DOCKERFILE'
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY wavepp ./wavepp
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
      "$(python -c 'import tomllib;d=tomllib.load(open("pyproject.toml","rb"));print(next(x for x in d["project"]["dependencies"] if x.startswith("torch")))')" \
 && pip install --no-cache-dir . \
 && rm -rf /src
USER 65532:65532
ENTRYPOINT ["wavepp"]
DOCKERFILE
fi
if [ "${USE_EXISTING_CLUSTER:-0}" != 1 ]; then
  kind load docker-image "$IMAGE" --name "$CLUSTER"
fi

dump() {
  echo "---- diagnostics" >&2
  kubectl get wavepipelines -A -o wide >&2 || true
  kubectl get wavepipeline tiny -o yaml >&2 || true
  kubectl get pods -A -l app.kubernetes.io/name=wavepp -o wide >&2 || true
  kubectl -n "$NAMESPACE" logs deploy/wavepp-operator --tail=200 >&2 || true
}
trap dump ERR

"$HELM" upgrade --install wavepp charts/wavepp \
  --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=IfNotPresent --set nats.deploy=true \
  --wait --timeout 5m
kubectl -n "$NAMESPACE" rollout status deploy/wavepp-operator --timeout=2m
kubectl -n "$NAMESPACE" rollout status deploy/wavepp-nats --timeout=2m

# The example's tenants have API keys (apiKeySecret): one new key each; the Secret keeps its hash.
for tenant in chat batch; do
  key="wpp-$(head -c 32 /dev/urandom | base64 | tr -d '/+=\n' | head -c 43)"
  kubectl create secret generic "tiny-$tenant-api-keys" \
    --from-literal=keys="sha256:$(printf %s "$key" | sha256sum | cut -d' ' -f1)" \
    --dry-run=client -o yaml | kubectl apply -f -
done
kubectl apply -f examples/wavepipeline.yaml
kubectl get wavepipelines
if ! kubectl wait wavepipeline/tiny --for=condition=Ready --timeout="$TIMEOUT"; then
  dump
  die "wavepipeline/tiny did not become Ready within $TIMEOUT"
fi
kubectl get wavepipelines
kubectl get wavepipeline tiny -o jsonpath='{range .status.stages[*]}{.replica}/{.rank}: {.phase}{"\n"}{end}'

# Children are written by server-side apply (the unit tests' emulator only approximates it):
# the API server records the operator as the Apply manager of its fields.
for child in statefulset/tiny-r0 deployment/tiny-gateway configmap/tiny-pool; do
  ops=$(kubectl get "$child" -o jsonpath='{.metadata.managedFields[?(@.manager=="wavepp-operator")].operation}')
  case " $ops " in
    *" Apply "*) ;;
    *) dump; die "$child is not server-side applied by wavepp-operator (managedFields: '$ops')" ;;
  esac
done
# A field the operator owns, changed by someone else, is taken back on a later pass (force).
pool_json() { kubectl get configmap tiny-pool -o jsonpath='{.data.pool\.json}'; }
want=$(pool_json)
kubectl patch configmap tiny-pool --type merge -p '{"data":{"pool.json":"{}"}}' >/dev/null
for _ in $(seq 30); do
  [ "$(pool_json)" = "$want" ] && break
  sleep 2
done
[ "$(pool_json)" = "$want" ] || { dump; die "configmap/tiny-pool was not set back by the operator"; }

# Delete: the children go with their owner (garbage collection by owner references).
kubectl delete -f examples/wavepipeline.yaml --wait --timeout=2m
if kubectl get statefulsets -l wavepp.dev/pipeline=tiny -o name | grep -q .; then
  die "StatefulSets of tiny remain after deleting it"
fi
echo "kind-e2e.sh: OK"
