#!/bin/sh
# Builds the image every prefixgate image starts FROM, with no registry: Debian bookworm's minimal
# root file system from debootstrap, imported as prefixgate-base:bookworm. Cached: does nothing when
# the image exists (`docker image rm prefixgate-base:bookworm` to rebuild). Needs root, debootstrap
# and a Docker engine. The mirror is Debian's unless DEBIAN_MIRROR says otherwise.
set -eu
image="${PREFIXGATE_BASE_IMAGE:-prefixgate-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image exists"
  exit 0
fi
root="$(mktemp -d /tmp/prefixgate-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$mirror"
# Updates and security fixes too, as the official images carry them; no apt lists or caches kept.
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' - "$image"
echo "imported $image"
