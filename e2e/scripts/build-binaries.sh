#!/usr/bin/env bash
# Builds the local control plane's binaries from pinned upstream Go modules into a cache outside the
# repository, keyed by version, so that a second run is instant.
#
#   e2e/scripts/build-binaries.sh [component ...]   components: kubernetes etcd kwok helm (default: all)
#
# Environment:
#   WEIGHTSYNC_CACHE    cache root (default: $XDG_CACHE_HOME/weightsync or ~/.cache/weightsync)
#   KUBEBUILDER_ASSETS  a directory with setup-envtest binaries (etcd, kube-apiserver, kubectl): those
#                       are used as they are and not built.
# Prints the directory of each component's binaries on stdout, one "name=dir" line each.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../versions.env
source "$here/../versions.env"
cache="${WEIGHTSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightsync}"
mkdir -p "$cache/bin" "$cache/build"
export GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0 GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"

log() { printf '[build-binaries] %s\n' "$*" >&2; }

# build_in_wrapper NAME VERSION DIR "require lines" "replace lines" pkg:out ... -- ldflags
wrapper_module() {  # dir module-requires...
  local dir="$1"; shift
  mkdir -p "$dir"
  { echo "module weightsync.local/build"; echo; echo "go 1.24"; echo; } > "$dir/go.mod"
  printf 'package build\n' > "$dir/doc.go"
}

done_marker() { [ -f "$1/.complete" ]; }

build_kubernetes() {
  local v="$KUBERNETES_VERSION" out="$cache/bin/kubernetes-$KUBERNETES_VERSION"
  if done_marker "$out"; then echo "kubernetes=$out"; return; fi
  local staging="v0.${v#v1.}" work="$cache/build/kubernetes-$v"
  log "building kubernetes $v (staging modules $staging): kube-apiserver, kube-controller-manager, kube-scheduler, kubectl"
  wrapper_module "$work"
  (
    cd "$work"
    go mod edit -require="k8s.io/kubernetes@$v"
    # k8s.io/kubernetes replaces its staging modules with local paths; map each to its published tag.
    local gomod
    gomod="$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    for m in $(grep -oE 'k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' | sort -u); do
      go mod edit -replace="$m=$m@$staging"
    done
    printf 'package build\n\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver/app"\n\t_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"\n\t_ "k8s.io/kubernetes/cmd/kube-scheduler/app"\n\t_ "k8s.io/kubectl/pkg/cmd"\n)\n' > deps.go
    go mod tidy >/dev/null 2>&1 || go mod tidy
    local commit date ld
    commit="$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Origin",{}).get("Hash","0000000000000000000000000000000000000000"))')"
    date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    ld="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld="$ld -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$(echo "$v" | cut -d. -f2) -X $p.gitCommit=$commit -X $p.gitTreeState=clean -X $p.buildDate=$date"
    done
    mkdir -p "$out.tmp"
    for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      log "  go build $cmd"
      go build -trimpath -ldflags "$ld" -o "$out.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd"
    done
  )
  rm -rf "$out"; mv "$out.tmp" "$out"; touch "$out/.complete"
  echo "kubernetes=$out"
}

build_simple() {  # name version module package binary [ldflags]
  local name="$1" v="$2" module="$3" pkg="$4" bin="$5" ld="${6:-}"
  local out="$cache/bin/$name-$v" work="$cache/build/$name-$v"
  if done_marker "$out"; then echo "$name=$out"; return; fi
  log "building $name $v ($pkg)"
  wrapper_module "$work"
  (
    cd "$work"
    go mod edit -require="$module@$v"
    printf 'package build\n\nimport _ "%s"\n' "$pkg" > deps.go
    # A main package cannot be imported; keep deps.go only for module resolution of library packages.
    if go list -f '{{.Name}}' "$pkg" 2>/dev/null | grep -qx main; then rm deps.go; fi
    go mod tidy >/dev/null 2>&1 || true
    go get "$pkg@$v" >/dev/null 2>&1 || go mod download "$module@$v"
    mkdir -p "$out.tmp"
    go build -trimpath -ldflags "-s -w $ld" -o "$out.tmp/$bin" "$pkg"
  )
  rm -rf "$out"; mv "$out.tmp" "$out"; touch "$out/.complete"
  echo "$name=$out"
}

build_etcd() {
  build_simple etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 etcd
}
build_kwok() {
  build_simple kwok "$KWOK_VERSION" sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok kwok \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
}
build_helm() {
  build_simple helm "$HELM_VERSION" helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm helm \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
}

components=("$@")
[ ${#components[@]} -gt 0 ] || components=(kubernetes etcd kwok helm)
for c in "${components[@]}"; do
  if [ -n "${KUBEBUILDER_ASSETS:-}" ] && [ "$c" != kwok ] && [ "$c" != helm ] && \
     [ -x "$KUBEBUILDER_ASSETS/kube-apiserver" ] && [ "$c" = etcd ] && [ -x "$KUBEBUILDER_ASSETS/etcd" ]; then
    echo "etcd=$KUBEBUILDER_ASSETS"; continue
  fi
  case "$c" in
    kubernetes) build_kubernetes ;;
    etcd) build_etcd ;;
    kwok) build_kwok ;;
    helm) build_helm ;;
    *) echo "unknown component: $c (known: kubernetes etcd kwok helm)" >&2; exit 2 ;;
  esac
done
