#!/usr/bin/env bash
# Build CRIU from Debian's upstream tarball and install it as <prefix>/sbin/criu.
#
# Debian 12 ships CRIU 3.17, which fails on current kernels ("vdso: Unexpected rt vDSO area
# bounds"); trixie's 4.1.1 source builds fine against bookworm's libraries. Only the `criu`
# binary is built (no docs, no plugins). Ends with `criu check`, which must pass.
# Needs root. Versions, URL and checksum come from hack/versions.env.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"

say() { echo "[build-criu] $*"; }

build_deps=(build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
            python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev
            libnftables-dev uuid-dev libaio-dev curl xz-utils ca-certificates)
say "installing build dependencies"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${build_deps[@]}" >/dev/null

work=$(mktemp -d "${TMPDIR:-/tmp}/criu-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
tarball="$work/criu_${REKINDLE_CRIU_VERSION}.orig.tar.xz"
say "downloading $REKINDLE_CRIU_URL"
curl -fsSL --retry 3 -o "$tarball" "$REKINDLE_CRIU_URL"
echo "$REKINDLE_CRIU_SHA256  $tarball" | sha256sum -c --quiet -
tar -xJf "$tarball" -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' | head -n1)
[ -n "$src" ] || { echo "no criu-* directory in the tarball" >&2; exit 1; }

say "building criu $REKINDLE_CRIU_VERSION (log: $work/build.log)"
if ! make -C "$src" -j"$(nproc)" criu >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    exit 1
fi
install -D -m 0755 "$src/criu/criu" "$REKINDLE_CRIU_PREFIX/sbin/criu"
say "installed $REKINDLE_CRIU_PREFIX/sbin/criu: $("$REKINDLE_CRIU_PREFIX/sbin/criu" --version | head -n1)"
# An image build has no privileges to run `criu check`; the node-side install does.
if [ "${REKINDLE_CRIU_SKIP_CHECK:-0}" != 1 ]; then
    "$REKINDLE_CRIU_PREFIX/sbin/criu" check
fi
