#!/usr/bin/env bash
# Build CRIU from Debian's source package and install it as <prefix>/sbin/criu.
#
# Debian 12 ships CRIU 3.17, which fails on current kernels ("vdso: Unexpected rt vDSO area
# bounds"), and trixie's 4.1.1 cannot dump TCP sockets on kernels >= 6.16; sid's 4.2.1 source
# builds against bookworm's libraries. The project's patches (hack/criu-patches, see
# hack/lib/criu-patches.sh) are applied to it, and the build is named by them (`criu --version`
# prints "GitID: v<version>-rekindle-<hash>"). The source comes through apt from the deb-src entries
# hack/lib/apt-sources.sh derives from the machine's configured sources (no host is named
# here); apt checks the tarball against the signed Sources index. Only the `criu` binary is
# built (no docs, no plugins). Ends with `criu check` unless REKINDLE_CRIU_SKIP_CHECK=1.
# Needs root; version and prefix come from hack/versions.env.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=lib/criu-patches.sh
. "$here/lib/criu-patches.sh"

say() { echo "[build-criu] $*"; }
die() { echo "[build-criu] error: $*" >&2; exit 1; }

build_deps=(build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
            libprotobuf-dev python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev
            libgnutls28-dev libnftables-dev uuid-dev libaio-dev xz-utils ca-certificates patch)
say "installing build dependencies"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${build_deps[@]}" >/dev/null

work=$(mktemp -d "${TMPDIR:-/tmp}/criu-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
chown _apt "$work" 2>/dev/null || true  # apt fetches as _apt where it can

# Only the upstream tarball is needed (Debian's patches are for its packaging), so take its
# URI and checksum from apt and fetch that one file with apt's own transport.
spec="criu=$REKINDLE_CRIU_DEB_VERSION"
line=$(cd "$work" && apt-get source --print-uris -qq "$spec" 2>/dev/null | grep -E "\.orig\.tar\.[a-z]+' " | head -n1) \
    || true
[ -n "$line" ] || die "apt has no source for $spec (is deb-src for sid configured? hack/install-deps.sh adds it)"
read -r uri file _size hash <<<"$line"
uri=${uri//\'/}
say "fetching $file through apt"
/usr/lib/apt/apt-helper -q download-file "$uri" "$work/$file" "$hash" >/dev/null \
    || die "download of $file failed"
tar -xf "$work/$file" -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' | head -n1)
[ -n "$src" ] || die "no criu-* directory in $file"

while read -r p; do
    say "applying ${p##*/}"
    patch -p1 --batch --forward --quiet -d "$src" <"$p" || die "${p##*/} does not apply to criu $REKINDLE_CRIU_VERSION"
done < <(criu_patches)
gitid=$(criu_build_id)

say "building criu $REKINDLE_CRIU_VERSION as $gitid (log: $work/build.log)"
if ! make -C "$src" -j"$(nproc)" GITID="$gitid" criu >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    exit 1
fi
install -D -m 0755 "$src/criu/criu" "$REKINDLE_CRIU_PREFIX/sbin/criu"
say "installed $REKINDLE_CRIU_PREFIX/sbin/criu: $("$REKINDLE_CRIU_PREFIX/sbin/criu" --version | head -n1)"
# An image build has no privileges to run `criu check`; the node-side install does.
if [ "${REKINDLE_CRIU_SKIP_CHECK:-0}" != 1 ]; then
    "$REKINDLE_CRIU_PREFIX/sbin/criu" check
fi
