#!/usr/bin/env bash
# Build one containerd 2.x release from its Go module into its own prefix, idempotently:
#
#   hack/build-containerd.sh VERSION PREFIX      e.g. hack/build-containerd.sh v2.2.7 /opt/rekindle/containerd-2.2
#
# Debian packages containerd up to 2.1 only. For 2.2 and later (NRI >= 0.10) this runs
# `go install` of the module's own commands (cmd/containerd, cmd/containerd-shim-runc-v2,
# cmd/ctr) at VERSION through the Go module proxy, into PREFIX/usr/bin, and writes VERSION to
# PREFIX/.version; a prefix that already says VERSION is left as it is (the build takes minutes).
# The Go toolchain is Debian's $REKINDLE_GO_PACKAGE (from $REKINDLE_GO_SUITE at its low pin:
# 2.2 needs Go >= 1.25, 2.4 >= 1.26), never one downloaded by `go` itself (GOTOOLCHAIN=local).
# Static binaries (CGO off, so no btrfs snapshotter), built with -p $REKINDLE_GO_BUILD_JOBS (1:
# the node may be a shared build machine). Prints how long the build took. Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
say() { echo "[build-containerd] $*"; }
die() { echo "[build-containerd] error: $*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: $0 VERSION PREFIX"
version=$1 prefix=$2
if [ "$(cat "$prefix/.version" 2>/dev/null || true)" = "$version" ] && [ -x "$prefix/usr/bin/containerd" ]; then
    exit 0
fi

gopkg=$REKINDLE_GO_PACKAGE
gov=${gopkg#golang-}
go=/usr/lib/go-${gov%-go}/bin/go  # golang-1.27-go -> /usr/lib/go-1.27/bin/go
if [ ! -x "$go" ]; then
    say "installing $gopkg ($REKINDLE_GO_SUITE)"
    apt-get install -y -q --no-install-recommends "$gopkg/$REKINDLE_GO_SUITE" >/dev/null
fi
[ -x "$go" ] || die "$gopkg did not install $go"

module=github.com/containerd/containerd/v2
work=$(mktemp -d "${TMPDIR:-/tmp}/containerd-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
rm -rf "$prefix.new"
mkdir -p "$prefix.new/usr/bin"
say "building containerd $version into $prefix ($("$go" version | awk '{print $3}'), -p $REKINDLE_GO_BUILD_JOBS)"
start=$SECONDS
# The version containerd reports is set at link time, as its Makefile does.
ldflags="-s -w -X $module/version.Version=$version -X $module/version.Package=$module"
GOBIN=$prefix.new/usr/bin GOPATH=$work/gopath GOCACHE=$work/cache GOTOOLCHAIN=local CGO_ENABLED=0 \
    GOFLAGS="-p=$REKINDLE_GO_BUILD_JOBS -trimpath -modcacherw" \
    "$go" install -tags "no_btrfs urfave_cli_no_docs" -ldflags "$ldflags" \
    "$module/cmd/containerd@$version" "$module/cmd/containerd-shim-runc-v2@$version" "$module/cmd/ctr@$version" \
    || { rm -rf "$prefix.new"; die "go install of containerd $version failed (is the Go module proxy reachable?)"; }
got=$("$prefix.new/usr/bin/containerd" --version | awk '{print $3}')
[ "$got" = "$version" ] || { rm -rf "$prefix.new"; die "built containerd says $got, not $version"; }
echo "$version" >"$prefix.new/.version"
rm -rf "$prefix"
mv "$prefix.new" "$prefix"
say "containerd $version built in $((SECONDS - start))s"
