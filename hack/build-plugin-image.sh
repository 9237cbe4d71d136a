#!/usr/bin/env bash
# Build the plugin image locally, without docker or a registry, as an OCI
# archive that `ctr images import` takes (the same content as the Dockerfile,
# on Debian bookworm so that the CRIU built by hack/build-criu.sh fits its libs).
#
#   hack/build-plugin-image.sh                 build build/plugin-image/plugin.oci.tar
#   hack/build-plugin-image.sh --import SOCK   ... and import it into the containerd at SOCK
#
# Steps: debootstrap a minbase bookworm rootfs with python3, util-linux,
# iproute2, tar and CRIU's shared libraries (cached in build/plugin-image/base);
# add CRIU (${CRIU:-/usr/local/sbin/criu}), the static init and the host-view
# launcher (make build/rekindle-init build/hostexec/rekindle-hostexec) and the
# project with its Python dependencies (pip, from the project's wheel); drop
# docs, locales and apt lists; pack it with devtools/pack_rootfs.py as
# localhost/rekindle/plugin:<version>.
# Needs root, debootstrap, the Debian archive apt is configured with, and PyPI.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
# shellcheck source=lib/apt-sources.sh
. "$root/hack/lib/apt-sources.sh"
mirror=${DEBIAN_MIRROR:-$(debian_archive_uri)}
suite=${DEBIAN_SUITE:-bookworm}
criu=${CRIU:-/usr/local/sbin/criu}
work=${PLUGIN_IMAGE_DIR:-$root/build/plugin-image}
address=""
ctr_bin=${CTR:-ctr}

while [ $# -gt 0 ]; do
  case "$1" in
    --import) address=$2; shift 2 ;;
    --ctr) ctr_bin=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

die() { echo "build-plugin-image: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (debootstrap)"
command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"
[ -x "$criu" ] || die "no CRIU at $criu (hack/build-criu.sh builds it; or set CRIU=)"

version=$("$py" -c 'import tomllib,sys; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
name=${IMAGE_NAME:-localhost/rekindle/plugin:$version}
mkdir -p "$work"

# 1. base rootfs, cached
base="$work/base"
libs="libbsd0,libgnutls30,libnftables1,libprotobuf-c1,libnl-3-200,libnet1,libuuid1"
include="python3,util-linux,iproute2,tar,ca-certificates,$libs"
stamp="$suite $include"
if [ ! -f "$base/.rekindle-base" ] || [ "$(cat "$base/.rekindle-base")" != "$stamp" ]; then
  echo "debootstrap $suite -> $base"
  rm -rf "$base"
  debootstrap --variant=minbase --include="$include" "$suite" "$base" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed (log: $work/debootstrap.log)"; }
  echo "$stamp" >"$base/.rekindle-base"
fi

# 2. the image rootfs
rootfs="$work/rootfs"
rm -rf "$rootfs"
cp -a "$base" "$rootfs"
rm -f "$rootfs/.rekindle-base"

# CRIU and its libraries (every library it needs must resolve inside the rootfs)
install -D -m 0755 "$criu" "$rootfs/usr/local/sbin/criu"
missing=$(chroot "$rootfs" ldd /usr/local/sbin/criu | grep 'not found' || true)
[ -z "$missing" ] || die "CRIU libraries missing in the image: $missing"

# the static init, where the plugin looks for it (nri_plugin/config.py)
make --no-print-directory build/rekindle-init build/hostexec/rekindle-hostexec
install -D -m 0755 build/rekindle-init "$rootfs/usr/local/lib/rekindle/rekindle-init"
# the launcher that runs this CRIU in the host's mount namespace (runtime/container/hostview.py), and its
# shims: links named after what CRIU runs by name
hostexec=/usr/local/lib/rekindle/hostexec
install -D -m 0755 build/hostexec/rekindle-hostexec "$rootfs$hostexec/rekindle-hostexec"
mkdir -p "$rootfs$hostexec/bin"
for p in tar gzip; do
  ln -sfn ../rekindle-hostexec "$rootfs$hostexec/bin/$p"
  missing=$(chroot "$rootfs" sh -c "ldd \"\$(command -v $p)\"" | grep 'not found' || true)
  [ -z "$missing" ] || die "$p libraries missing in the image: $missing"
done

# the project and its dependencies, for the rootfs's python3
pyver=$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
rm -rf "$work/wheels"
"$py" -m pip wheel --quiet --no-deps --wheel-dir "$work/wheels" "$root"
site=/opt/rekindle/site-packages
"$py" -m pip install --quiet --no-compile --target "$rootfs$site" \
  --python-version "$pyver" --implementation cp --only-binary=:all: \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
  "$(echo "$work"/wheels/rekindle-*.whl)[kubernetes]"  # the optional client: Events (--events)
rm -rf "$rootfs$site/bin"
echo "$site" >"$rootfs/usr/lib/python3/dist-packages/rekindle.pth"
cat >"$rootfs/usr/local/bin/rekindle" <<'PY'
#!/usr/bin/python3
import sys

from nri_plugin.cli import main

sys.exit(main())
PY
chmod 0755 "$rootfs/usr/local/bin/rekindle"
chroot "$rootfs" python3 -c 'import nri_plugin, runtime, grpc, google.protobuf, tomlkit, prometheus_client, kubernetes.client' \
  || die "the project does not import inside the image"
# the dev harness (devtools/: sandbox, kubelet stand-in, demo) is not part of the package
if chroot "$rootfs" python3 -c 'import devtools' 2>/dev/null; then die "devtools/ must not ship in the image"; fi

# 3. trim
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
  "$rootfs"/usr/share/locale/* "$rootfs"/usr/share/lintian "$rootfs"/usr/share/common-licenses
find "$rootfs" -name __pycache__ -type d -prune -exec rm -rf {} +

# 4. pack (and import)
out="$work/plugin.oci.tar"
args=("$rootfs" "$name" "$out")
[ -n "$address" ] && args+=(--address "$address" --ctr "$ctr_bin")
"$py" -m devtools.pack_rootfs "${args[@]}"
