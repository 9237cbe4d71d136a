"""Several processes in one container, some with CUDA: the vLLM shape (a front process without
CUDA in front of a CUDA engine process) and several CUDA processes sharing one GPU.

Usage: ``python multi_proc.py [--engines N] [--gib G] [--port P] [--work-dir DIR]``

- The front process imports nothing but the standard library (no CUDA, no NVML, as vLLM's API
  server) and starts N engine processes (this file with ``--engine I``). It talks to each over a
  pipe pair, one JSON line per request and answer.
- Engine I holds G GiB on ``cuda:0`` (gpu_holder.Holder, seed 1234 + 100 * I): all engines on the
  container's first GPU.
- Once every engine is loaded the front writes ``DIR/checksums.json`` (``engines``: each one's
  checksums, ``pids``, ``front_pid``, ``import_torch_s`` and ``fill_s`` of engine 0) and then
  ``ready-for-checkpoint`` into ``$REKINDLE_CONTROL_DIR``.
- It serves ``DIR/verify-request`` (an id) -> ``DIR/verify-result.json`` = ``{"id", "checksums": [one per
  engine], "same": every engine unchanged, "pids"}``, polled every 50 ms, and with ``--port`` HTTP on
  all addresses: ``GET /checksums`` -> the same JSON (the API path: front -> pipe -> engine -> GPU).
- ``DIR/stop``: engines told to exit, then the front exits 0.
``DIR`` defaults to ``$REKINDLE_CONTROL_DIR``. gpu_holder.request_verify is the client.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def atomic_write(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def engine(index: int, gib: float) -> int:
    from gpu_holder import Holder  # noqa: PLC0415 - torch is imported in there; run as a script, its dir is on sys.path

    holder = Holder(gib, 1234 + 100 * index)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "checksums": holder.initial,
                          "import_torch_s": round(holder.import_s, 3), "fill_s": round(holder.fill_s, 3)}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "stop":
            return 0
        out.write(json.dumps(holder.verify(str(req.get("id", "")))) + "\n")
        out.flush()
    return 0


class Front:
    def __init__(self, engines: int, gib: float) -> None:
        self.lock = threading.Lock()
        self.procs = [subprocess.Popen([sys.executable, __file__, "--engine", str(i), "--gib", str(gib)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for i in range(engines)]
        self.hello = []
        for p in self.procs:
            line = p.stdout.readline() if p.stdout else ""
            if not line:
                raise SystemExit(f"engine {p.pid} exited before it was ready ({p.wait()})")
            self.hello.append(json.loads(line))

    def ask(self, rid: str) -> dict[str, Any]:
        with self.lock:  # one request at a time over each pipe
            answers = []
            for p in self.procs:
                assert p.stdin and p.stdout
                p.stdin.write(json.dumps({"op": "verify", "id": rid}) + "\n")
                p.stdin.flush()
                answers.append(json.loads(p.stdout.readline()))
        return {"id": rid, "checksums": [a["checksums"] for a in answers], "same": all(a["same"] for a in answers),
                "pids": [a["pid"] for a in answers]}

    def stop(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.write(json.dumps({"op": "stop"}) + "\n")
                p.stdin.flush()
        for p in self.procs:
            p.wait(30)


def serve_http(front: Front, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/checksums":
                body, code = (json.dumps(front.ask("http")) + "\n").encode(), 200
            else:
                body, code = b"not found\n", 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, name="front-http", daemon=True).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--gib", type=float, default=float(os.environ.get("REKINDLE_GPU_TEST_GIB", "2")))
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--engine", type=int, default=None)
    args = ap.parse_args()
    if args.engine is not None:
        return engine(args.engine, args.gib)
    control = os.environ.get("REKINDLE_CONTROL_DIR")
    work = args.work_dir or Path(control or ".")
    front = Front(args.engines, args.gib)
    if args.port is not None:
        serve_http(front, args.port)
    atomic_write(work / "checksums.json", {
        "engines": [h["checksums"] for h in front.hello], "pids": [h["pid"] for h in front.hello],
        "front_pid": os.getpid(), "import_torch_s": front.hello[0]["import_torch_s"],
        "fill_s": front.hello[0]["fill_s"]})
    if control:
        (Path(control) / "ready-for-checkpoint").write_text(f"{os.getpid()}\n")
    print(f"multi_proc: front {os.getpid()}, engines {[h['pid'] for h in front.hello]}, ready", flush=True)
    req, stop = work / "verify-request", work / "stop"
    while not stop.exists():
        if req.exists():
            rid = req.read_text().strip()
            req.unlink()
            atomic_write(work / "verify-result.json", front.ask(rid))
        time.sleep(0.05)
    front.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
