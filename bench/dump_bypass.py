"""Lab: CRIU's whole dump against CRIU writing only what changed while N threads read the rest.

The checkpoint's CRIU dump writes every page on one thread (0.9-2.1 GB/s on the H200 machines:
8.9-19.8 s of the LLM worker's 17.6 GB). CRIU has no option to leave VMAs out, but it has
incremental dumps: with ``--track-mem --prev-images-dir``, a page whose soft-dirty bit is clear
is not written but recorded as "in the parent" (``PE_PARENT``), once CRIU has checked that the
parent's pagemap covers it. The design measured here:

1. clear the process's soft-dirty bits (``/proc/PID/clear_refs`` = 4; the whole mm, there is no
   per-range clear);
2. write a parent image set of our own: an inventory with the current uptime (CRIU's pid-reuse
   check) and a pagemap whose entries cover the whole user address space, with an empty pages
   file (CRIU only checks the coverage while dumping);
3. at once: N threads read every present anonymous page of the process with
   ``process_vm_readv``, 2 MiB at a time, hash each 1 MiB (BLAKE3, as the artifact's sums) and
   write it to a file; and ``criu dump --track-mem --prev-images-dir`` writes the pagemaps and
   only the pages written since step 1. A page written after the clear is soft-dirty, so CRIU
   has it as it was at the freeze; every other page was not written since the clear, so the
   threads' copy, taken after it, is the page as it was at the freeze;
4. check: every ``PE_PARENT`` page of CRIU's pagemap is among the pages the threads read.

``--verify`` (CPU targets only) then proves the images whole: it rewrites them into a plain image
set (each ``PE_PARENT`` run becomes present, its bytes from the threads' file), kills the source,
``criu restore``s it and compares the memory of the restored process with the source's.

Usage (root): ``python -m bench.dump_bypass --cpu-gib 2 [--verify]`` (a process holding N GiB of
anonymous memory), ``--gpu-gib 16`` (tests/gpu/workloads/gpu_holder.py, CUDA-checkpointed first:
the dump then holds the driver's host copy), or ``--pid PID``. ``--rounds criu,bypass,criu,bypass``
(each a dump of the same running process, ``--leave-running``), ``--threads 8``, ``--dir`` (on the
file system the store would use; default /var/tmp). Prints each round's phases and the ratio to
the whole dump of the same run; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime import libc
from runtime.criu import image_files as img
from runtime.criu.command import CRIU
from runtime.criu.proto import pagemap_pb2
from runtime.digests import new_hash
from runtime.libc import Iovec as _Iovec
from runtime.pages.mapping import _varint_field  # the wire format mapping.py writes files.img with

PAGE = 4096
PIECE = 2 << 20
SUM = 1 << 20
USER_TOP = 1 << 47
PARENT_SPAN = 1 << 43  # pages per parent pagemap entry: 2^31 (nr_pages is a uint32)
IMG_COMMON_MAGIC = 0x54564319
INVENTORY_MAGIC = 0x58313116
PAGEMAP_MAGIC = 0x56084025
CRTOOLS_IMAGES_V1_1 = 2


# --- the parent image set ------------------------------------------------------------------------

def inventory_entry(uptime_us: int) -> bytes:
    """inventory_entry{img_version=2, fdinfo_per_id=true, ns_per_id=true, dump_uptime} (fields 1,
    2, 4, 8 of CRIU's inventory.proto), encoded by hand: nothing else of it is read here."""
    return (_varint_field(1, CRTOOLS_IMAGES_V1_1) + _varint_field(2, 1) + _varint_field(4, 1)
            + _varint_field(8, uptime_us))


def _image(path: Path, magic: int, entries: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<II", IMG_COMMON_MAGIC, magic))
        for e in entries:
            f.write(struct.pack("<I", len(e)) + e)


def write_parent(parent: Path, vpids: list[int]) -> None:
    """A parent image set CRIU accepts for ``--track-mem``: every address of each task in it."""
    parent.mkdir(parents=True, exist_ok=True)
    uptime_us = int(float(Path("/proc/uptime").read_text().split()[0]) * 1e6) + 1_000_000
    _image(parent / "inventory.img", INVENTORY_MAGIC, [inventory_entry(uptime_us)])
    entries = [pagemap_pb2.pagemap_entry(vaddr=a, compat_nr_pages=0, nr_pages=PARENT_SPAN // PAGE,
                                        flags=img.PE_PRESENT)
               for a in range(0, USER_TOP, PARENT_SPAN)]
    for i, vpid in enumerate(vpids, start=1):
        head = pagemap_pb2.pagemap_head(pages_id=i)
        _image(parent / f"pagemap-{vpid}.img", PAGEMAP_MAGIC,
               [head.SerializeToString(), *(e.SerializeToString() for e in entries)])
        (parent / f"pages-{i}.img").write_bytes(b"")


# --- the threads' read ---------------------------------------------------------------------------

_readv = libc.function("process_vm_readv")

# /proc/PID/pagemap: bit 63 present, 62 swapped, 61 file page or shared anonymous.
_ANON = bytes(1 if (b & 0xC0) and not b & 0x20 else 0 for b in range(256))


def anon_runs(pid: int) -> list[tuple[int, int]]:
    """(start, end) of each run of present or swapped anonymous pages in the readable private
    VMAs of ``pid``, and the vDSO whole (what CRIU would dump, and a little more: zero pages)."""
    runs: list[tuple[int, int]] = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for line in maps:
            f = line.split()
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            perms = f[1]
            if hi > USER_TOP or perms[0] != "r" or perms[3] != "p" or (len(f) > 5 and f[5] == "[vvar]"):
                continue
            if len(f) > 5 and f[5] == "[vdso]":  # CRIU dumps it whole; pagemap calls its pages file pages
                runs.append((lo, hi))
                continue
            data = os.pread(pm.fileno(), (hi - lo) // PAGE * 8, lo // PAGE * 8)
            mask = data[7::8].translate(_ANON)
            for m in re.finditer(rb"\x01+", mask):
                runs.append((lo + m.start() * PAGE, lo + m.end() * PAGE))
    return runs


@dataclass
class ReadResult:
    bytes: int = 0
    seconds: float = 0.0
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, file offset)
    sums: list[bytes] = field(default_factory=list)


def read_pages(pid: int, out: Path, threads: int) -> ReadResult:
    """Every anonymous run of ``pid`` into ``out``, back to back, on ``threads`` threads, each
    2 MiB piece hashed by 1 MiB as it lands (the artifact's sums)."""
    t0 = time.monotonic()
    runs, off = [], 0
    for lo, hi in anon_runs(pid):
        runs.append((lo, hi, off))
        off += hi - lo
    pieces = [(lo + d, min(PIECE, hi - lo - d), o + d) for lo, hi, o in runs for d in range(0, hi - lo, PIECE)]
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, off)
    sums: dict[int, bytes] = {}
    local = threading.local()

    def one(p: tuple[int, int, int]) -> None:
        addr, n, at = p
        if not hasattr(local, "buf"):
            local.buf = ctypes.create_string_buffer(PIECE)
        buf = local.buf
        got = _readv(pid, ctypes.byref(_Iovec(ctypes.addressof(buf), n)), 1,
                     ctypes.byref(_Iovec(addr, n)), 1, 0)
        if got != n:
            raise OSError(ctypes.get_errno(), f"process_vm_readv {addr:#x}+{n}: {got}")
        view = memoryview(buf).cast("B")[:n]
        for s in range(0, n, SUM):
            sums[at + s] = new_hash(view[s:s + SUM]).digest()
        os.pwrite(fd, view, at)

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="bypass-read") as pool:
            list(pool.map(one, pieces))
    finally:
        os.close(fd)
    return ReadResult(off, time.monotonic() - t0, runs, [sums[k] for k in sorted(sums)])


