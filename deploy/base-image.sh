#!/bin/sh
# Build a Debian base image from Debian's own packages, for a Docker engine that can reach a Debian mirror but no image
# registry: debootstrap a minimal root file system and `docker import` it. The project image and the PostgreSQL image
# are then built on it (BASE_IMAGE / POSTGRES_BASE_IMAGE, see deploy/README.md).
#
#   sudo deploy/base-image.sh [IMAGE]          # default latentsweep-base:bookworm; does nothing if IMAGE exists
#
# Environment: DEBIAN_SUITE (bookworm), DEBIAN_MIRROR (the mirror this machine's apt uses, else deb.debian.org),
# DOCKER (docker). Needs root and debootstrap (apt-get install debootstrap).
set -eu

# The image's file system as a tar stream on stdout. The `./` entry becomes the image's `/`: mktemp -d made ROOTFS
# 0700, and a 0700 `/` denies every non-root process its own libraries (PostgreSQL: libc.so.6: Permission denied).
rootfs_tar() {
    chmod 0755 "$1"
    tar -C "$1" --numeric-owner -c .
}

IMAGE=${1:-latentsweep-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
DOCKER=${DOCKER:-docker}

if $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE exists; nothing to do"
    exit 0
fi

# The first Debian mirror in this machine's apt sources (one-line or deb822 format), so a machine behind a local
# mirror uses it; security updates come from the matching debian-security path.
mirror_from_apt() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -v '^[[:space:]]*#' | grep -Eo 'https?://[^ ]+/debian/?( |$)' | grep -v -- '-security' | head -n 1 | tr -d ' ' | sed 's#/$##'
}
MIRROR=${DEBIAN_MIRROR:-$(mirror_from_apt)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-${MIRROR%/debian}/debian-security}

ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/latentsweep-rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE from $MIRROR ..."
debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
    tail -n 20 "$ROOTFS.log" >&2
    rm -f "$ROOTFS.log"
    exit 1
}
rm -f "$ROOTFS.log"
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
# Downloaded .debs and apt lists are cache, not image content.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

rootfs_tar "$ROOTFS" | $DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase $SUITE $MIRROR" - "$IMAGE"
echo "base image $IMAGE imported"
