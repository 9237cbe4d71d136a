#!/usr/bin/env bash
# A kind cluster with Rekindle and the GPU-less demo (needs docker, kind,
# kubectl, helm and internet access for the base images).
#
#   hack/kind/up.sh          create the cluster (if absent), build and load the
#                            image, install the chart, run the demo pods
#   hack/kind/up.sh down     delete the cluster
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cluster=${KIND_CLUSTER:-rekindle}
namespace=${REKINDLE_NAMESPACE:-kube-system}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
image=localhost/rekindle/plugin:$version

if [ "${1:-}" = down ]; then
  exec kind delete cluster --name "$cluster"
fi

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "up.sh: $tool is not installed" >&2; exit 1; }
done

if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --name "$cluster" --config hack/kind/kind-config.yaml
fi
kubectl config use-context "kind-$cluster" >/dev/null

docker build -t "$image" .
kind load docker-image "$image" --name "$cluster"

helm upgrade --install rekindle charts/rekindle --namespace "$namespace" \
  -f charts/rekindle/ci/kind-values.yaml --set image.tag="$version" --wait --timeout 5m
kubectl -n "$namespace" rollout status ds/rekindle --timeout=2m

# The source first; the restore only once its artifact is published (a restore
# pod created earlier would simply start cold).
kubectl apply -f hack/kind/demo-pod.yaml -l rekindle-demo=source
kubectl wait pod/rekindle-demo-source --for=condition=Ready --timeout=2m
echo "waiting for the checkpoint of rekindle-demo-source"
for _ in $(seq 1 120); do
  if kubectl exec rekindle-demo-source -- test -f /rekindle/snapshot-complete 2>/dev/null; then
    break
  fi
  if kubectl exec rekindle-demo-source -- test -f /rekindle/checkpoint-failed 2>/dev/null; then
    kubectl exec rekindle-demo-source -- cat /rekindle/checkpoint-failed >&2 || true
    echo "up.sh: checkpoint failed; plugin logs:" >&2
    kubectl -n "$namespace" logs ds/rekindle --tail=50 >&2 || true
    exit 1
  fi
  sleep 2
done
kubectl exec rekindle-demo-source -- test -f /rekindle/snapshot-complete \
  || { echo "up.sh: no checkpoint after 4 minutes" >&2; exit 1; }

kubectl apply -f hack/kind/demo-pod.yaml -l rekindle-demo=restore
kubectl wait pod/rekindle-demo-restore --for=condition=Ready --timeout=2m
sleep 5
echo "--- source:";  kubectl logs rekindle-demo-source --tail=3
echo "--- restore (continues the count, no warm-up line when restored):"
kubectl logs rekindle-demo-restore --tail=5
