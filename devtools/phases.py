"""Phase tables for restores: seconds, bytes, GB/s and the speed of light of each phase.

The bytes of each phase come from the artifact itself (what the restore copies, what CRIU
restores, what the bulk fill writes); the ceilings are measured in the same run on the same
machine (:func:`read_gbps`: reading files with N threads; :func:`copy_gbps`: copying memory
into fresh pages with N threads), so a phase's speed of light is its bytes over the ceiling that
bounds it. Used by devtools/demo.py (CPU) and bench/restore_speed.py (GPU).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GB = 1e9
CHUNK = 8 << 20


def artifact_dir(store: Path, namespace: str, name: str) -> Path:
    link = store / namespace / name
    return link.parent / os.readlink(link) if link.is_symlink() else link


def phase_bytes(artifact: Path) -> dict[str, int]:
    """What each restore phase moves, from the artifact's files."""
    files = [p for p in artifact.rglob("*") if p.is_file()]
    size = {str(p.relative_to(artifact)): p.stat().st_size for p in files}
    bulk = sum(v for k, v in size.items() if k.startswith("bulk/") and k.endswith(".bulk"))
    staged = sum(v for k, v in size.items() if not k.startswith("bulk/"))
    pages = sum(v for k, v in size.items() if k.startswith("criu/pages-"))
    layer = sum(v for k, v in size.items() if k.endswith(".tar"))
    return {"stage": staged, "criu_restore": pages, "fill": bulk, "rootfs_apply": layer,
            "artifact": sum(size.values())}


def _read(job: tuple[Path, int, int, int]) -> int:
    path, off, length, chunk = job
    buf = memoryview(mmap.mmap(-1, chunk))
    done = 0
    with open(path, "rb", buffering=0) as f:
        while done < length:
            n = os.preadv(f.fileno(), [buf[:min(chunk, length - done)]], off + done)
            if n <= 0:
                break
            done += n
    return done


def read_gbps(paths: Iterable[Path], threads: int, limit: int = 8 << 30, chunk: int = CHUNK) -> float:
    """GB/s reading (up to ``limit`` bytes of) the files on ``threads`` threads, each reading
    256 MiB of a file at a time in ``chunk`` reads."""
    jobs, total = [], 0
    for p in sorted(paths, key=lambda q: -q.stat().st_size):
        size = min(p.stat().st_size, limit - total)
        jobs += [(p, off, min(256 << 20, size - off), chunk) for off in range(0, size, 256 << 20)]
        total += size
        if total >= limit:
            break
    if not jobs:
        return 0.0
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(_read, jobs))
    return done / (time.perf_counter() - t) / GB


def copy_gbps(threads: int, size: int = 1 << 30, rounds: int = 3) -> float:
    """GB/s copying memory into freshly mapped pages (what a fill does) on ``threads`` threads;
    the best of ``rounds`` (first touches of a VM's memory vary a lot)."""
    return max(_copy_round(threads, size) for _ in range(rounds))


def _copy_round(threads: int, size: int) -> float:
    src = mmap.mmap(-1, CHUNK)
    src.write(os.urandom(1 << 16) * (CHUNK >> 16))
    per = size // threads

    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))

    def one(_: int) -> int:
        dst = mmap.mmap(-1, per)
        base = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        for off in range(0, per, CHUNK):
            ctypes.memmove(base + off, src_addr, min(CHUNK, per - off))  # drops the GIL
        return per

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(one, range(threads)))
    return done / (time.perf_counter() - t) / GB


ORDER = ("open", "inspect", "stage", "rootfs_apply", "criu_restore", "stream_start", "fill", "cuda_restore", "stream",
         "inspect", "cuda_find", "cuda_checkpoint", "criu_dump", "rootfs_capture", "shm_capture",
         "cuda_resume_source", "split", "publish")


def rows(timings: Mapping[str, float], moved: Mapping[str, int], ceilings: Mapping[str, float]) -> list[dict]:
    """One row per timed phase: seconds, bytes, GB/s, the ceiling and the phase's speed of light."""
    out = []
    ranked = sorted(((k, v) for k, v in timings.items() if k != "total"),  # the sum is printed below
                    key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER))
    for phase, seconds in ranked:
        n = moved.get(phase, 0)
        ceiling = ceilings.get(phase, 0.0)
        out.append({"phase": phase, "seconds": seconds, "bytes": n,
                    "gbps": round(n / GB / seconds, 2) if n and seconds else None,
                    "ceiling_gbps": round(ceiling, 2) if ceiling else None,
                    "sol_s": round(n / GB / ceiling, 3) if n and ceiling else None})
    return out


def format_rows(table: list[dict]) -> str:
    lines = [f"    {'phase':<20}{'seconds':>9}{'MB':>10}{'GB/s':>8}{'ceiling GB/s':>14}{'SOL s':>8}"]
    for r in table:
        lines.append(f"    {r['phase']:<20}{r['seconds']:>9.3f}{r['bytes'] / 1e6:>10.1f}"
                     f"{(r['gbps'] or 0):>8.2f}{(r['ceiling_gbps'] or 0):>14.2f}{(r['sol_s'] or 0):>8.3f}")
    total = sum(r["seconds"] for r in table)
    sol = sum(r["sol_s"] or 0 for r in table)
    lines.append(f"    {'total':<20}{total:>9.3f}{'':>32}{sol:>8.3f}")
    return "\n".join(lines)
