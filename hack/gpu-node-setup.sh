#!/usr/bin/env bash
# Make a bare GPU node (driver + PyTorch, no containerd/runc/CRIU/CNI) ready for the sandbox and
# the GPU end-to-end test, from the archive made by hack/gpu-bundle.sh. Run as root from the
# repository root:
#
#   hack/gpu-node-setup.sh [BUNDLE]     (default .carry/gpu-bundle.tar.xz)
#   . /opt/rekindle-bundle/env.sh       (what the script exported, for later shells)
#
# - unpacks into $REKINDLE_BUNDLE_DIR (default /opt/rekindle-bundle);
# - runc and criu are run through small wrappers that alone put the bundle's libraries on
#   LD_LIBRARY_PATH (the node's Python and PyTorch never see them);
# - busybox applets fill in tools the node lacks (e.g. ip), after the node's own on PATH;
# - installs the wheels into <bundle>/site, first on PYTHONPATH;
# - copies rekindle-init and counter-server into build/ when they are missing;
# - brings the sandbox up (python -m devtools.sandbox up) unless REKINDLE_SETUP_NO_SANDBOX=1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=${1:-$root/.carry/gpu-bundle.tar.xz}
dest=${REKINDLE_BUNDLE_DIR:-/opt/rekindle-bundle}
py=${PYTHON:-$(command -v python3)}

[ "$(id -u)" = 0 ] || { echo "gpu-node-setup: needs root" >&2; exit 1; }
[ -f "$bundle" ] || { echo "gpu-node-setup: no bundle at $bundle (make it with hack/gpu-bundle.sh)" >&2; exit 1; }

rm -rf "$dest"
mkdir -p "$dest"
xz -dc "$bundle" | tar -C "$dest" -xf -
chmod 0755 "$dest"
mkdir -p "$dest/libexec" "$dest/fallback"
for b in runc criu; do
  mv "$dest/bin/$b" "$dest/libexec/$b"
  cat > "$dest/bin/$b" <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$dest/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec $dest/libexec/$b "\$@"
EOF
  chmod 0755 "$dest/bin/$b"
done
# busybox applets for what the node lacks (looked up before the bundle is on PATH).
for a in $("$dest/bin/busybox" --list); do
  command -v "$a" >/dev/null 2>&1 || ln -sf ../bin/busybox "$dest/fallback/$a"
done

wheels=$(ls "$dest"/wheels/*.whl | grep -v typing_extensions)
"$py" -c 'import typing_extensions' 2>/dev/null || wheels="$wheels $(ls "$dest"/wheels/typing_extensions-*.whl)"
# shellcheck disable=SC2086
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dest/site" $wheels

mkdir -p "$root/build"
for b in rekindle-init counter-server; do
  [ -x "$root/build/$b" ] || install -m 0755 "$dest/build/$b" "$root/build/$b"
done

cat > "$dest/env.sh" <<EOF
export PATH=$dest/bin:\$PATH:$dest/fallback
export PYTHONPATH=$dest/site\${PYTHONPATH:+:\$PYTHONPATH}
export REKINDLE_CONTAINERD_BIN_DIR=$dest/bin
export REKINDLE_CNI_BIN_DIR=$dest/cni
export REKINDLE_CRIU=$dest/bin/criu
export REKINDLE_BUSYBOX=$dest/bin/busybox
EOF
# shellcheck disable=SC1091
. "$dest/env.sh"

echo "gpu-node-setup: bundle in $dest"
cat "$dest/VERSIONS"
echo "fallback applets: $(ls "$dest/fallback" | wc -l) ($(ls "$dest/fallback" | grep -xE 'ip|mknod|tar|nsenter|unshare' | tr '\n' ' '))"
"$py" -c 'import grpc, google.protobuf as p, tomlkit; print("python:", "grpcio", grpc.__version__, "protobuf", p.__version__)'
criu check >/dev/null 2>&1 && echo "criu check: ok" || { echo "criu check:"; criu check 2>&1 | tail -5; }

if [ "${REKINDLE_SETUP_NO_SANDBOX:-0}" != 1 ]; then
  cd "$root"
  "$py" -m devtools.sandbox up
fi
