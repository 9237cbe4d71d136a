"""Compression of an artifact's non-zero pages, measured before anything is built.

  python -m bench.compression [--sample FILE ...] [--mib 1024] [--threads N] [--disk-gbps G]
                              [--json bench/results/cpu/compression.json]

The bytes: read from the ``--sample`` files (on a GPU node, the model's safetensors: the bf16
weights that are most of a worker's non-zero pages), else bf16 values drawn as a freshly
initialised model's (normal, std 0.02). Zero pages are not in question here: the checkpoint
already stores them as nothing.

Each codec works on independent 1 MiB frames, as the restore verifies 1 MiB chunks: zstd
levels 1 and 3, on the bytes as they are and on the bf16 values split into two byte planes
(high bytes, then low bytes, per frame; the decompress puts them back). Per codec: the ratio,
and the compress and decompress rate on one thread and on ``--threads`` at once (zstandard
releases the GIL), in GB/s of uncompressed bytes. Against them, in the same run: copying the
same bytes (the speed of light of a read from the page cache) on as many threads.

The rule printed at the end: a codec would pay where its decompress on the node's threads is
faster than the disk (``--disk-gbps``, measured there: the artifact read once with the page
cache dropped) and its ratio shrinks what is read: from disk the time is then
max(bytes / ratio / disk, bytes / decompress). From the page cache it costs what the decompress
takes beyond the copy: only a codec whose decompress on the node's threads keeps up with the
copy leaves that path no slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

FRAME = 1 << 20
ROUNDS = 3


def _sample(files: list[Path], mib: int) -> bytes:
    """``mib`` MiB: spread over ``files`` (evenly spaced 64 MiB pieces, past each file's first
    MiB: a safetensors header), or drawn bf16 values."""
    want = mib << 20
    if not files:
        import numpy as np  # noqa: PLC0415 - the bench's extra (matplotlib's need)

        rng = np.random.default_rng(0)
        f32 = (rng.standard_normal(want // 2, dtype=np.float32) * 0.02).view(np.uint32)
        return ((f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16).astype(np.uint16).tobytes()  # round to bf16
    piece = 64 << 20
    sizes = [f.stat().st_size - (1 << 20) for f in files]
    pieces = max(1, want // piece)
    out = bytearray()
    total = sum(sizes)
    for k in range(pieces):
        at = k * total // pieces
        for f, n in zip(files, sizes, strict=True):
            if at < n:
                with open(f, "rb") as h:
                    h.seek((1 << 20) + at // FRAME * FRAME)
                    out += h.read(min(piece, want - len(out)))
                break
            at -= n
    return bytes(out[: len(out) // FRAME * FRAME])


def planes(frame: bytes) -> bytes:
    """bf16 values' high bytes, then their low bytes."""
    import numpy as np  # noqa: PLC0415

    v = np.frombuffer(frame, np.uint16)
    return (v >> 8).astype(np.uint8).tobytes() + (v & 0xFF).astype(np.uint8).tobytes()


def unplanes(data: bytes) -> bytes:
    import numpy as np  # noqa: PLC0415

    half = len(data) // 2
    hi = np.frombuffer(data, np.uint8, half).astype(np.uint16)
    lo = np.frombuffer(data, np.uint8, half, half)
    return ((hi << 8) | lo).tobytes()


