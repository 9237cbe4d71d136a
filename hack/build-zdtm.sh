#!/usr/bin/env bash
# Build the zdtm static tests that tests/e2e/zdtm runs, from CRIU's own source package.
#
#   hack/build-zdtm.sh          (hack/setup.sh runs it; idempotent)
#
# The tests are CRIU's (test/zdtm/static/*.c, linked against test/zdtm/lib) of the very version
# hack/build-criu.sh builds: the upstream tarball criu_<version>.orig.tar.xz comes through apt
# from the deb-src entries hack/install-deps.sh configures, checked by apt against the signed
# Sources index, and is kept in build/zdtm/ so a rebuild needs no network. Only test/zdtm is
# unpacked. Every test named in tests/e2e/zdtm/selection.toml (skipped ones too: a skip says
# why it is not run, not that it cannot be built) is linked statically, with the flags of zdtm's
# own Makefile, into build/zdtm/bin/, beside `subreaper` (tests/e2e/zdtm/subreaper.c), so the
# test image needs nothing but busybox. A stamp (CRIU version, test names, inputs' digests)
# makes a second run a no-op. Needs a C compiler with static glibc (build-essential) and
# python3 (reads the selection); apt only when the tarball is not kept yet.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=versions.env
. "$root/hack/versions.env"

say() { echo "[build-zdtm] $*"; }
die() { echo "[build-zdtm] error: $*" >&2; exit 1; }

out=${REKINDLE_ZDTM_DIR:-$root/build/zdtm}
selection=$root/tests/e2e/zdtm/selection.toml
helper=$root/tests/e2e/zdtm/subreaper.c
tarball=$out/criu_$REKINDLE_CRIU_VERSION.orig.tar.xz

names=$(python3 -c '
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(" ".join(t["name"] for t in tomllib.load(f)["test"]))' "$selection") \
    || die "cannot read the test names from $selection"
[ -n "$names" ] || die "no tests in $selection"

stamp=$(printf '%s\n' "criu $REKINDLE_CRIU_VERSION" "$names" \
        "$(sha256sum "$helper" "$0" | awk '{print $1}')")
if [ "$(cat "$out/bin/.stamp" 2>/dev/null || true)" = "$stamp" ]; then
    say "up to date ($(wc -w <<<"$names") tests in $out/bin)"
    exit 0
fi

mkdir -p "$out"
if [ ! -s "$tarball" ]; then
    dl=$(mktemp -d "${TMPDIR:-/tmp}/zdtm-src.XXXXXX")
    trap 'rm -rf "$dl"' EXIT
    chown _apt "$dl" 2>/dev/null || true  # apt fetches as _apt where it can
    spec="criu=$REKINDLE_CRIU_DEB_VERSION"
    line=$(cd "$dl" && apt-get source --print-uris -qq "$spec" 2>/dev/null | grep -E "\.orig\.tar\.[a-z]+' " \
           | head -n1) || true
    [ -n "$line" ] || die "apt has no source for $spec (is deb-src for sid configured? hack/install-deps.sh adds it)"
    read -r uri file _size hash <<<"$line"
    uri=${uri//\'/}
    say "fetching $file through apt"
    /usr/lib/apt/apt-helper -q download-file "$uri" "$dl/$file" "$hash" >/dev/null \
        || die "download of $file failed"
    mv "$dl/$file" "$tarball"
fi

src=$out/src
rm -rf "$src"
mkdir -p "$src"
tar -xf "$tarball" -C "$src" --strip-components=1 "criu-$REKINDLE_CRIU_VERSION/test/zdtm"
[ -d "$src/test/zdtm/static" ] || die "no test/zdtm/static in $tarball"

say "building $(wc -w <<<"$names") zdtm tests (log: $out/build.log)"
# shellcheck disable=SC2086 # names are words
if ! make -C "$src/test/zdtm/static" -j"$(nproc)" LDFLAGS=-static $names >"$out/build.log" 2>&1; then
    tail -n 40 "$out/build.log" >&2
    die "the zdtm build failed"
fi
rm -rf "$out/bin.new"
mkdir -p "$out/bin.new"
for t in $names; do
    install -m 0755 "$src/test/zdtm/static/$t" "$out/bin.new/$t"
done
cc -O2 -Wall -Wextra -Werror -static -o "$out/bin.new/subreaper" "$helper"
printf '%s\n' "$stamp" >"$out/bin.new/.stamp"
rm -rf "$out/bin"
mv "$out/bin.new" "$out/bin"
say "built $out/bin"
