"""A PyTorch process that holds N GiB of GPU tensors and can prove they survived a checkpoint.

Usage: ``python gpu_holder.py [--gib N] [--work-dir DIR] [--port P] [--seed S]``

- Fills N GiB (``--gib``, default ``$REKINDLE_GPU_TEST_GIB`` or 2; fractions allowed) of float32
  tensors on ``cuda:0`` from a seeded generator, in 1 GiB chunks, and a 2048x2048 matrix.
- Checksums: per chunk, the int64 sum of its bits seen as int32; plus the sha256 of ``M @ M``.
- Writes ``DIR/checksums.json`` (atomically) with the checksums, its pid and timings
  (``import_torch_s``, ``fill_s``), then ``ready-for-checkpoint`` into ``$REKINDLE_CONTROL_DIR``
  when that is set. ``DIR`` defaults to ``$REKINDLE_CONTROL_DIR``, else the current directory.
- Then it waits, doing no GPU work, for requests:
  * a file ``DIR/verify-request`` (content: any id): it removes it, recomputes the checksums and
    writes ``DIR/verify-result.json`` = ``{"id": ..., "checksums": ..., "same": bool, "compute_s": ...}``;
  * a file ``DIR/stop``: it exits 0;
  * with ``--port P`` (0 = any free port, reported as ``port`` in checksums.json), HTTP on
    127.0.0.1: ``GET /healthz`` -> ``ok``; ``GET /checksums`` -> the same JSON as verify-result.
- SIGTERM exits at once (default action).
Polling interval: 50 ms. Only the standard library and torch are used; torch is imported inside
:class:`Holder`, so tests and benchmarks import this file for its client helpers
(:func:`wait_ready`, :func:`request_verify`) without loading torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

GIB = 1 << 30
SLICE = 64 << 20  # int32 elements summed per kernel (256 MiB)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_ready(work_dir: Path, pid_alive: Any = None, timeout: float = 300.0) -> dict[str, Any]:
    """Wait for ``work_dir/checksums.json``; ``pid_alive()`` -> False aborts early. Returns it."""
    path = work_dir / "checksums.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if pid_alive is not None and not pid_alive():
            raise RuntimeError("gpu_holder exited before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gpu_holder not ready after {timeout:.0f} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def request_verify(work_dir: Path, timeout: float = 120.0) -> dict[str, Any]:
    """Ask a running holder to recompute its checksums; returns its verify-result."""
    result = work_dir / "verify-result.json"
    result.unlink(missing_ok=True)
    rid = f"{time.time_ns()}"
    atomic_write(work_dir / "verify-request", rid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result.exists():
            data = json.loads(result.read_text())
            if data.get("id") == rid:
                return data
        time.sleep(0.02)
    raise TimeoutError(f"gpu_holder did not answer a verify request in {timeout:.0f} s")


class Holder:
    def __init__(self, gib: float, seed: int) -> None:
        t0 = time.monotonic()
        import torch  # noqa: PLC0415 - timed on purpose

        self.torch = torch
        self.import_s = time.monotonic() - t0
        t1 = time.monotonic()
        dev = torch.device("cuda:0")
        self.chunks = []
        left = int(gib * GIB) // 4 * 4
        i = 0
        while left > 0:
            n = min(left, GIB) // 4
            g = torch.Generator(device=dev).manual_seed(seed + i)
            self.chunks.append(torch.empty(n, dtype=torch.float32, device=dev).uniform_(generator=g))
            left -= n * 4
            i += 1
        g = torch.Generator(device=dev).manual_seed(seed + 10_000)
        self.matrix = torch.randn(2048, 2048, device=dev, generator=g)
        torch.cuda.synchronize()
        self.fill_s = time.monotonic() - t1
        self.lock = threading.Lock()
        self.initial = self.checksums()

    def checksums(self) -> dict[str, Any]:
        torch = self.torch
        with self.lock:
            sums = []
            for c in self.chunks:
                bits = c.view(torch.int32)
                total = 0
                for s in range(0, bits.numel(), SLICE):
                    total += int(bits[s:s + SLICE].sum(dtype=torch.int64).item())
                sums.append(total)
            prod = (self.matrix @ self.matrix).cpu().numpy().tobytes()
            torch.cuda.synchronize()
        return {"chunks": sums, "bytes": sum(c.numel() * 4 for c in self.chunks),
                "matmul_sha256": hashlib.sha256(prod).hexdigest()}

    def verify(self, rid: str) -> dict[str, Any]:
        t = time.monotonic()
        now = self.checksums()
        return {"id": rid, "checksums": now, "same": now == self.initial,
                "compute_s": round(time.monotonic() - t, 4), "pid": os.getpid()}


def serve_http(holder: Holder, port: int) -> int:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/healthz":
                body, code = b"ok\n", 200
            elif self.path == "/checksums":
                body, code = (json.dumps(holder.verify("http")) + "\n").encode(), 200
            else:
                body, code = b"not found\n", 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="holder-http", daemon=True).start()
    return int(server.server_address[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=float(os.environ.get("REKINDLE_GPU_TEST_GIB", "2")))
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    control = os.environ.get("REKINDLE_CONTROL_DIR")
    work = args.work_dir or Path(control or ".")
    work.mkdir(parents=True, exist_ok=True)

    holder = Holder(args.gib, args.seed)
    port = serve_http(holder, args.port) if args.port is not None else None
    info = {"pid": os.getpid(), "gib": args.gib, "checksums": holder.initial, "port": port,
            "import_torch_s": round(holder.import_s, 4), "fill_s": round(holder.fill_s, 4)}
    atomic_write(work / "checksums.json", json.dumps(info, indent=1))
    if control:
        atomic_write(Path(control) / "ready-for-checkpoint", f"{os.getpid()}\n")
    print(f"gpu_holder: pid {os.getpid()} holds {holder.initial['bytes'] / GIB:.2f} GiB, ready", flush=True)

    req, stop = work / "verify-request", work / "stop"
    while True:
        if stop.exists():
            return 0
        if req.exists():
            rid = req.read_text().strip()
            req.unlink()
            atomic_write(work / "verify-result.json", json.dumps(holder.verify(rid)))
        time.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main())
