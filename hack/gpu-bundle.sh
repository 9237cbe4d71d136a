#!/usr/bin/env bash
# Pack what a bare GPU node (Ubuntu 24.04, driver and PyTorch installed, nothing else) lacks to
# run the sandbox and the GPU end-to-end test into ONE archive, to be unpacked there by
# hack/gpu-node-setup.sh:
#
#   bin/     containerd, containerd-shim-runc-v2, ctr (containerd 1.7.24), runc, criu (4.2.1),
#            busybox (static)
#   lib/     the shared libraries of runc and criu (glibc and the loader excluded); only the
#            wrappers made by gpu-node-setup.sh put them on LD_LIBRARY_PATH
#   cni/     CNI plugins bridge, host-local, loopback
#   build/   rekindle-init and counter-server (make)
#   wheels/  protobuf, tomlkit and grpcio wheels for CPython 3.12 (our generated stubs need
#            protobuf >= 7.35 and grpcio >= 1.85), and typing_extensions (grpcio's one need,
#            installed only where the node's Python lacks it)
#
#   hack/gpu-bundle.sh [OUT]      (default OUT: .carry/gpu-bundle.tar.xz; keep it out of git)
#
# Inputs from this machine (override with the variables): REKINDLE_CONTAINERD_BIN_DIR
# (/usr/bin), RUNC (runc on PATH), REKINDLE_CRIU (/usr/local/sbin/criu), REKINDLE_CNI_BIN_DIR
# (/usr/lib/cni), REKINDLE_BUSYBOX (/bin/busybox), REKINDLE_WHEELS (a folder that already holds
# the wheels; otherwise pip downloads them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/.carry/gpu-bundle.tar.xz}
max_bytes=$((64 * 1024 * 1024))

ctrd_dir=${REKINDLE_CONTAINERD_BIN_DIR:-/usr/bin}
runc=${RUNC:-$(command -v runc)}
criu=${REKINDLE_CRIU:-/usr/local/sbin/criu}
cni_dir=${REKINDLE_CNI_BIN_DIR:-/usr/lib/cni}
busybox=${REKINDLE_BUSYBOX:-/bin/busybox}
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
wheels=(protobuf==7.36.2 tomlkit==0.15.2 grpcio==1.85.1 blake3==1.0.11 prometheus_client==0.26.0 typing_extensions==4.15.0)

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,lib,cni,build,wheels}

need() { [ -e "$1" ] || { echo "gpu-bundle: missing $1" >&2; exit 1; }; }

for b in containerd containerd-shim-runc-v2 ctr; do
  need "$ctrd_dir/$b"; install -m 0755 "$ctrd_dir/$b" "$stage/bin/$b"
done
need "$runc"; install -m 0755 "$(readlink -f "$runc")" "$stage/bin/runc"
need "$criu"; install -m 0755 "$criu" "$stage/bin/criu"
need "$busybox"; install -m 0755 "$busybox" "$stage/bin/busybox"
for p in bridge host-local loopback; do
  need "$cni_dir/$p"; install -m 0755 "$cni_dir/$p" "$stage/cni/$p"
done

# Shared libraries of runc and criu, except glibc's own (the node's glibc is newer) and the loader.
for b in "$stage/bin/runc" "$stage/bin/criu"; do
  ldd "$b" | awk '/=> \//{print $3}' | while read -r so; do
    case "$(basename "$so")" in
      libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libresolv.so.*) continue ;;
    esac
    cp -L "$so" "$stage/lib/$(basename "$so")"
  done
done

make -C "$root" --no-print-directory >/dev/null
install -m 0755 "$root/build/rekindle-init" "$root/build/counter-server" "$stage/build/"

if [ -n "${REKINDLE_WHEELS:-}" ]; then
  for w in "${wheels[@]}"; do
    f=$(ls "$REKINDLE_WHEELS"/"${w%%==*}"-"${w##*==}"-*.whl 2>/dev/null | sed -n 1p)
    [ -n "$f" ] || { echo "gpu-bundle: no wheel for $w in $REKINDLE_WHEELS" >&2; exit 1; }
    cp "$f" "$stage/wheels/"
  done
else
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$stage/wheels" "${wheels[@]}" \
    || { echo "gpu-bundle: pip could not download ${wheels[*]}; put them in a folder and name it in REKINDLE_WHEELS" >&2; exit 1; }
fi

strip --strip-unneeded "$stage"/bin/* "$stage"/cni/* "$stage"/build/* "$stage"/lib/* 2>/dev/null || true
{
  echo "made: $(date -u +%FT%TZ)"
  "$stage/bin/containerd" --version
  "$stage/bin/runc" --version | sed -n 1p
  LD_LIBRARY_PATH="$stage/lib" "$stage/bin/criu" --version | sed -n 1p
  ls "$stage/wheels"
} > "$stage/VERSIONS"

mkdir -p "$(dirname "$out")"
tar -C "$stage" -cf - . | xz -9 -T0 > "$out.tmp"
mv "$out.tmp" "$out"
size=$(stat -c %s "$out")
echo "gpu-bundle: $out ($((size / 1024 / 1024)) MiB)"
cat "$stage/VERSIONS"
if [ "$size" -gt "$max_bytes" ]; then
  echo "gpu-bundle: $out is over 64 MiB" >&2
  exit 1
fi
