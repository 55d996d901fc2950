#!/usr/bin/env bash
# e2e-kind.sh: kubeinfer end to end on a kind cluster, for machines with Docker (`make e2e-kind`).
#
#   1. a kind cluster (KIND_CLUSTER, default kubeinfer-e2e) whose node sees a copy of the SmolLM2
#      folder that `make model` makes at the same path as this machine does (hostpath:// in
#      examples/)
#   2. docker build both images (docker/*.Dockerfile) and `kind load` them
#   3. fake nvidia.com/gpu capacity on the node (the runtime runs on the CPU: examples/ passes
#      --device cpu), helm install helm/kubeinfer, helm test
#   4. apply examples/smollm2.yaml, wait for Ready, one completion
#
# The completion goes from a client pod to the model's Service: the runtime listens on its pod
# IP (the runtime contract), and `kubectl port-forward` dials localhost inside the pod.
# Set KEEP_CLUSTER=1 to leave the cluster running; it is deleted otherwise.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cluster=${KIND_CLUSTER:-kubeinfer-e2e}
namespace=${E2E_NAMESPACE:-kubeinfer-system}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
operator_image=kubeinfer/operator:$version
runtime_image=kubeinfer/runtime:$version
ready_timeout=${READY_TIMEOUT:-900s}

die() { echo "e2e-kind: $*" >&2; exit 1; }
step() { echo "--> [e2e-kind] $*"; }

# --- prerequisites, before anything slow ------------------------------------------------------
# kubectl and helm from `make controlplane` when it has run (the pinned versions), else PATH's.
k8s_version=$(sed -n 's|^require k8s.io/kubernetes \(v[^ ]*\)$|\1|p' \
  "$repo/hack/controlplane/kubernetes/go.mod")
built=${KUBEINFER_CACHE:-$HOME/.cache/kubeinfer}/bin/$k8s_version
[[ -n $k8s_version && -d $built ]] && export PATH=$built:$PATH
missing=()
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  die "needs ${missing[*]} on PATH (Docker and kind: https://kind.sigs.k8s.io/docs/user/quick-start/).
This target cannot run on machines without a Docker engine (such as the kubeinfer dev machine);
there, the dev cluster tests (make test) cover the chart."
fi
docker info >/dev/null 2>&1 || die "docker is installed but its daemon does not answer (docker info failed)"

cd "$repo"
make model
[[ -f .cache/models/smollm2-135m/model.safetensors ]] || die "no model (make model failed?)"
# The runtime runs as uid 1000 and hostPath ignores fsGroup: the node sees a world-readable copy.
model_dir=$repo/.cache/e2e-kind/smollm2-135m
if [[ ! -f $model_dir/model.safetensors ]]; then
  mkdir -p "$model_dir"
  cp -rL .cache/models/smollm2-135m/. "$model_dir/"
fi
chmod -R a+rX "$repo/.cache/e2e-kind"

# --- cluster ----------------------------------------------------------------------------------
if ! kind get clusters | grep -qx "$cluster"; then
  step "kind create cluster $cluster (model folder $model_dir mounted into the node)"
  kind create cluster --name "$cluster" --wait 120s --config - <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $model_dir
        containerPath: $model_dir
        readOnly: true
EOF
fi
cleanup() {
  if [[ ${KEEP_CLUSTER:-0} != 1 ]]; then
    step "kind delete cluster $cluster"
    kind delete cluster --name "$cluster" || true
  fi
}
trap cleanup EXIT
export KUBECONFIG=${KUBECONFIG_E2E:-$(mktemp)}
kind get kubeconfig --name "$cluster" >"$KUBECONFIG"

# --- images -----------------------------------------------------------------------------------
step "docker build $operator_image and $runtime_image"
docker build -f docker/operator.Dockerfile -t "$operator_image" .
docker build -f docker/runtime.Dockerfile -t "$runtime_image" .
kind load docker-image --name "$cluster" "$operator_image" "$runtime_image"

# --- GPUs: the example asks for one; kind nodes have none, so advertise fake ones -------------
for node in $(kubectl get nodes -o name); do
  kubectl patch "$node" --subresource=status --type=json \
    -p '[{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "8"}]'
done

# --- chart ------------------------------------------------------------------------------------
step "helm install kubeinfer into $namespace"
helm upgrade --install kubeinfer helm/kubeinfer --namespace "$namespace" --create-namespace \
  --wait --timeout 5m
helm test kubeinfer --namespace "$namespace" --timeout 5m

# --- a model ----------------------------------------------------------------------------------
step "apply examples/smollm2.yaml and wait for Ready (up to $ready_timeout)"
sed "s|MODEL_DIR|$model_dir|" examples/smollm2.yaml | kubectl apply -n default -f -
if ! kubectl wait -n default --for=jsonpath='{.status.phase}'=Ready inferencemodel/smollm2 \
  --timeout="$ready_timeout"; then
  kubectl get -n default inferencemodel/smollm2 -o yaml || true
  kubectl describe -n default pods -l app.kubernetes.io/instance=smollm2 || true
  kubectl logs -n "$namespace" deploy/kubeinfer --tail=100 || true
  die "smollm2 did not become Ready"
fi

step "one completion through the smollm2 Service"
kubectl run e2e-client -n default --rm -i --restart=Never --image="$operator_image" \
  --image-pull-policy=IfNotPresent --command -- python -c '
import json, urllib.request
body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 16,
        "temperature": 0}
req = urllib.request.Request("http://smollm2.default.svc:8000/v1/completions",
                             data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
text = out["choices"][0]["text"]
assert text.strip(), out
print("completion:", repr(text))
'
step "passed"
