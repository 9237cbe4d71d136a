#!/usr/bin/env bash
# CI check: the project's dependency installer works on a fresh, minimal Debian 12.
#
#   hack/check-fresh-root.sh
#
# 1. debootstrap --variant=minbase bookworm from the archive apt already uses
#    (hack/lib/apt-sources.sh debian_archive_uri), once; the result is cached as a tarball under
#    build/fresh-root/, keyed by suite and include list;
# 2. unpack a fresh copy of it (every run), copy the installer into it (hack/install-deps.sh,
#    hack/build-criu.sh, hack/lib, hack/criu-patches, hack/versions.env) and run it there in a chroot, with the
#    apt sources debootstrap wrote: it installs the node's dependencies and builds CRIU;
# 3. pass only when the installer succeeds, `criu --version` in the chroot prints
#    REKINDLE_CRIU_VERSION of hack/versions.env, and a second run of the installer only
#    re-checks. A package missing from the project's own lists fails the check.
#    `criu check` needs a real node, not a chroot: REKINDLE_CRIU_SKIP_CHECK=1 skips it there.
#    The containerd 2.2/2.4 builds (hack/build-containerd.sh) are skipped there
#    (REKINDLE_CONTAINERD_BUILDS=0): each takes minutes of both cores and the Go module proxy,
#    and needs no package the fresh root could lack but Debian's Go, which it installs itself.
#
# Mounts (/proc, /sys, /dev in the copy) are made in private pid and mount namespaces of this
# script (unshare), so even a killed run leaves neither mounts nor processes behind; an exit
# also kills what still runs in the chroot, unmounts and removes the copy (trap), and the next
# run removes a copy a killed run left. Prints the time each step took.
# Needs root, debootstrap and unshare (util-linux).
# Env: FRESH_ROOT_SUITE (bookworm), FRESH_ROOT_INCLUDE (extra packages for debootstrap, comma
# separated; none by default), FRESH_ROOT_DIR (build/fresh-root), DEBIAN_MIRROR (the archive).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
self="$root/hack/check-fresh-root.sh"

