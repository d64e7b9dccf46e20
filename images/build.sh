#!/usr/bin/env bash
# `make image`: build the Dockerfile's targets with Docker when its engine answers, else with buildah
# (daemonless, `--isolation chroot`: no Docker engine, no root daemon). After each build it records, next to
# the image, what is in it: build/images/<target>.json (tag, id, unpacked size in bytes, python version) and
# build/images/<target>-pip-freeze.txt (the image's own `pip freeze`).
#
#   TARGETS          which targets, in order (default: "operator agent")
#   OPERATOR_IMAGE   AGENT_IMAGE   the tags (the Makefile passes the chart's repositories and appVersion)
#   PYTHON_IMAGE     the base (default: the Dockerfile's pinned python image; `make base-image` builds a
#                    local one from Debian's packages where that one cannot be pulled)
#   BUILDER          docker | buildah (default: docker when `docker info` answers, else buildah)
#   PIP_CA           a CA bundle pip needs inside the build (default: this host's pip/requests bundle, if any),
#                    passed as the build secret `pip_ca`, never stored in a layer
#   IMAGE_BUILD_ARGS more arguments for the build command
set -euo pipefail
cd "$(dirname "$0")/.."
targets="${TARGETS:-operator agent}"
builder="${BUILDER:-}"
if [ -z "$builder" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then builder=docker
  else
    builder=buildah
    if ! command -v buildah >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "make image: no Docker engine answers; installing buildah from Debian's packages"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >/dev/null
    fi
    command -v buildah >/dev/null 2>&1 || {
      echo "make image: no Docker engine answers and buildah is not installed (apt-get install buildah)" >&2; exit 1; }
  fi
fi
pip_ca="${PIP_CA:-${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}}"
[ -n "$pip_ca" ] || pip_ca="$(python3 -m pip config get global.cert 2>/dev/null || true)"
args=(--build-arg "VERSION=${VERSION:-0.1.0}" --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)")
[ -n "${PYTHON_IMAGE:-}" ] && args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
[ -n "$pip_ca" ] && [ -s "$pip_ca" ] && args+=(--secret "id=pip_ca,src=$pip_ca")
# shellcheck disable=SC2206  # IMAGE_BUILD_ARGS is a list of words on purpose
args+=(${IMAGE_BUILD_ARGS:-})
mkdir -p build/images

tag_of() {
  case "$1" in
    operator) echo "${OPERATOR_IMAGE:-ghcr.io/weightsync/weightsync-operator:0.1.0}" ;;
    agent) echo "${AGENT_IMAGE:-ghcr.io/weightsync/weightsync-agent:0.1.0}" ;;
    *) echo "make image: unknown target '$1' (operator, agent)" >&2; return 1 ;;
  esac
}

record() {  # target tag seconds: size, python and pip freeze of the built image, next to it in build/images
  local target="$1" tag="$2" took="$3" id size py
  if [ "$builder" = docker ]; then
    id="$(docker image inspect --format '{{.Id}}' "$tag")"
    size="$(docker image inspect --format '{{.Size}}' "$tag")"
    docker run --rm --entrypoint cat "$tag" /usr/share/weightsync/pip-freeze.txt >"build/images/$target-pip-freeze.txt"
    py="$(docker run --rm --entrypoint python "$tag" -c 'import platform; print(platform.python_version())')"
  else
    id="$(buildah inspect --type image --format '{{.FromImageID}}' "$tag")"
    local ctr mnt
    ctr="$(buildah from --pull-never "$tag")"
    mnt="$(buildah mount "$ctr")"
    size="$(du -sb "$mnt" | cut -f1)"
    cp "$mnt/usr/share/weightsync/pip-freeze.txt" "build/images/$target-pip-freeze.txt"
    py="$(chroot "$mnt" python3 -c 'import platform; print(platform.python_version())')"
    buildah rm "$ctr" >/dev/null
  fi
  printf '{"target": "%s", "image": "%s", "id": "%s", "size_bytes": %s, "python": "%s", "builder": "%s", "build_s": %s}\n' \
    "$target" "$tag" "$id" "$size" "$py" "$builder" "$took" >"build/images/$target.json"
  echo "make image: $tag  $((size / 1000000)) MB unpacked, built in ${took} s ($builder); packages: build/images/$target-pip-freeze.txt"
}

for target in $targets; do
  tag="$(tag_of "$target")"
  t0=$SECONDS
  echo "make image: building --target $target -> $tag with $builder"
  if [ "$builder" = docker ]; then
    DOCKER_BUILDKIT=1 docker build --target "$target" "${args[@]}" -t "$tag" .
  else
    buildah bud --isolation chroot --layers --target "$target" "${args[@]}" -t "$tag" .
  fi
  record "$target" "$tag" "$((SECONDS - t0))"
done
# The agent image is 6.5 GB: drop what earlier builds left untagged (their layer cache too; the downloads
# stay in the wheelhouse cache mount) unless KEEP_LAYERS=1.
if [ "$builder" = buildah ] && [ "${KEEP_LAYERS:-0}" != 1 ]; then
  buildah rmi --prune >/dev/null 2>&1 || true
fi
