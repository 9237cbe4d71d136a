#!/usr/bin/env bash
# Install the node's system dependencies from Debian's archive, idempotently.
#
# On Debian 12 (bookworm):
#   - apt sources (deb and deb-src) for trixie/sid/experimental at low pin priority, from the
#     site that already serves the machine's release (hack/lib/apt-sources.sh; bookworm stays
#     the default);
#   - containerd 1.7.24 from trixie (the primary runtime; NRI 0.6.1), its service left stopped;
#   - containerd 2.1.9 from sid, extracted (not installed) under /opt/rekindle/containerd-2.1;
#   - containerd 2.2 and 2.4 built from their Go module (hack/build-containerd.sh) under
#     /opt/rekindle/containerd-2.2 and -2.4, with Debian's Go from sid (not fatal when it fails);
#   - runc, CNI plugins (/usr/lib/cni), iptables, iproute2, util-linux, busybox-static,
#     build-essential (static glibc for the init), python3-venv;
#   - CRIU >= 4.2 with the project's patches (built by hack/build-criu.sh when missing, older or
#     without them: hack/lib/criu-patches.sh);
#   - promtool from trixie (tests: the chart's alert rules).
# Versions: hack/versions.env (each overridable from the environment). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
export DEBIAN_FRONTEND=noninteractive