def _timed(fn: Callable[[bytes], Any], frames: list[bytes], threads: int) -> tuple[float, list[Any]]:
    """Median seconds over ROUNDS of ``fn`` on every frame, ``threads`` at once; the last results."""
    times, out = [], []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            out = list(pool.map(fn, frames, chunksize=max(1, len(frames) // (threads * 8))))
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _copy(frame: bytes) -> bytearray:
    return bytearray(frame)  # one read of the bytes into new memory, as pread from the page cache does


def measure(data: bytes, threads: int) -> dict[str, Any]:
    import zstandard  # noqa: PLC0415 - the bench's extra

    frames = [data[i:i + FRAME] for i in range(0, len(data), FRAME)]
    size = len(data)
    res: dict[str, Any] = {"bytes": size, "frame": FRAME, "threads": threads}
    for n in sorted({1, threads}):
        s, _ = _timed(_copy, frames, n)
        res[f"copy_gbps_{n}t"] = round(size / s / 1e9, 3)
    codecs = []
    for level in (1, 3):
        for split in (False, True):
            local = threading.local()  # a compressor and a decompressor per thread

            def cctx(level: int = level) -> Any:
                if not hasattr(local, "c"):
                    local.c = zstandard.ZstdCompressor(level=level)
                return local.c

            def dctx() -> Any:
                if not hasattr(local, "d"):
                    local.d = zstandard.ZstdDecompressor()
                return local.d

            def comp(frame: bytes, split: bool = split) -> bytes:
                out: bytes = cctx().compress(planes(frame) if split else frame)
                return out

            def decomp(blob: bytes, split: bool = split) -> bytes:
                raw: bytes = dctx().decompress(blob, max_output_size=FRAME)
                return unplanes(raw) if split else raw

            rec: dict[str, Any] = {"codec": f"zstd-{level}" + ("+planes" if split else "")}
            blobs: list[bytes] = []
            for n in sorted({1, threads}):
                cs, blobs = _timed(comp, frames, n)
                ds, back = _timed(decomp, blobs, n)
                if b"".join(back) != data:
                    raise SystemExit(f"{rec['codec']}: the round trip changed the bytes")
                rec[f"compress_gbps_{n}t"] = round(size / cs / 1e9, 3)
                rec[f"decompress_gbps_{n}t"] = round(size / ds / 1e9, 3)
            rec["ratio"] = round(size / sum(len(b) for b in blobs), 4)
            codecs.append(rec)
            print(json.dumps(rec), flush=True)
    res["codecs"] = codecs
    return res


def judge(res: dict[str, Any], disk_gbps: float) -> list[dict[str, Any]]:
    """Per codec, the restore's read time (per GB of pages) from disk and from the page cache,
    each against reading the bytes as they are, on ``threads``."""
    n = res["threads"]
    copy = res[f"copy_gbps_{n}t"]
    out = []
    for c in res["codecs"]:
        dec = c[f"decompress_gbps_{n}t"]
        disk_plain, disk_z = 1 / disk_gbps, max(1 / (c["ratio"] * disk_gbps), 1 / dec)
        pc_plain, pc_z = 1 / copy, 1 / dec
        out.append({"codec": c["codec"], "ratio": c["ratio"],
                    "from_disk_s_per_gb": round(disk_z, 4), "from_disk_plain_s_per_gb": round(disk_plain, 4),
                    "from_disk_vs_plain": round(disk_z / disk_plain, 3),
                    "page_cache_s_per_gb": round(pc_z, 4), "page_cache_plain_s_per_gb": round(pc_plain, 4),
                    "page_cache_vs_plain": round(pc_z / pc_plain, 3),
                    "pays": disk_z < disk_plain and pc_z <= pc_plain})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sample", type=Path, nargs="*", default=[])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--disk-gbps", type=float, default=1.51,
                    help="the node disk's read rate (default: the H200 node's, 17.5 GB read once in 11.57 s)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    data = _sample(sorted(args.sample), args.mib)
    res = measure(data, args.threads)
    res["sample"] = [str(p) for p in args.sample] or "bf16 normal(0, 0.02), drawn"
    res["disk_gbps"] = args.disk_gbps
    res["verdict"] = judge(res, args.disk_gbps)
    n = res["threads"]
    print(f"{len(data) / 2**20:.0f} MiB, {n} threads; copy {res[f'copy_gbps_{n}t']} GB/s "
          f"({res['copy_gbps_1t']} on one); disk {args.disk_gbps} GB/s")
    for c, v in zip(res["codecs"], res["verdict"], strict=True):
        print(f"  {c['codec']:<14} ratio {c['ratio']:.3f}  compress {c[f'compress_gbps_{n}t']:6.2f} GB/s "
              f"decompress {c[f'decompress_gbps_{n}t']:6.2f} GB/s ({c['decompress_gbps_1t']:.2f} on one)  "
              f"from disk {v['from_disk_vs_plain']:.2f}x  from page cache {v['page_cache_vs_plain']:.2f}x  "
              f"{'pays' if v['pays'] else 'does not pay'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
