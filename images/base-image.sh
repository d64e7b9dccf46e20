#!/usr/bin/env bash
# `make base-image`: a python3.11 Debian bookworm base assembled from Debian's packages with debootstrap,
# for machines that cannot pull the pinned python image. The result is a local image (buildah, or docker
# when a Docker engine runs) that `make image PYTHON_IMAGE=<tag>` builds on; it provides what the
# Dockerfile expects of the python image: `python` and `pip` on PATH, pip allowed to install system-wide,
# groupadd/useradd, CA certificates.
#
#   BASE_IMAGE      tag to create (default localhost/weightsync-base:bookworm-py311)
#   DEBIAN_MIRROR   the Debian archive to bootstrap from (default: the first one this host's apt uses)
#   BUILDER         buildah | docker (default: docker when its engine answers, else buildah)
#   FORCE=1         rebuild even when the tag exists
set -euo pipefail
tag="${BASE_IMAGE:-localhost/weightsync-base:bookworm-py311}"
suite=bookworm
builder="${BUILDER:-}"
if [ -z "$builder" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then builder=docker; else builder=buildah; fi
fi
missing=()
command -v "$builder" >/dev/null || missing+=("$builder")
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ] && [ "$builder" = buildah ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "base-image: installing ${missing[*]} from Debian's packages"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v "$builder" >/dev/null || { echo "base-image: $builder not found (apt-get install buildah)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "base-image: debootstrap not found (apt-get install debootstrap)" >&2; exit 1; }
exists() {
  if [ "$builder" = docker ]; then docker image inspect "$tag" >/dev/null 2>&1
  else buildah inspect --type image "$tag" >/dev/null 2>&1; fi
}
if [ "${FORCE:-0}" != 1 ] && exists; then
  echo "base-image: $tag exists (FORCE=1 rebuilds it)"
  exit 0
fi

mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then  # the archive this host already uses: deb822 sources first, then sources.list
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 || true)"
  [ -n "$mirror" ] || mirror="$(awk '$1 == "deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
fi
[ -n "$mirror" ] || { echo "base-image: no Debian archive found in /etc/apt; set DEBIAN_MIRROR" >&2; exit 1; }

work="$(mktemp -d /var/tmp/weightsync-base-XXXXXX)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
t0=$SECONDS
echo "base-image: debootstrap $suite from the host's Debian archive into $rootfs"
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates,tzdata \
  "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
# What the python image gives: `python`/`pip` on PATH, pip free to install into /usr/local (PEP 668's marker
# would refuse it), no apt lists or caches.
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/var/log/* "$rootfs"/tmp/* "$rootfs"/root/.cache
python_version="$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"

if [ "$builder" = docker ]; then
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$tag" >/dev/null
else
  ctr="$(buildah from scratch)"
  mnt="$(buildah mount "$ctr")"
  cp -a "$rootfs"/. "$mnt"/
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --env PYTHON_VERSION="$python_version" --cmd python3 \
    --label org.opencontainers.image.description="weightsync fallback base: Debian $suite, python $python_version" "$ctr"
  buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
fi
echo "base-image: $tag (Debian $suite, python $python_version) in $((SECONDS - t0)) s"