say() { echo "[install-deps] $*"; }
die() { echo "[install-deps] error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root"
command -v apt-get >/dev/null || die "needs a Debian system (apt-get)"

# --- apt sources and pins ----------------------------------------------------------------
# shellcheck source=lib/apt-sources.sh
. "$here/lib/apt-sources.sh"
sources_changed=0
if ensure_extra_suites; then
    sources_changed=1
    say "wrote $REKINDLE_APT_SOURCES and $REKINDLE_APT_PIN"
else
    [ $? -eq 1 ] || die "cannot derive the Debian archive from the configured apt sources"
fi

apt_updated=0
apt_update() {
    if [ "$apt_updated" -eq 0 ]; then
        say "apt-get update"
        apt-get update -q >/dev/null
        apt_updated=1
    fi
}
[ "$sources_changed" -eq 0 ] || apt_update

installed_version() { dpkg-query -W -f='${db:Status-Abbrev} ${Version}' "$1" 2>/dev/null | awk '$1 == "ii" {print $2}'; }

# Keep package maintainer scripts from starting daemons (containerd) while we install:
# policy-rc.d is honoured by invoke-rc.d and deb-systemd-invoke.
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi

# --- base packages -----------------------------------------------------------------------
base=(runc containernetworking-plugins iptables iproute2 util-linux busybox-static
      build-essential python3 python3-venv xz-utils ca-certificates debootstrap)
missing=()
for p in "${base[@]}"; do [ -n "$(installed_version "$p")" ] || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    apt_update
    say "installing ${missing[*]}"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- containerd 1.7 (package) --------------------------------------------------------------
if [ "$(installed_version containerd)" != "$REKINDLE_CONTAINERD_VERSION" ]; then
    apt_update
    say "installing containerd=$REKINDLE_CONTAINERD_VERSION ($REKINDLE_CONTAINERD_SUITE)"
    apt-get install -y -q --no-install-recommends \
        "containerd=$REKINDLE_CONTAINERD_VERSION" >/dev/null
fi
# We run private containerd instances; the system service must not hold the default paths.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    if systemctl is-enabled --quiet containerd 2>/dev/null || systemctl is-active --quiet containerd 2>/dev/null; then
        say "stopping and disabling the system containerd service"
        systemctl disable --now containerd >/dev/null 2>&1 || true
    fi
fi

# --- containerd 2.1 (extracted, side by side) ----------------------------------------------
prefix21=$REKINDLE_CONTAINERD21_PREFIX
if [ "$(cat "$prefix21/.version" 2>/dev/null || true)" != "$REKINDLE_CONTAINERD21_VERSION" ]; then
    apt_update
    say "extracting containerd=$REKINDLE_CONTAINERD21_VERSION into $prefix21"
    dl=$(mktemp -d "${TMPDIR:-/tmp}/containerd21.XXXXXX")
    chown _apt "$dl" 2>/dev/null || true  # apt downloads as _apt when it can
    mkdir -p "$(dirname "$prefix21")"
    (cd "$dl" && apt-get download -q "containerd=$REKINDLE_CONTAINERD21_VERSION" >/dev/null)
    rm -rf "$prefix21.new"
    dpkg-deb -x "$dl"/containerd_*.deb "$prefix21.new"
    rm -rf "$dl"
    [ -x "$prefix21.new/usr/bin/containerd" ] && [ -x "$prefix21.new/usr/bin/containerd-shim-runc-v2" ] \
        || die "containerd $REKINDLE_CONTAINERD21_VERSION .deb lacks containerd or its shim"
    echo "$REKINDLE_CONTAINERD21_VERSION" >"$prefix21.new/.version"
    rm -rf "$prefix21"
    mv "$prefix21.new" "$prefix21"
fi

# --- containerd 2.2 and 2.4 (built from their Go module, side by side) ---------------------
# Not fatal: without the Go module proxy (or with REKINDLE_CONTAINERD_BUILDS=0) the node keeps
# what its prefixes hold, and hack/test.sh says which runtime it could not test.
built=""
if [ "$REKINDLE_CONTAINERD_BUILDS" = 1 ]; then
    for rt in 22 24; do
        vvar=REKINDLE_CONTAINERD${rt}_VERSION pvar=REKINDLE_CONTAINERD${rt}_PREFIX
        if [ "$(cat "${!pvar}/.version" 2>/dev/null || true)" != "${!vvar}" ]; then
            apt_update
            "$here/build-containerd.sh" "${!vvar}" "${!pvar}" \
                || say "warning: containerd ${!vvar} not built; the e2e tests cannot run on it here"
        fi
        if [ -x "${!pvar}/usr/bin/containerd" ]; then built+=", containerd-${rt:0:1}.${rt:1} $(cat "${!pvar}/.version")"; fi
    done
fi

# --- promtool (the chart's alert rules are tested with `promtool test rules`) ---------------
if [ "$(installed_version promtool)" != "$REKINDLE_PROMTOOL_VERSION" ]; then
    apt_update
    say "installing promtool=$REKINDLE_PROMTOOL_VERSION"
    apt-get install -y -q --no-install-recommends "promtool=$REKINDLE_PROMTOOL_VERSION" >/dev/null
fi

# --- CRIU ----------------------------------------------------------------------------------
criu_version() { criu --version 2>/dev/null | awk '/^Version:/ {print $2}'; }
# shellcheck source=lib/criu-patches.sh
. "$here/lib/criu-patches.sh"
cv=$(criu_version || true)
want_id=$(criu_build_id)
have_id=$(criu_gitid || true)
if [ -z "$cv" ] || ! dpkg --compare-versions "$cv" ge "$REKINDLE_CRIU_MIN_VERSION" || [ "$have_id" != "$want_id" ]; then
    # A CRIU without the project's patches (hack/criu-patches) cannot dump a non-root tree on a
    # node without CAP_SYS_RESOURCE: rebuild it too.
    say "criu ${cv:-missing}${have_id:+ ($have_id)} is not $REKINDLE_CRIU_VERSION with the project's patches ($want_id): building it"
    apt_update
    "$here/build-criu.sh"
    hash -r
    cv=$(criu_version)
    dpkg --compare-versions "$cv" ge "$REKINDLE_CRIU_MIN_VERSION" \
        || die "criu in PATH is $cv after the build (is $REKINDLE_CRIU_PREFIX/sbin in PATH?)"
    [ "$(criu_gitid)" = "$want_id" ] || die "criu in PATH is not the build $want_id (is $REKINDLE_CRIU_PREFIX/sbin first in PATH?)"
fi

# --- checks --------------------------------------------------------------------------------
for plugin in bridge host-local loopback portmap; do
    [ -x "/usr/lib/cni/$plugin" ] || die "CNI plugin /usr/lib/cni/$plugin missing"
done
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -n "$(find /usr/lib -name libc.a -print -quit)" ] \
    || die "static libc (libc6-dev) missing"
say "containerd $(containerd --version | awk '{print $3}'), containerd-2.1 $("$prefix21/usr/bin/containerd" --version | awk '{print $3}')$built, $(runc --version | head -n1), criu $cv, $(promtool --version | head -n1 | awk '{print "promtool", $3}'), CNI in /usr/lib/cni"
