#!/usr/bin/env bash
# Makes the base image docker/Dockerfile starts FROM (python:3.11-slim) available to buildah
# on a machine that cannot pull it: no route to a container registry, only to a Debian
# mirror.
#
#   docker/bootstrap-base.sh            # pull the real image if possible, else bootstrap one
#   VIDPIPE_BASE_PULL=0 docker/bootstrap-base.sh   # skip the pull attempt
#
# The stand-in is Debian bookworm made with debootstrap: Python 3.11 with venv and pip from
# Debian (`python` on PATH, as in the official image), apt sources for bookworm, its
# updates and security, and the CA bundle of the machine that builds it, so pip and apt
# inside the build trust the same roots as the host (a TLS-inspecting proxy's CA included).
# It is committed to buildah's local storage as python:3.11-slim, so the Dockerfile builds
# unchanged with
#
#   buildah bud --isolation chroot --layers -f docker/Dockerfile -t vidpipe:0.1.0 .
#
# The root filesystem is kept as a tarball under VIDPIPE_IMAGE_CACHE (default
# /var/tmp/vidpipe-images), so a wiped container storage is refilled in seconds instead of
# bootstrapping again. Needs root, buildah and debootstrap (Debian packages of the same
# names).
set -euo pipefail

IMAGE="${VIDPIPE_BASE_IMAGE:-python:3.11-slim}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
CACHE="${VIDPIPE_IMAGE_CACHE:-/var/tmp/vidpipe-images}"
HOST_CA="${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
TARBALL="$CACHE/$SUITE-python3.11-rootfs.tar"

log() { printf 'bootstrap-base: %s\n' "$*" >&2; }

if buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE is already in local storage"
    exit 0
fi

if [ "${VIDPIPE_BASE_PULL:-1}" = 1 ] && timeout 60 buildah pull --quiet "docker.io/library/$IMAGE" >/dev/null 2>&1; then
    log "pulled docker.io/library/$IMAGE"
    exit 0
fi

mkdir -p "$CACHE"
if [ ! -s "$TARBALL" ]; then
    for tool in debootstrap chroot; do
        command -v "$tool" >/dev/null || { log "$tool is needed (apt-get install debootstrap)"; exit 1; }
    done
    rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    chmod 755 "$rootfs"  # apt inside drops to the _apt user to download
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap $SUITE from $MIRROR (a few minutes)"
    # minbase: essential packages and apt, the closest match to the slim image.
    debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$rootfs" "$MIRROR" >&2

    cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
    # The host's roots replace the bundle; update-ca-certificates, run by later package
    # installs, would rebuild it from Debian's list alone, so the host bundle is also
    # installed as a local CA file (those survive rebuilds).
    if [ -s "$HOST_CA" ]; then
        mkdir -p "$rootfs/usr/local/share/ca-certificates"
        cp "$HOST_CA" "$rootfs/usr/local/share/ca-certificates/host-ca-bundle.crt"
        cp "$HOST_CA" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    fi

    # /proc is needed by some maintainer scripts; resolv.conf for the mirror's name.
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    mount -t proc proc "$rootfs/proc"
    trap 'umount "$rootfs/proc" 2>/dev/null || true; rm -rf "$rootfs"' EXIT
    chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        sh -c 'apt-get update -qq \
            && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip python-is-python3 \
            && apt-get clean && rm -rf /var/lib/apt/lists/*' >&2
    umount "$rootfs/proc"
    : >"$rootfs/etc/resolv.conf"
    # Layer content only: buildah writes hostname and hosts at run time.
    tar -C "$rootfs" --numeric-owner -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    rm -rf "$rootfs"
    trap - EXIT
fi

log "importing $TARBALL as $IMAGE"
ctr="$(buildah from scratch)"
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
mnt="$(buildah mount "$ctr")"
tar -C "$mnt" --numeric-owner -xf "$TARBALL"
buildah umount "$ctr" >/dev/null
# The official image's environment, plus the CA bundle for tools that read it from the
# environment (pip's vendored certifi would otherwise ignore the system bundle).
buildah config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    --cmd python3 \
    --label org.opencontainers.image.description="Debian $SUITE with Python 3.11, standing in for $IMAGE" \
    "$ctr"
buildah commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
trap - EXIT
log "$IMAGE ready"
