#!/usr/bin/env bash
# build.sh: build the dev cluster's control plane once into ~/.cache/kubeinfer/bin/<k8s-version>/.
#
# Three wrapper modules, so their dependency graphs never mix (each pins its own grpc, otel and
# k8s.io versions): kubernetes/ (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl),
# etcd/ and helm/. The versions are the ones their committed go.mod files require. A binary
# already present is reused; each component is built into a temporary folder and moved into
# place only when complete, so an interrupted build never leaves a half-built set behind.
#
#   hack/controlplane/build.sh          build what is missing, print the bin folder at the end
#   hack/controlplane/build.sh --print  print the bin folder only (builds nothing)
#
# Go's module and build caches (GOMODCACHE, GOCACHE) stay at their defaults under $HOME, so CI
# runs of fresh clones on the same machine reuse them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
export PATH=/usr/local/go/bin:$PATH
# The modules' go directives (1.26.0) are met by the machine's Go; a newer release would be
# fetched through the module proxy by naming it here, e.g. GOTOOLCHAIN=go1.27.3.
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOFLAGS=${GOFLAGS:--buildvcs=false}
export CGO_ENABLED=0
cache=${KUBEINFER_CACHE:-$HOME/.cache/kubeinfer}

modver() {  # modver DIR MODULE: the version DIR's go.mod requires of MODULE
  (cd "$here/$1" && go list -m -f '{{.Version}}' "$2")
}

k8s_version=$(modver kubernetes k8s.io/kubernetes)
bin=$cache/bin/$k8s_version
if [[ ${1:-} == --print ]]; then echo "$bin"; exit 0; fi
mkdir -p "$bin"

step() { echo "--> [controlplane] $*"; }

# build_into NAME DIR "BINARIES..." GO-BUILD-ARGS...: build into $bin unless every binary is there
# and was built with these arguments (recorded in $bin/.NAME.build once a build completes; a
# binary from before that record is reused as long as the arguments match the old recipe,
# see HELM_RECIPE_CHANGED). The new binaries replace the old ones by rename, never leaving a gap.
build_into() {
  local name=$1 dir=$2 binaries=$3; shift 3
  local missing=0 b recipe="$*"
  for b in $binaries; do [[ -x $bin/$b ]] || missing=1; done
  if [[ -f $bin/.$name.build && $(cat "$bin/.$name.build") != "$recipe" ]]; then missing=1; fi
  if [[ ! -f $bin/.$name.build && $name == helm && -x $bin/helm ]]; then
    missing=1  # HELM_RECIPE_CHANGED: helm built before its kube-version ldflags
  fi
  if (( ! missing )); then step "$name: reusing $bin ($binaries)"; return 0; fi
  local tmp start=$SECONDS
  tmp=$(mktemp -d "$bin/.build-$name.XXXXXX")
  step "$name: downloading modules"
  (cd "$here/$dir" && go mod download)
  step "$name: building $binaries (cold builds take minutes; warm ones seconds)"
  # One binary: name it (etcd's package path ends in /v3); several: go names them by package.
  local out=$tmp/
  [[ $binaries == *" "* ]] || out=$tmp/$binaries
  (cd "$here/$dir" && go build -trimpath -o "$out" "$@")
  for b in $binaries; do mv -f "$tmp/$b" "$bin/$b"; done
  rmdir "$tmp"
  echo "$recipe" > "$bin/.$name.build"
  step "$name: done in $(( SECONDS - start ))s"
}

# The version ldflags make /version, `kubectl version` and helm's kubeVersion checks see the
# pinned release instead of v0.0.0-master.
minor=${k8s_version#v1.}; minor=${minor%%.*}
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
build_into kubernetes kubernetes "kube-apiserver kube-controller-manager kube-scheduler kubectl" \
  -ldflags "$k8s_ldflags" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl

etcd_version=$(modver etcd go.etcd.io/etcd/server/v3)
# go.etcd.io/etcd/server/v3 is itself package main; -o names the binary etcd.
build_into etcd etcd "etcd" -ldflags "-s -w" go.etcd.io/etcd/server/v3

helm_version=$(modver helm helm.sh/helm/v3)
# As helm's own Makefile does: the Kubernetes version `helm template` and `helm lint` assume
# without a cluster (--kube-version) is that of the client-go helm is built with; without these
# it is v1.20, below the chart's kubeVersion, and `helm template` fails.
client_go=$(modver helm k8s.io/client-go)  # v0.X.Y <-> Kubernetes v1.X.Y
helm_minor=${client_go#v0.}; helm_minor=${helm_minor%%.*}
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$helm_minor"
done
build_into helm helm "helm" -ldflags "$helm_ldflags" helm.sh/helm/v3/cmd/helm

echo "$k8s_version etcd=$etcd_version helm=$helm_version" > "$bin/VERSIONS"
step "binaries in $bin: $(cat "$bin/VERSIONS")"
