"""Pack a root filesystem directory as a one-layer OCI image archive (devtools.images).

    python -m devtools.pack_rootfs ROOTFS NAME OUT.oci.tar [--address SOCK --ctr CTR]

Regular files, directories and symlinks are packed with their permission bits
(setuid included), owned by root; hard links become copies; device nodes,
sockets and fifos are left out (the runtime provides /dev). With --address the
archive is imported into containerd's k8s.io namespace.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

from devtools import images

SKIP_CONTENT = {"proc", "sys", "dev", "run", "tmp"}  # kept as empty dirs


def rootfs_entries(rootfs: Path) -> list[images.Entry]:
    entries: list[images.Entry] = []
    for dirpath, dirnames, filenames in os.walk(rootfs):
        rel_dir = os.path.relpath(dirpath, rootfs)
        if rel_dir != "." and rel_dir.split(os.sep)[0] in SKIP_CONTENT:
            dirnames[:] = []
            continue
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                entries.append(images.Symlink(rel, os.readlink(full)))
                if name in dirnames:
                    dirnames.remove(name)  # never follow
            elif stat.S_ISDIR(st.st_mode):
                entries.append(images.Dir(rel, mode))
            elif stat.S_ISREG(st.st_mode):
                entries.append(images.File(rel, source=Path(full), mode=mode))
    return entries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rootfs", type=Path)
    p.add_argument("name", help="image name, e.g. localhost/rekindle/plugin:0.1.0")
    p.add_argument("out", type=Path)
    p.add_argument("--entrypoint", default="rekindle")
    p.add_argument("--address", help="containerd socket to import into")
    p.add_argument("--ctr", default="ctr")
    args = p.parse_args(argv)
    entries = rootfs_entries(args.rootfs)
    spec = images.ImageSpec(
        args.name, lambda: [entries], entrypoint=[args.entrypoint],
        env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"])
    images.write_oci_archive(spec, args.out)
    print(f"{args.name}\t{args.out}\t{args.out.stat().st_size} bytes")
    if args.address:
        images.import_archive(args.out, args.address, args.ctr)
        print(f"imported {args.name} into {args.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
