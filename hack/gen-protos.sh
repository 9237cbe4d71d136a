#!/usr/bin/env bash
# Regenerate the protobuf modules from the upstream .proto files that Debian ships:
#   NRI api.proto 0.8.0 (golang-github-containerd-nri-dev, sid) + the NRI 0.10 `args` field,
#   CRI api.proto       (golang-github-kubernetes-cri-api-dev, trixie),
#   containerd containers.proto (golang-github-containerd-containerd-dev, bookworm),
#   CRIU's image schemas (CRIU's source package, the version hack/versions.env pins).
# gogoproto imports and options are stripped (they only steer Go code generation).
# The generated *_pb2.py files are committed; run this only to refresh them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q \
    golang-github-containerd-nri-dev=0.8.0-1 \
    golang-github-kubernetes-cri-api-dev \
    golang-github-containerd-containerd-dev >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/x"; done
src=$work/x/usr/share/gocode/src

strip_gogo() {
    sed -E -e '/import .*gogo(proto)?\/gogo\.proto";/d' \
           -e '/^option \(gogoproto\./d' \
           -e 's/ \[\(gogoproto\.[^]]*\]//g' "$1"
}

nri=nri_plugin/proto/nri_api.proto
strip_gogo "$src/github.com/containerd/nri/pkg/api/api.proto" \
  | sed -E 's/^(  repeated CDIDevice CDI_devices = 8;)$/\1\n  repeated string args = 9;  \/\/ NRI >= 0.10 (containerd >= 2.2); older runtimes ignore it/' > "$nri"
grep -q 'string args = 9' "$nri" || { echo "failed to add ContainerAdjustment.args" >&2; exit 1; }
strip_gogo "$src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto" > runtime/containerd/proto/cri_api.proto
strip_gogo "$src/github.com/containerd/containerd/api/services/containers/v1/containers.proto" \
  > runtime/containerd/proto/containers.proto

"$PY" -m grpc_tools.protoc -I . --python_out=. "$nri" nri_plugin/proto/ttrpc.proto
"$PY" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
    runtime/containerd/proto/cri_api.proto runtime/containerd/proto/containers.proto

# CRIU's image schemas (pagemap, mm, vma, pstree, core and their options), from CRIU's source package
# as apt fetches it (the deb-src entries of hack/lib/apt-sources.sh). Imports between the
# generated modules are made package-relative.
. hack/versions.env
line=$(cd "$work" && apt-get source --print-uris -qq "criu=$REKINDLE_CRIU_DEB_VERSION" | grep -E "\.orig\.tar\.[a-z]+' " | head -n1)
read -r uri file _size hash <<<"$line"
/usr/lib/apt/apt-helper -q download-file "${uri//\'/}" "$work/$file" "$hash" >/dev/null
tar -xf "$work/$file" -C "$work"
imgs=$(find "$work" -maxdepth 3 -type d -path '*/criu-*/images' | head -n1)
out=runtime/criu/proto
mkdir -p "$out"
# core.proto (each thread's registers, sigaltstack and rseq area: runtime.criu.image_files.written_after_restore)
# and what it imports.
core="core core-x86 core-arm core-aarch64 core-ppc64 core-s390 core-mips core-loongarch64 core-riscv64
      rlimit timer creds sa siginfo rseq"
"$PY" -m grpc_tools.protoc -I "$imgs" --python_out="$out" \
    "$imgs/opts.proto" "$imgs/vma.proto" "$imgs/mm.proto" "$imgs/pagemap.proto" "$imgs/pstree.proto" \
    "$imgs/fown.proto" "$imgs/regfile.proto" $(for p in $core; do echo "$imgs/$p.proto"; done)
sed -i -E 's/^import ([a-z0-9_]+_pb2) as /from . import \1 as /' "$out"/*_pb2.py
echo "generated: $(ls nri_plugin/proto/*_pb2.py runtime/containerd/proto/*_pb2*.py "$out"/*_pb2.py | tr '\n' ' ')"
