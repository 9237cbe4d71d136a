"""The disk side of a bench: the page cache dropped, byte ranges read on threads (the
speed-of-light reads), and a scratch directory with room for an artifact."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common.units import GIB

READ_BUFFER = 16 << 20


def drop_caches() -> float:
    """Dirty pages written, then the page cache dropped (root); the seconds it took."""
    t = time.monotonic()
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return round(time.monotonic() - t, 2)


def read_file(path: Path, offset: int, length: int) -> int:
    """``length`` bytes of ``path`` from ``offset`` read and dropped; the bytes read (less at its end)."""
    done = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(READ_BUFFER)
        view = memoryview(buf)
        while done < length:
            n = os.preadv(f.fileno(), [view[: min(len(buf), length - done)]], offset + done)
            if n <= 0:
                break
            done += n
    return done


def read_ranges(jobs: Sequence[tuple[Path, int, int]], threads: int) -> int:
    """Every (path, offset, length) read on ``threads`` threads; the bytes read."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda j: read_file(*j), jobs))


def pick_image_root(candidates: list[str], need: int) -> Path:
    """The first of ``candidates`` with ``need`` bytes free and a GiB to spare; exits without one."""
    for c in candidates:
        try:
            st = os.statvfs(c)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize >= need + GIB:
            return Path(c)
    raise SystemExit(f"no image dir among {candidates} has {need / GIB:.1f} GiB free")
