"""Peak memory of capturing and applying a writable layer of many empty files.

    python bench/overlay_memory.py [--files 1000000] [--per-dir 1000] [--work DIR]

Creates ``--files`` empty files (``--per-dir`` per directory) as an upperdir under ``--work``
(default: a temp dir), then captures it and applies the archive to an empty rootfs, each in
its own child process, and prints each child's peak RSS (``ru_maxrss``) and duration. The
parent only creates files, so its own memory does not count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTURE = "from runtime.overlay.rootfs import capture; import sys; capture(sys.argv[1], sys.argv[2], sys.argv[3], exclude=[])"
APPLY = "from runtime.overlay.rootfs import apply; import sys; apply(sys.argv[1], sys.argv[2], sys.argv[3])"


def child(code: str, *args: str) -> tuple[float, float]:
    """Run ``code`` in a fresh interpreter; return (peak RSS in MiB, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"child failed with {proc.returncode}: {code}")
    return usage.ru_maxrss / 1024, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--per-dir", type=int, default=1000)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="overlay-memory-", dir=args.work)
    try:
        upper, rootfs = os.path.join(work, "upper"), os.path.join(work, "rootfs")
        os.mkdir(rootfs)
        for i in range(args.files):
            d = os.path.join(upper, f"d{i // args.per_dir:05d}")
            if i % args.per_dir == 0:
                os.makedirs(d)
            os.close(os.open(os.path.join(d, f"f{i:07d}"), os.O_CREAT | os.O_WRONLY, 0o644))
        tar, dels = os.path.join(work, "layer.tar"), os.path.join(work, "layer.json")
        rss, secs = child(CAPTURE, upper, tar, dels)
        print(f"capture {args.files} files: peak RSS {rss:.0f} MiB, {secs:.1f} s, "
              f"archive {os.path.getsize(tar) / 2**20:.0f} MiB")
        rss, secs = child(APPLY, rootfs, tar, dels)
        print(f"apply   {args.files} files: peak RSS {rss:.0f} MiB, {secs:.1f} s")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
