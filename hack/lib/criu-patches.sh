# Sourced by hack/build-criu.sh and hack/install-deps.sh (after hack/versions.env): the patches
# the project's CRIU carries and the name a build of them goes by.
#
# Patches live in hack/criu-patches/*.patch (-p1 against CRIU's upstream tarball), applied in
# name order. A build passes criu_build_id to CRIU's make as GITID, so `criu --version` prints
# it ("GitID: v4.2.1-rekindle-<hash>"): the installer rebuilds when the CRIU in PATH does not
# carry exactly these patches, and only then.

criu_patch_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/criu-patches"

# criu_patches: the patch files, one a line, in the order they apply.
criu_patches() {
    find "$criu_patch_dir" -maxdepth 1 -type f -name '*.patch' 2>/dev/null | LC_ALL=C sort
}

# criu_build_id: the GitID of a build of REKINDLE_CRIU_VERSION with these patches.
criu_build_id() {
    local sum
    sum=$(criu_patches | while read -r p; do cat "$p"; done | sha256sum | cut -c1-12)
    echo "v${REKINDLE_CRIU_VERSION}-rekindle-${sum}"
}

# criu_gitid [criu]: the GitID a CRIU binary reports ('' when none).
criu_gitid() {
    "${1:-criu}" --version 2>/dev/null | awk '/^GitID:/ {print $2}'
}
