#!/usr/bin/env bash
# Builds the local control plane's binaries from pinned upstream Go modules into a cache outside the
# repository, keyed by version, so that a second run is instant.
#
#   e2e/scripts/build-binaries.sh [component ...]   components: kubernetes etcd kwok helm (default: all)
#
# Environment:
#   WEIGHTSYNC_CACHE    cache root (default: $XDG_CACHE_HOME/weightsync or ~/.cache/weightsync)
#   KUBEBUILDER_ASSETS  a directory with setup-envtest binaries (etcd, kube-apiserver, kubectl): each
#                       binary found there is used as it is and not built; for `kubernetes` only the
#                       commands missing there (envtest has no scheduler / controller-manager) are built.
#   WEIGHTSYNC_<NAME>   (e.g. WEIGHTSYNC_KUBE_APISERVER) an explicit binary: not built either.
# Prints the directory of each component's binaries on stdout, one "name=dir" line each.
# A finished build is marked by a `.complete` file; a build is serialized per component with flock.
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../versions.env
source "$here/../versions.env"
cache="${WEIGHTSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightsync}"
mkdir -p "$cache/bin" "$cache/build"
export GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0 GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"

log() { printf '[build-binaries] %s\n' "$*" >&2; }
die() { printf '[build-binaries] ERROR: %s\n' "$*" >&2; exit 1; }

current=""
on_error() {
  local rc=$?
  # Print once, from the main shell (subshells and command substitutions inherit the trap via set -E).
  [ "$BASHPID" = "$$" ] && [ -n "$current" ] && printf '[build-binaries] ERROR: building %s failed (exit %s; output above); fix the cause, then re-run: %s %s\n' \
    "$current" "$rc" "e2e/scripts/build-binaries.sh" "$current" >&2
  exit "$rc"
}
trap on_error ERR

need_go() {
  command -v go >/dev/null 2>&1 || die "go not found: install Go >= 1.24 (https://go.dev/dl), or set KUBEBUILDER_ASSETS / WEIGHTSYNC_<BINARY> to prebuilt binaries"
}

# An explicitly provided binary (WEIGHTSYNC_KUBE_APISERVER, TEST_ASSET_KUBE_APISERVER, KUBEBUILDER_ASSETS).
provided() {  # name -> path on stdout, or nothing
  local name="$1" var suffix
  suffix="$(printf '%s' "$name" | tr 'a-z-' 'A-Z_')"
  for var in "WEIGHTSYNC_$suffix" "TEST_ASSET_$suffix"; do
    if [ -n "${!var:-}" ] && [ -x "${!var}" ]; then echo "${!var}"; return; fi
  done
  if [ -n "${KUBEBUILDER_ASSETS:-}" ] && [ -x "$KUBEBUILDER_ASSETS/$name" ]; then echo "$KUBEBUILDER_ASSETS/$name"; fi
}

wrapper_module() {  # dir
  local dir="$1"
  mkdir -p "$dir"
  { echo "module weightsync.local/build"; echo; echo "go 1.24"; echo; } > "$dir/go.mod"
  printf 'package build\n' > "$dir/doc.go"
}

# complete DIR [binary ...]: the build in DIR finished and holds every named binary.
complete() {
  local dir="$1" b; shift
  [ -f "$dir/.complete" ] || return 1
  for b in "$@"; do [ -x "$dir/$b" ] || return 1; done
}

lock() {  # component: one build of a component at a time (a second caller waits, then finds it done)
  exec 9>"$cache/build/$1.lock"
  if ! flock -n 9; then log "another build of $1 is running; waiting for it"; flock 9; fi
}

# A build started by an older copy of this script holds no lock: never delete the directory it writes.
not_running_elsewhere() {  # tmp-dir
  local pids
  pids="$(pgrep -f -- "$1" | grep -vx "$$" | tr '\n' ' ' || true)"
  [ -z "${pids// /}" ] || die "a build is already writing $1 (pids: $pids); wait for it to finish, then re-run"
}

build_kubernetes() {
  local v="$KUBERNETES_VERSION" out="$cache/bin/kubernetes-$KUBERNETES_VERSION"
  local all=(kube-apiserver kube-controller-manager kube-scheduler kubectl) cmds=() c
  for c in "${all[@]}"; do
    if [ -n "$(provided "$c")" ]; then log "kubernetes: using provided $(provided "$c")"; else cmds+=("$c"); fi
  done
  if [ ${#cmds[@]} -eq 0 ]; then echo "kubernetes=${KUBEBUILDER_ASSETS:-provided}"; return; fi
  if complete "$out" "${cmds[@]}"; then echo "kubernetes=$out"; return; fi
  need_go; lock kubernetes
  if complete "$out" "${cmds[@]}"; then echo "kubernetes=$out"; return; fi
  local staging="v0.${v#v1.}" work="$cache/build/kubernetes-$v"
  log "building kubernetes $v (staging modules $staging): ${cmds[*]}"
  not_running_elsewhere "$out.tmp"
  wrapper_module "$work"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  # Keep the binaries of an earlier partial build (e.g. one that skipped envtest's kube-apiserver).
  if [ -f "$out/.complete" ]; then cp -p "$out"/kube* "$out.tmp/" 2>/dev/null || true; fi
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
    for cmd in "${cmds[@]}"; do
      log "  go build $cmd"
      go build -trimpath -ldflags "$ld" -o "$out.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd"
    done
  )
  rm -rf "$out"; mv "$out.tmp" "$out"; touch "$out/.complete"
  "$out/${cmds[0]}" --version >&2 || true
  echo "kubernetes=$out"
}

build_simple() {  # name version module package binary [ldflags]
  local name="$1" v="$2" module="$3" pkg="$4" bin="$5" ld="${6:-}"
  local out="$cache/bin/$name-$v" work="$cache/build/$name-$v" p
  p="$(provided "$bin")"
  if [ -n "$p" ]; then log "$name: using provided $p"; echo "$name=$(dirname "$p")"; return; fi
  if complete "$out" "$bin"; then echo "$name=$out"; return; fi
  need_go; lock "$name"
  if complete "$out" "$bin"; then echo "$name=$out"; return; fi
  log "building $name $v ($pkg)"
  not_running_elsewhere "$out.tmp"
  wrapper_module "$work"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  (
    cd "$work"
    go mod edit -require="$module@$v"
    printf 'package build\n\nimport _ "%s"\n' "$pkg" > deps.go
    # A main package cannot be imported; keep deps.go only for module resolution of library packages.
    if go list -f '{{.Name}}' "$pkg" 2>/dev/null | grep -qx main; then rm deps.go; fi
    go mod tidy >/dev/null 2>&1 || true
    go get "$pkg@$v" >/dev/null 2>&1 || go mod download "$module@$v"
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
  current="$c"
  case "$c" in
    kubernetes) build_kubernetes ;;
    etcd) build_etcd ;;
    kwok) build_kwok ;;
    helm) build_helm ;;
    *) current=""; die "unknown component: $c (known: kubernetes etcd kwok helm)" ;;
  esac
done
current=""