say() { echo "[fresh-root] $*"; }
die() { echo "[fresh-root] error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, chroot, mounts)"
command -v debootstrap >/dev/null || die "debootstrap is missing (hack/install-deps.sh installs it)"
command -v unshare >/dev/null || die "unshare is missing (util-linux)"

# Everything below runs as pid 1 of its own pid and private mount namespaces: when it dies, by
# any signal, the kernel kills every process it started and its mounts vanish with them
# (--kill-child: the same when unshare itself is killed).
if [ "${REKINDLE_FRESH_ROOT_NS:-}" != 1 ] || [ "$$" -ne 1 ]; then
    exec unshare --mount --propagation private --pid --fork --kill-child --mount-proc -- \
        env REKINDLE_FRESH_ROOT_NS=1 bash "$self" "$@"
fi

# shellcheck source=lib/apt-sources.sh
. "$root/hack/lib/apt-sources.sh"
suite=${FRESH_ROOT_SUITE:-bookworm}
include=${FRESH_ROOT_INCLUDE:-}
work=${FRESH_ROOT_DIR:-$root/build/fresh-root}
chroot_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

t_start=$SECONDS
took() { echo "$((SECONDS - $1))s"; }

# mounts_below DIR: mount points at or below DIR, deepest first.
mounts_below() { findmnt -n -l -o TARGET | awk -v d="$1" '$0 == d || index($0, d "/") == 1' | sort -r; }
# unmount_below DIR: unmount everything below DIR; fails when something stays mounted.
unmount_below() {
    local m
    for m in $(mounts_below "$1"); do umount "$m" 2>/dev/null || umount -l "$m"; done
    [ -z "$(mounts_below "$1")" ]
}
# kill_in_root DIR: SIGKILL what still runs chrooted below DIR (a daemon a package started).
kill_in_root() {
    local p r deadline=$((SECONDS + 10)) left=1
    while [ "$left" -eq 1 ] && [ "$SECONDS" -lt "$deadline" ]; do
        left=0
        for p in /proc/[0-9]*; do
            r=$(readlink "$p/root" 2>/dev/null) || continue
            [ "$r" = "$1" ] || [ "${r#"$1"/}" != "$r" ] || continue
            kill -KILL "${p#/proc/}" 2>/dev/null || true
            left=1
        done
        [ "$left" -eq 0 ] || sleep 0.1
    done
}
# waitable CMD...: run CMD in the background and wait for it. Bash runs a trap only once the
# foreground command is over; `wait` lets INT/TERM stop the check at once.
waitable() { "$@" & wait "$!"; }

scratch=""  # the directory this run works in: a debootstrap target, then the fresh copy
cleanup() {
    local rc=$?
    set +e
    if [ -n "$scratch" ]; then
        kill_in_root "$scratch"
        if ! unmount_below "$scratch"; then
            echo "[fresh-root] error: still mounted under $scratch (not removed): $(mounts_below "$scratch")" >&2
            exit 1
        fi
        rm -rf --one-file-system "$scratch"
    fi
    say "$([ "$rc" -eq 0 ] && echo passed || echo FAILED) in $(took "$t_start")"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$work"
exec 9>"$work/.lock"
flock -n 9 || { say "another check is running in $work; waiting for it"; waitable flock 9; }
# Copies left by a killed run hold no mounts (they died with its namespaces): remove them, never
# crossing into another file system.
for stale in "$work"/root.* "$work"/debootstrap.*; do
    if [ -e "$stale" ]; then waitable rm -rf --one-file-system "$stale"; fi
done

# --- 1. the base tarball, cached by suite and include list -------------------------------------
key=$(printf '%s\n' "$suite" minbase "$include" | sha256sum | cut -c1-12)
base="$work/base-$suite-minbase-$key.tar"
if [ ! -s "$base" ]; then
    mirror=${DEBIAN_MIRROR:-$(debian_archive_uri)} || die "cannot tell which Debian archive apt uses"
    say "debootstrap --variant=minbase $suite from $mirror${include:+ with $include}"
    t=$SECONDS
    scratch=$(mktemp -d "$work/debootstrap.XXXXXX")
    waitable debootstrap --variant=minbase ${include:+--include="$include"} "$suite" "$scratch/root" "$mirror" \
            >"$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (log: ${work#"$root"/}/debootstrap.log)"; }
    unmount_below "$scratch" || die "cannot unmount what debootstrap left under $scratch"
    waitable tar -C "$scratch/root" --one-file-system -cf "$base.tmp" .
    mv "$base.tmp" "$base"
    waitable rm -rf --one-file-system "$scratch"
    scratch=""
    say "base cached as ${base#"$root"/} ($(du -h "$base" | cut -f1)) in $(took "$t")"
else
    say "base ${base#"$root"/} (cached)"
fi

# --- 2. a fresh copy, the installer inside it ---------------------------------------------------
t=$SECONDS
scratch=$(mktemp -d "$work/root.XXXXXX")
copy=$scratch
waitable tar -C "$copy" -xf "$base"
cp -L /etc/resolv.conf "$copy/etc/resolv.conf"
# apt in the chroot reaches the archive the way the host's apt does (proxies, date checks of a
# frozen snapshot); the sources stay those debootstrap wrote.
for key in Acquire::http::Proxy Acquire::https::Proxy Acquire::Check-Valid-Until Acquire::Check-Date; do
    val=""
    eval "$(apt-config shell val "$key")"
    [ -z "$val" ] || printf '%s "%s";\n' "$key" "$val"
done >"$copy/etc/apt/apt.conf.d/00host-access"
dest=/opt/rekindle/hack
mkdir -p "$copy$dest"
cp -a "$root/hack/install-deps.sh" "$root/hack/build-criu.sh" "$root/hack/build-containerd.sh" \
    "$root/hack/versions.env" "$root/hack/lib" "$root/hack/criu-patches" "$copy$dest/"
mount -t proc proc "$copy/proc"
mount -t sysfs sysfs "$copy/sys"
mount --rbind /dev "$copy/dev"
say "fresh copy ${copy#"$root"/} in $(took "$t")"

in_root() {
    chroot "$copy" /usr/bin/env -i PATH="$chroot_path" HOME=/root LANG=C.UTF-8 TERM=dumb \
        REKINDLE_CRIU_SKIP_CHECK=1 REKINDLE_CONTAINERD_BUILDS=0 "$@"
}

# --- 3. the installer, from nothing; then once more, which must only re-check -------------------
t=$SECONDS
say "running $dest/install-deps.sh in the chroot"
installer() { in_root bash "$dest/install-deps.sh" 2>&1 | sed -u 's/^/    /'; }
waitable installer \
    || die "the installer failed in a fresh $suite (is a package missing from hack/install-deps.sh or build-criu.sh?)"
say "installer done in $(took "$t")"

expected=$(env -i bash -c ". '$root/hack/versions.env' && echo \"\$REKINDLE_CRIU_VERSION\"")
got=$(in_root criu --version | awk '/^Version:/ {print $2}')
[ "$got" = "$expected" ] || die "criu --version in the chroot says '${got:-nothing}', wanted $expected"
say "criu --version in the chroot: $got"

t=$SECONDS
again=$(in_root bash "$dest/install-deps.sh" 2>&1) || { echo "$again" >&2; die "second run failed"; }
if grep -qE 'installing|extracting|building' <<<"$again"; then
    echo "$again" >&2
    die "a second run of the installer installed something again (not idempotent)"
fi
say "second run only re-checked, in $(took "$t"): ${again##*$'\n'}"
