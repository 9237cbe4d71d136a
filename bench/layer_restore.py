"""Where a writable layer's restore goes, phase by phase, against one read and one write of it.

    python -m bench.layer_restore [--mib 1024] [--files 16] [--small 2000] [--rounds 3] [--work DIR]
                                  [--json OUT]

Root (it mounts an overlay as the target, as a container's rootfs is). Makes an upperdir of
``--mib`` MiB in ``--files`` regular files plus ``--small`` 4 KiB files, captures it (as a
checkpoint does, with the chunk digests the restore now reads), and then, each round, times in
one run:

- ``cat``: read the archive and write it to one new file (1 MiB ``read``/``write``): one read and
  one write of its bytes, the floor any restore of it pays;
- ``cat_hash``: the same, hashing what is read (BLAKE3): the floor of a verified copy;
- ``stage``: the staging copy a restore made before (``Artifact.copy_verified``: read, hash,
  write to a private file), and ``apply_staged``: the apply of that copy (its check pass, then
  ``copy_file_range`` of each member into the rootfs); ``staged`` is the two together;
- ``streamed``: the apply straight from the store's file, each 1 MiB chunk verified before use
  (``runtime.overlay.verified``), with no stage;
- ``cold_write``: what a workload that makes the same files at start pays to write them (the
  same bytes, from memory, into the overlay; no generation cost): a lower bound of its cold start.

Before each case the archive's pages are dropped from the page cache (``POSIX_FADV_DONTNEED`` on
that file only) and everything written earlier is synced, so each reads the store from disk and
finds no earlier writeback queued; each round starts with the next case. Medians of ``--rounds``,
each case's ratio to ``cat`` printed, and the same for the fastest round of each (on a shared
node the least disturbed one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

from runtime.digests import hash_fd, new_hash
from runtime.overlay.rootfs import apply, capture
from runtime.overlay.verified import VerifiedArchive, chunk_sums

_MIB = 1 << 20


def _make_upper(upper: str, mib: int, files: int, small: int) -> None:
    os.makedirs(os.path.join(upper, "data"))
    os.makedirs(os.path.join(upper, "small"))
    block = bytearray(os.urandom(_MIB))
    per = mib // files
    for i in range(files):
        with open(os.path.join(upper, "data", f"part-{i:03d}.bin"), "wb") as f:
            for j in range(per):
                block[:8] = (i * per + j).to_bytes(8, "little")  # no two MiB alike
                f.write(block)
    for i in range(small):
        with open(os.path.join(upper, "small", f"f{i:05d}"), "wb") as f:
            f.write(os.urandom(4096))


def _drop(path: str) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Target:
    """An overlay mount over an empty lower dir: a fresh container rootfs."""

    def __init__(self, work: str) -> None:
        self.base = tempfile.mkdtemp(prefix="target-", dir=work)
        for d in ("lower", "upper", "work", "merged"):
            os.mkdir(os.path.join(self.base, d))
        self.merged = os.path.join(self.base, "merged")
        b = self.base
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={b}/lower,upperdir={b}/upper,workdir={b}/work", self.merged], check=True)

    def remove(self) -> None:
        subprocess.run(["umount", self.merged], check=True)
        shutil.rmtree(self.base)
        os.sync()


def _timed(fn: Callable[[], object]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def _cat(src: str, dst: str, hashed: bool) -> None:
    h = new_hash()
    with open(src, "rb", buffering=0) as i, open(dst, "wb", buffering=0) as o:
        while data := i.read(_MIB):
            if hashed:
                h.update(data)
            o.write(data)


def _stage(src: str, dst: str, want: str) -> None:
    fd = os.open(src, os.O_RDONLY)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _size, digest = hash_fd(fd, out)
    finally:
        os.close(fd)
        os.close(out)
    assert digest == want


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default="/var/tmp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="layer-restore-", dir=args.work)
    try:
        upper = os.path.join(work, "upper")
        _make_upper(upper, args.mib, args.files, args.small)
        tar, dels = os.path.join(work, "layer.tar"), os.path.join(work, "layer.json")
        capture(upper, tar, dels, exclude=[])
        fd = os.open(tar, os.O_RDONLY)
        try:
            size, digest = hash_fd(fd)
            sums = chunk_sums(fd)
        finally:
            os.close(fd)
        # The cold start's bytes, in memory: what its workload would have computed.
        content = {}
        for d in ("data", "small"):
            for name in sorted(os.listdir(os.path.join(upper, d))):
                with open(os.path.join(upper, d, name), "rb") as f:
                    content[f"{d}/{name}"] = f.read()
        results: dict[str, list[float]] = {}

        def case(name: str, fn: Callable[[str], object], target: bool = True) -> None:
            _drop(tar)
            t = _Target(work) if target else None
            out = os.path.join(work, "out")
            try:
                results.setdefault(name, []).append(_timed(lambda: fn(t.merged if t else out)))
            finally:
                if t is not None:
                    t.remove()
                if os.path.lexists(out):
                    os.unlink(out)
                os.sync()

        def staged(rootfs: str) -> None:
            private = os.path.join(work, "private.tar")
            results.setdefault("stage", []).append(_timed(lambda: _stage(tar, private, digest)))
            results.setdefault("apply_staged", []).append(_timed(lambda: apply(rootfs, private, dels)))
            os.unlink(private)

        def streamed(rootfs: str) -> None:
            with VerifiedArchive(os.open(tar, os.O_RDONLY), size, sums) as archive:
                apply(rootfs, archive, dels)

        def cold(rootfs: str) -> None:
            for d in ("data", "small"):
                os.mkdir(os.path.join(rootfs, d))
            for name, data in content.items():
                with open(os.path.join(rootfs, name), "wb", buffering=0) as f:
                    f.write(data)

        order: list[tuple[str, Callable[[str], object], bool]] = [
            ("cat", lambda out: _cat(tar, out, False), False), ("cat_hash", lambda out: _cat(tar, out, True), False),
            ("staged", staged, True), ("streamed", streamed, True), ("cold_write", cold, True)]
        for r in range(args.rounds):  # each round starts with another case: no case always pays for the last
            for name, fn, target in order[r % len(order):] + order[:r % len(order)]:
                case(name, fn, target)
        med = {k: statistics.median(v) for k, v in results.items()}
        base = med["cat"]
        print(f"layer: {args.mib} MiB in {args.files} files + {args.small} x 4 KiB, archive "
              f"{size / _MIB:.0f} MiB; medians of {args.rounds} rounds, store read cold")
        low = {k: min(v) for k, v in results.items()}  # the least disturbed round, on a shared node
        print(f"{'case':14} {'median s':>9} {'x cat':>7} {'min s':>7} {'x cat':>7}")
        for k in ("cat", "cat_hash", "stage", "apply_staged", "staged", "streamed", "cold_write"):
            print(f"{k:14} {med[k]:9.3f} {med[k] / base:7.2f} {low[k]:7.3f} {low[k] / low['cat']:7.2f}")
        print(f"streamed_vs_staged {med['streamed'] / med['staged']:.2f}  "
              f"streamed_vs_cold_write {med['streamed'] / med['cold_write']:.2f}")
        if args.json:
            with open(args.json, "w") as out_f:
                json.dump({"args": vars(args), "archive_bytes": size, "rounds": results,
                           "median_s": med, "min_s": low, "x_cat": {k: v / base for k, v in med.items()},
                           "streamed_vs_staged": med["streamed"] / med["staged"],
                           "streamed_vs_cold_write": med["streamed"] / med["cold_write"]}, out_f, indent=1)
    finally:
        for d in os.listdir(work):  # a target left mounted by a failed case
            if d.startswith("target-"):
                subprocess.run(["umount", "-q", os.path.join(work, d, "merged")], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