# --- a round ---------------------------------------------------------------------------------------

@dataclass
class Round:
    mode: str
    criu_s: float
    read_s: float | None = None
    read_gb: float | None = None
    read_bytes: int = 0
    stopped_s: float = 0.0  # from the round's start to both done: what the dump step would take
    pages_written: int = 0
    pages_parent: int = 0
    parent_uncovered: int = 0


def _criu_dump(pid: int, images: Path, parent: Path | None) -> float:
    argv = [CRIU, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4",
            "--leave-running", "--shell-job", "--ext-unix-sk", "--tcp-established", "--file-locks"]
    if parent is not None:
        argv += ["--track-mem", "--prev-images-dir", os.path.relpath(parent, images)]
    t = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True)
    dt = time.monotonic() - t
    if r.returncode:
        log = (images / "dump.log").read_text(errors="replace") if (images / "dump.log").exists() else ""
        raise RuntimeError(f"criu dump failed ({r.returncode}): {r.stderr[-500:]}\n" + "\n".join(
            l for l in log.splitlines() if "Error" in l or "rror (" in l)[-3000:])
    return dt


def _count(images: Path) -> tuple[int, int, list[tuple[int, int]]]:
    written = parent = 0
    parents: list[tuple[int, int]] = []
    for pm in images.glob("pagemap-*.img"):
        if "shmem" in pm.name:
            continue
        pid = int(pm.stem.split("-")[1])
        for e in img.read_pagemap(str(images), pid).entries:
            n = img.nr_pages(e)
            if e.flags & img.PE_PARENT:
                parent += n
                parents.append((e.vaddr, e.vaddr + n * PAGE))
            elif e.flags & img.PE_PRESENT:
                written += n
    return written, parent, parents


