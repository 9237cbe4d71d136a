"""Locally built OCI images for the sandbox and the tests (no registry is reachable).

Contract:
- :func:`write_oci_archive` writes an OCI image-layout tar (``oci-layout``, ``index.json``
  whose manifest carries the ``io.containerd.image.name`` annotation, config and gzip layer
  blobs under ``blobs/sha256/``) that ``ctr images import`` accepts.
- Layers are built deterministically (mtime 0, uid/gid 0, sorted entries, gzip mtime 0), so
  the same inputs give the same digests and images share their busybox base layer.
- :data:`IMAGES` is the table of the project's images; adding one is one :class:`ImageSpec`.
  :func:`build_all` writes the archives, :func:`import_archive` imports one with ``ctr``.

Run ``python -m devtools.images --address SOCK [--ctr PATH] [--out DIR]`` to build and import
them all into the ``k8s.io`` namespace of a containerd.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from runtime.errors import RekindleError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
BUSYBOX = Path(os.environ.get("REKINDLE_BUSYBOX", "/bin/busybox"))

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


class ImageBuildError(RekindleError):
    """An image could not be built or imported."""


# --- layer entries ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Dir:
    path: str
    mode: int = 0o755


@dataclass(frozen=True)
class File:
    path: str
    data: bytes | None = None  # content, or
    source: Path | None = None  # a host file to copy
    mode: int = 0o644


@dataclass(frozen=True)
class Symlink:
    path: str
    target: str


Entry = Dir | File | Symlink


def build_layer(entries: Sequence[Entry]) -> tuple[bytes, str]:
    """Return (uncompressed tar bytes, diff_id) for the entries; parents are added as dirs."""
    by_path: dict[str, Entry] = {}
    for e in entries:
        rel = e.path.strip("/")
        parts = rel.split("/")
        for i in range(1, len(parts)):  # implicit parent directories
            by_path.setdefault("/".join(parts[:i]), Dir("/".join(parts[:i])))
        by_path[rel] = e
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(by_path):
            e = by_path[rel]
            info = tarfile.TarInfo(rel)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if isinstance(e, Dir):
                info.type, info.mode = tarfile.DIRTYPE, e.mode
                tar.addfile(info)
            elif isinstance(e, Symlink):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, e.target, 0o777
                tar.addfile(info)
            else:
                data = e.data if e.data is not None else Path(e.source).read_bytes()  # type: ignore[arg-type]
                info.size, info.mode = len(data), e.mode
                tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return raw, "sha256:" + hashlib.sha256(raw).hexdigest()


def busybox_rootfs(busybox: Path = BUSYBOX, applets: bool = True) -> list[Entry]:
    """A self-contained rootfs: static busybox, its applet symlinks, a minimal /etc."""
    entries: list[Entry] = [File("/bin/busybox", source=busybox, mode=0o755)]
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "var", "run", "proc", "sys", "dev"):
        entries.append(Dir(d, 0o700 if d == "root" else 0o755))
    entries.append(Dir("tmp", 0o1777))
    entries.append(File("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"))
    entries.append(File("/etc/group", b"root:x:0:\nnogroup:x:65534:\n"))
    names = {"bin/sh"}
    if applets:
        out = subprocess.run([str(busybox), "--list-full"], check=True, capture_output=True, text=True).stdout
        names |= {line.strip() for line in out.splitlines() if line.strip()}
    names.discard("bin/busybox")
    entries += [Symlink(n, "/bin/busybox") for n in sorted(names)]
    return entries


# --- image table -----------------------------------------------------------------------------

# The pause process: sleeps until SIGTERM/SIGINT, then exits 0 (sleep runs in the background so
# the trap fires at once).
PAUSE_SCRIPT = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"


@dataclass(frozen=True)
class ImageSpec:
    name: str
    layers: Callable[[], list[list[Entry]]]  # lazily, so a missing input only hits its image
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
    requires: tuple[Path, ...] = ()  # inputs that must exist, else the image is skipped


def _counter_layer() -> list[Entry]:
    return [File("/usr/local/bin/counter-server", source=REPO_ROOT / "build/counter-server", mode=0o755),
            File("/etc/counter/delete-me", b"this file is deleted by the workload\n")]


def host_usr_rootfs() -> list[Entry]:
    """An empty merged-/usr rootfs: the node's /usr (or parts of it) is bind-mounted over it.

    For GPU workloads that run the node's own Python and driver (devtools.gpu):
    bin, sbin, lib and lib64 point into /usr as on the node (Debian/Ubuntu merged /usr).
    """
    entries: list[Entry] = [Symlink(n, f"usr/{n}") for n in ("bin", "sbin", "lib", "lib64")]
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/local/nvidia", "opt", "etc", "root",
              "var", "run", "proc", "sys", "dev", "workload"):
        entries.append(Dir(d, 0o700 if d == "root" else 0o755))
    entries.append(Dir("tmp", 0o1777))
    entries.append(File("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"))
    entries.append(File("/etc/group", b"root:x:0:\nnogroup:x:65534:\n"))
    return entries


IMAGES: list[ImageSpec] = [
    ImageSpec("localhost/rekindle/pause:1", lambda: [busybox_rootfs(applets=False) + [Symlink("bin/sleep", "/bin/busybox")]],
              entrypoint=["/bin/sh", "-c", PAUSE_SCRIPT]),
    ImageSpec("localhost/rekindle/busybox:1", lambda: [busybox_rootfs()], cmd=["/bin/sh"]),
    ImageSpec("localhost/rekindle/counter:1", lambda: [busybox_rootfs(), _counter_layer()],
              cmd=["/usr/local/bin/counter-server"], requires=(REPO_ROOT / "build/counter-server",)),
    ImageSpec("localhost/rekindle/host-usr:1", lambda: [host_usr_rootfs()], cmd=["/bin/sh"]),
]


# --- archive -----------------------------------------------------------------------------------

def _blob(tar: tarfile.TarFile, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))
    return {"digest": digest, "size": len(data)}


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_oci_archive(spec: ImageSpec, out: Path) -> Path:
    """Write spec as an OCI image-layout tar at out; returns out."""
    layers = []
    for entries in spec.layers():
        raw, diff_id = build_layer(entries)
        layers.append((gzip.compress(raw, compresslevel=6, mtime=0), diff_id))
    config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {k: v for k, v in (("Entrypoint", spec.entrypoint), ("Cmd", spec.cmd), ("Env", spec.env)) if v},
        "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "devtools.images"} for _ in layers],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        cfg = _blob(tar, _json(config))
        manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                    "config": {"mediaType": MT_CONFIG, **cfg},
                    "layers": [{"mediaType": MT_LAYER, **_blob(tar, gz)} for gz, _ in layers]}
        man = _blob(tar, _json(manifest))
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                 "manifests": [{"mediaType": MT_MANIFEST, **man,
                                "annotations": {"io.containerd.image.name": spec.name}}]}
        for name, data in (("oci-layout", _json({"imageLayoutVersion": "1.0.0"})), ("index.json", _json(index))):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    return out


def archive_name(spec: ImageSpec) -> str:
    return spec.name.rsplit("/", 1)[-1].replace(":", "_") + ".oci.tar"


def build_all(out_dir: Path, images: Sequence[ImageSpec] = IMAGES) -> list[tuple[ImageSpec, Path]]:
    """Build every image whose inputs exist; missing inputs skip that image with a warning."""
    built = []
    for spec in images:
        missing = [str(p) for p in spec.requires if not p.exists()]
        if missing:
            log.warning("skipping image %s: missing %s (run make)", spec.name, ", ".join(missing))
            continue
        built.append((spec, write_oci_archive(spec, out_dir / archive_name(spec))))
    return built


def import_archive(archive: Path, address: str, ctr: str = "ctr", namespace: str = "k8s.io") -> None:
    """Import (and unpack) an OCI archive with ``ctr``; idempotent."""
    # ctr unpacks into the default (overlayfs) snapshotter, which CRI uses too.
    cmd = [ctr, "--address", address, "-n", namespace, "images", "import", str(archive)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ImageBuildError(f"ctr import {archive} failed: {res.stderr.strip() or res.stdout.strip()}")


def build_and_import(out_dir: Path, address: str, ctr: str = "ctr") -> list[str]:
    """Build all images into out_dir and import them; returns the imported names."""
    names = []
    for spec, path in build_all(out_dir):
        import_archive(path, address, ctr)
        log.info("imported %s", spec.name)
        names.append(spec.name)
    return names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.images", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="containerd socket to import into (omit to only build)")
    p.add_argument("--ctr", default=shutil.which("ctr") or "ctr")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "build/images")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.address:
            build_and_import(args.out, args.address, args.ctr)
        else:
            for spec, path in build_all(args.out):
                print(f"{spec.name}\t{path}")
    except (RekindleError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