def _uncovered(parents: list[tuple[int, int]], runs: list[tuple[int, int, int]]) -> int:
    import bisect
    starts = [r[0] for r in runs]
    missing = 0
    for lo, hi in parents:
        a = lo
        while a < hi:
            i = bisect.bisect_right(starts, a) - 1
            if i < 0 or runs[i][1] <= a:
                missing += PAGE
                a += PAGE
                continue
            a = min(hi, runs[i][1])
    return missing // PAGE


def soft_dirty() -> bool:
    """Whether this kernel tracks soft-dirty pages (CONFIG_MEM_SOFT_DIRTY), which CRIU's
    --track-mem needs: a page written after a clear must show bit 55 in /proc/self/pagemap."""
    import mmap  # noqa: PLC0415
    m = mmap.mmap(-1, PAGE)
    m[0:1] = b"x"
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    Path("/proc/self/clear_refs").write_text("4")
    m[0:1] = b"y"
    with open("/proc/self/pagemap", "rb") as f:
        (e,) = struct.unpack("<Q", os.pread(f.fileno(), 8, addr // PAGE * 8))
    return bool(e >> 55 & 1)


def one_round(mode: str, pid: int, work: Path, threads: int) -> tuple[Round, Path, ReadResult | None]:
    images = work / f"{mode}-{time.monotonic_ns()}"
    images.mkdir()
    if mode == "read":  # the threads alone: what they cost without CRIU beside them
        res = read_pages(pid, images.with_name(images.name + ".bulk"), threads)
        return (Round(mode, 0.0, round(res.seconds, 3), round(res.bytes / 1e9, 3), res.bytes, round(res.seconds, 3)),
                images, res)
    if mode == "criu":
        dt = _criu_dump(pid, images, None)
        w, p, _ = _count(images)
        return Round(mode, round(dt, 3), stopped_s=round(dt, 3), pages_written=w, pages_parent=p), images, None
    parent = images.with_name(images.name + "-parent")
    t0 = time.monotonic()
    Path(f"/proc/{pid}/clear_refs").write_text("4")
    write_parent(parent, [pid])
    with ThreadPoolExecutor(1) as one:
        reading = one.submit(read_pages, pid, images.with_name(images.name + ".bulk"), threads)
        dt = _criu_dump(pid, images, parent)
        res = reading.result()
    stopped = time.monotonic() - t0
    w, p, parents = _count(images)
    return (Round(mode, round(dt, 3), round(res.seconds, 3), round(res.bytes / 1e9, 3), res.bytes, round(stopped, 3),
                  w, p, _uncovered(parents, res.runs)), images, res)


# --- whole-image proof (CPU) ----------------------------------------------------------------------

def make_whole(images: Path, bulk: Path, res: ReadResult, pid: int) -> None:
    """Rewrite the incremental image set into a plain one: each PE_PARENT run becomes present, its
    bytes taken from the threads' file; the parent link goes."""
    pm = img.read_pagemap(str(images), pid)
    src = os.open(pm.pages_path, os.O_RDONLY)
    data = os.open(bulk, os.O_RDONLY)
    tmp = pm.pages_path + ".new"
    dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    import bisect
    starts = [r[0] for r in res.runs]
    at, entries = 0, []
    for e in pm.entries:
        n = img.nr_pages(e) * PAGE
        if e.flags & img.PE_PARENT:
            a = e.vaddr
            while a < e.vaddr + n:
                i = bisect.bisect_right(starts, a) - 1
                lo, hi, off = res.runs[i]
                take = min(e.vaddr + n, hi) - a
                os.write(dst, os.pread(data, take, off + a - lo))
                a += take
            entries.append(pagemap_pb2.pagemap_entry(vaddr=e.vaddr, compat_nr_pages=0, nr_pages=n // PAGE,
                                                   flags=img.PE_PRESENT))
        else:
            if img.has_data(e):
                os.write(dst, os.pread(src, n, at))
                at += n
            entries.append(e)
    for fd in (src, data, dst):
        os.close(fd)
    os.replace(tmp, pm.pages_path)
    img.write_pagemap(pm, entries)
    (images / "parent").unlink(missing_ok=True)


def region_digest(pid: int) -> str:
    h = new_hash()
    res_runs = anon_runs(pid)
    buf = ctypes.create_string_buffer(PIECE)
    for lo, hi in res_runs:
        for a in range(lo, hi, PIECE):
            n = min(PIECE, hi - a)
            if _readv(pid, ctypes.byref(_Iovec(ctypes.addressof(buf), n)), 1, ctypes.byref(_Iovec(a, n)), 1, 0) != n:
                raise OSError(ctypes.get_errno(), "readv")
            h.update(memoryview(buf).cast("B")[:n])
    return h.hexdigest()


# --- targets ---------------------------------------------------------------------------------------

_CPU_TARGET = r"""
import mmap, os, sys, signal, time
n = max(1, int(float(sys.argv[1]) * 1024)) << 20  # whole MiB
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
seed = os.urandom(1 << 20)
for off in range(0, n, 1 << 20):
    m[off:off + (1 << 20)] = seed[off % 997:] + seed[:off % 997]
open(sys.argv[2], "w").write("ready")
signal.pause()
"""


def start_cpu(gib: float, work: Path) -> subprocess.Popen:
    ready = work / "ready"
    p = subprocess.Popen([sys.executable, "-c", _CPU_TARGET, str(gib), str(ready)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not ready.exists():
        if p.poll() is not None:
            raise RuntimeError("target exited")
        time.sleep(0.05)
    return p


def start_gpu(gib: float, work: Path) -> tuple[subprocess.Popen, float]:
    """gpu_holder with ``gib`` GiB, CUDA-checkpointed: its device memory is now host memory.
    Returns it and the CUDA checkpoint's seconds."""
    from runtime.gpu.cuda import CudaCheckpointer  # noqa: PLC0415 - GPU only
    holder = Path(__file__).resolve().parents[1] / "tests/gpu/workloads/gpu_holder.py"
    p = subprocess.Popen([sys.executable, str(holder), "--gib", str(gib), "--work-dir", str(work)],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=open(work / "holder.log", "w"), stderr=subprocess.STDOUT)
    while not (work / "checksums.json").exists():
        if p.poll() is not None:
            raise RuntimeError("gpu_holder exited: " + (work / "holder.log").read_text()[-2000:])
        time.sleep(0.1)
    with CudaCheckpointer() as cuda:
        t = time.monotonic()
        cuda.checkpoint_all([p.pid], 30_000)
        return p, time.monotonic() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--cpu-gib", type=float)
    g.add_argument("--gpu-gib", type=float)
    g.add_argument("--pid", type=int)
    ap.add_argument("--rounds", default="criu,bypass,criu,bypass")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dump-bypass-", dir=a.dir))
    proc, cuda_s = None, None
    if a.cpu_gib:
        proc = start_cpu(a.cpu_gib, work)
    elif a.gpu_gib:
        proc, cuda_s = start_gpu(a.gpu_gib, work)
    pid = a.pid or proc.pid
    rounds: list[Round] = []
    tracks = soft_dirty()
    print(f"soft-dirty tracking in this kernel: {'yes' if tracks else 'no (CRIU refuses --track-mem)'}")
    out = {"what": "CRIU's whole dump against --track-mem with a parent of our own and N reading threads",
           "pid": pid, "threads": a.threads, "dir": a.dir, "cuda_checkpoint_s": cuda_s,
           "soft_dirty": tracks, "kernel": os.uname().release, "rounds": rounds}
    last = None
    try:
        for mode in a.rounds.split(","):
            if mode == "bypass" and not tracks:
                mode = "read"
            r, images, res = one_round(mode, pid, work, a.threads)
            rounds.append(r)
            base = next((x.stopped_s for x in reversed(rounds) if x.mode == "criu"), None)  # the latest whole dump
            print(f"{mode:7s} CRIU {r.criu_s:7.2f} s  read {r.read_s or 0:6.2f} s ({r.read_gb or 0:.1f} GB)  "
                  f"step {r.stopped_s:7.2f} s" + (f" = {r.stopped_s / base:.2f}x the whole dump" if base else "")
                  + f"  CRIU wrote {r.pages_written * PAGE / 1e9:.2f} GB, parent {r.pages_parent * PAGE / 1e9:.2f} GB,"
                  f" uncovered {r.parent_uncovered} pages", flush=True)
            if mode == "bypass" and a.verify:
                last = (images, res)
            else:  # the disk holds two at most
                subprocess.run(["rm", "-rf", str(images), f"{images}-parent", f"{images}.bulk"])
            if a.json:
                Path(a.json).write_text(json.dumps({**out, "rounds": [asdict(x) for x in rounds]}, indent=1))
        if a.verify and last is not None and a.cpu_gib:
            images, res = last
            before = region_digest(pid)
            make_whole(images, images.with_name(images.name + ".bulk"), res, pid)
            os.killpg(pid, signal.SIGKILL)
            proc.wait()
            r = subprocess.run([CRIU, "restore", "-D", str(images), "-o", "restore.log", "-v4", "-d",
                                "--shell-job", "--ext-unix-sk", "--tcp-established", "--file-locks"],
                               capture_output=True, text=True)
            if r.returncode:
                print("restore failed:", r.stderr[-800:], (images / "restore.log").read_text()[-2000:])
                return 1
            after = region_digest(pid)
            os.kill(pid, signal.SIGKILL)
            print(f"verify: restored from the incremental images made whole: memory "
                  f"{'identical' if before == after else 'DIFFERENT'}")
            out["verified"] = before == after
            if a.json:
                Path(a.json).write_text(json.dumps({**out, "rounds": [asdict(x) for x in rounds]}, indent=1))
            return 0 if before == after else 1
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
