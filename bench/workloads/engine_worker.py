"""An inference engine's memory shape, for the benches: the 7.6 B weights plus a KV cache that
fills a fraction of the GPU, with the engine's sleep and wake-up endpoints (vLLM's meaning).

Usage: ``MODEL_DIR=/model GPU_FRACTION=0.4 python engine_worker.py`` (in a pod: the node's Python
with torch and transformers; the model made by ``bench.common.model``).

What it is, on top of bench/workloads/llm_worker.py's ``Worker`` (load, greedy generate with a
static KV cache, the decode step compiled with CUDA graphs, ``COMPILE_MODE`` reduce-overhead):
- the KV cache: the static cache the decode uses plus a block pool allocated zero-filled
  (``torch.zeros``, as vLLM allocates its KV blocks) so that the process holds ``GPU_FRACTION``
  of the GPU (vLLM's ``gpu_memory_utilization``: what the device reports used, all of it). An
  idle engine's blocks are zero; so are these, never written;
- ``POST /sleep?level=1``: the weights copied to one host buffer (``WEIGHTS_HOST``: ``pinned``,
  as vLLM's, or ``pageable``) and their GPU memory given back, and the KV block pool freed;
  ``POST /wake_up``: the weights back on the GPU (from pageable memory through two pinned
  staging buffers, as an engine that keeps them pageable would), the pool allocated zero-filled
  again. As vLLM's sleep allocator does, the weights live in one range whose virtual address
  is kept across a sleep (bench/workloads/vmm_arena.py: its memory unmapped and mapped again),
  and the decode's static cache (a few MB) stays, so the CUDA graphs recorded over them hold:
  the first decode after a wake-up takes what any decode takes (``first_decode_after_wake_s``
  against ``decode_s``). ``STABLE_ADDRESSES=0`` (or a driver that refuses the arena:
  ``arena_error``) gives new tensors at every wake-up instead, whose first decode records its
  graphs again;
- ``POST /v1/completions`` and ``GET /generate``: the fixed prompt's greedy tokens
  (``{"tokens": [...], "seconds": s, "pid": p}``); 503 while asleep. ``GET /is_sleeping``,
  ``GET /healthz``, ``GET /startup`` (the start-up record), ``GET /memory`` (bytes per part).
All GPU work runs on the main thread (CUDA graph trees are per thread); the HTTP threads queue.
Like llm_worker it writes ``worker-startup.json`` and ``ready-for-checkpoint`` in
``$REKINDLE_CONTROL_DIR`` once warm. Environment: llm_worker's, ``GPU_FRACTION`` (0.4),
``WEIGHTS_HOST`` (pinned), ``STABLE_ADDRESSES`` (1).

The client helpers and ``pool_bytes`` import without torch (the bench's host side, the tests).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

try:  # run as a script in a pod: its own directory is on the path
    from llm_worker import Worker, atomic_write  # type: ignore[import-not-found,no-redef]
    from vmm_arena import Arena, as_bytes  # type: ignore[import-not-found,no-redef]
except ImportError:
    from bench.workloads.llm_worker import Worker, atomic_write
    from bench.workloads.vmm_arena import Arena, as_bytes

DEFAULT_FRACTION = 0.4
PORT = 8080
WEIGHTS_HOSTS = ("pinned", "pageable")
STAGE_BYTES = 256 << 20  # each of the wake-up's two pinned buffers, pageable weights


def pool_bytes(fraction: float, total: int, used: int, align: int = 2 << 20) -> int:
    """Bytes of KV blocks that bring the device's use from ``used`` to ``fraction`` of ``total``
    (none when it is there already), in whole ``align`` pieces."""
    if not 0 < fraction <= 1:
        raise ValueError(f"GPU_FRACTION must be in (0, 1], got {fraction}")
    return max(0, int(total * fraction) - used) // align * align


def host_layout(sizes: list[int], align: int = 64) -> list[tuple[int, int]]:
    """(offset, size) of each tensor in one host buffer, every offset aligned (a dtype view of a
    byte buffer needs its offset to be a multiple of the element size)."""
    places, at = [], 0
    for n in sizes:
        places.append((at, n))
        at += -(-n // align) * align
    return places


def sleep_level(query: str) -> int:
    """The level of ``/sleep?level=N`` (1 when absent); ValueError for any other than 1: level 2
    (weights discarded) has no meaning for random weights that cannot be reloaded."""
    values = parse_qs(query).get("level", ["1"])
    if values != ["1"]:
        raise ValueError(f"only level=1 is supported, got {values}")
    return 1


class Engine(Protocol):
    rec: dict[str, Any]

    @property
    def sleeping(self) -> bool: ...
    def generate(self) -> list[int]: ...
    def sleep(self) -> dict[str, Any]: ...
    def wake_up(self) -> dict[str, Any]: ...
    def memory(self) -> dict[str, int]: ...


class EngineWorker:
    """llm_worker's model and decode, with a KV block pool and sleep/wake-up."""

    def __init__(self, worker: Worker, fraction: float, weights_host: str = "pinned", stable: bool = True) -> None:
        if weights_host not in WEIGHTS_HOSTS:
            raise ValueError(f"WEIGHTS_HOST must be one of {WEIGHTS_HOSTS}, got {weights_host!r}")
        self.w = worker
        self.torch = worker.torch
        self.fraction = fraction
        self.weights_host = weights_host
        self.rec = worker.rec
        self.rec.update(gpu_fraction=fraction, weights_host=weights_host, stable_addresses=False)
        self._pool: Any = None
        self._host: Any = None  # the weights' host copy while asleep
        self._arena: Any = None  # vmm_arena.Arena holding the weights, when their addresses are kept
        self._dev: Any = None  # the arena as one byte tensor
        self._after_wake = False
        if stable:
            self._place_in_arena()
        t = time.monotonic()
        self.w.generate()
        self.rec["decode_s"] = round(time.monotonic() - t, 3)  # what a warm completion takes
        t = time.monotonic()
        self._allocate_pool()
        self.rec["phases_s"]["kv_pool"] = round(time.monotonic() - t, 3)
        self.rec["memory"] = self.memory()

    @property
    def sleeping(self) -> bool:
        return self._host is not None

    def _allocate_pool(self) -> None:
        torch = self.torch
        free, total = torch.cuda.mem_get_info()
        size = pool_bytes(self.fraction, total, total - free)
        self._pool = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()

    def _params(self) -> list[Any]:
        return list(self.w.model.parameters()) + list(self.w.model.buffers())

    def _place_in_arena(self) -> None:
        """Every weight moved into one arena, so a sleep can give its memory back and a wake-up
        take it again at the same addresses; the decode's graphs, recorded again once here over
        the new addresses, then hold across every sleep. Where the driver refuses an arena, the
        worker goes on without (``arena_error``), as the tensors' new addresses after a wake-up
        then make the first decode record its graphs again."""
        torch = self.torch
        t = time.monotonic()
        tensors = self._params()
        places = host_layout([p.numel() * p.element_size() for p in tensors])
        try:
            arena = Arena(places[-1][0] + places[-1][1])
            dev = as_bytes(torch, arena)
        except Exception as exc:  # noqa: BLE001 - recorded; the worker runs with torch's allocations
            self.rec["arena_error"] = f"{type(exc).__name__}: {exc}"
            return
        for p, (at, n) in zip(tensors, places):
            view = dev[at:at + n].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the weights' first copies go back to the driver
        self._arena, self._dev = arena, dev
        self.rec["phases_s"]["arena"] = round(time.monotonic() - t, 3)
        self.rec["arena_bytes"] = arena.size
        t = time.monotonic()
        tokens = self.w.generate()
        self.rec["phases_s"]["arena_rewarm"] = round(time.monotonic() - t, 3)
        if tokens != self.rec["reference_tokens"]:
            raise RuntimeError("the weights moved into the arena answer differently")
        self.rec["stable_addresses"] = True

    def generate(self) -> list[int]:
        t = time.monotonic()
        tokens = self.w.generate()
        if self._after_wake:
            self._after_wake = False
            self.rec["first_decode_after_wake_s"] = round(time.monotonic() - t, 3)
        return tokens

    def _host_buffer(self, size: int) -> Any:
        return self.torch.empty(size, dtype=self.torch.uint8, pin_memory=self.weights_host == "pinned")

    def sleep(self) -> dict[str, Any]:
        """Level 1: weights to host memory (pinned or pageable), KV cache freed."""
        if self.sleeping:
            return {"already": True}
        torch = self.torch
        t = time.monotonic()
        if self._arena is not None:
            total = self._arena.size
            host = self._host_buffer(total)
            host.copy_(self._dev, non_blocking=host.is_pinned())
            torch.cuda.synchronize()
            # the tensors keep their arena addresses, unbacked while asleep (nothing runs on them);
            # the static cache (a few MB) stays too, so every address the graphs hold holds
            self._arena.unmap()
        else:
            tensors = self._params()
            places = host_layout([p.numel() * p.element_size() for p in tensors])
            total = places[-1][0] + places[-1][1] if places else 0
            host = self._host_buffer(total)
            views = [host[at:at + n].view(p.dtype).view(p.shape) for p, (at, n) in zip(tensors, places)]
            for p, view in zip(tensors, views):
                view.copy_(p.data, non_blocking=host.is_pinned())
            torch.cuda.synchronize()
            for p, view in zip(tensors, views):  # the GPU copies go: each tensor lives in the host buffer
                p.data = view
            if hasattr(self.w.model, "_cache"):  # transformers' static cache: made again at the next decode
                del self.w.model._cache
        self._host = host
        self._pool = None
        torch.cuda.empty_cache()  # back to the driver, as an engine's sleep frees it
        took = round(time.monotonic() - t, 3)
        self.rec["sleep_s"] = took
        return {"seconds": took, "weights_bytes": total, "memory": self.memory()}

    def wake_up(self) -> dict[str, Any]:
        """Weights back on the GPU, KV cache allocated again (zero-filled)."""
        if not self.sleeping:
            return {"already": True}
        torch = self.torch
        t = time.monotonic()
        # Whether the host copy is still page-locked (after a restore too: the driver must have
        # registered the restored pages again), and the copy's rate, which says the same in GB/s
        pinned = bool(self._host.is_pinned())
        if self._arena is not None:
            self._arena.map()
            if pinned:
                self._dev.copy_(self._host, non_blocking=True)
            else:
                staged_copy(torch, self._dev, self._host)
        else:
            for p in self._params():
                p.data = p.data.to("cuda:0", non_blocking=True)
        torch.cuda.synchronize()
        copy_s = time.monotonic() - t
        moved = self._host.numel()
        self._host = None  # the host copy goes once the weights are back (pinned: to torch's cache, as vLLM's)
        self._allocate_pool()
        self._after_wake = True
        took = round(time.monotonic() - t, 3)
        self.rec["wake_up_s"] = took
        wake = {"seconds": took, "host_pinned": pinned, "copy_s": round(copy_s, 3),
                "copy_gbps": round(moved / copy_s / 1e9, 2) if copy_s > 0 else None, "pid": os.getpid(),
                "stable_addresses": self._arena is not None}
        self.rec.setdefault("wakes", []).append(wake)
        return {**wake, "memory": self.memory()}

    def memory(self) -> dict[str, int]:
        torch = self.torch
        free, total = torch.cuda.mem_get_info()
        host = 0 if self._host is None else self._host.numel()
        pinned = self.weights_host == "pinned"
        return {"device_total": total, "device_used": total - free,
                "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "arena": 0 if self._arena is None or not self._arena.mapped else self._arena.size,
                "kv_pool": 0 if self._pool is None else self._pool.numel(),
                "pinned_weights": host if pinned else 0, "pageable_weights": 0 if pinned else host}


def staged_copy(torch: Any, dst: Any, src: Any, stage: int = STAGE_BYTES) -> None:
    """``dst`` (device bytes) from ``src`` (pageable host bytes) through two pinned buffers: the
    CPU copies a piece into one while the GPU takes the other, as an engine that keeps its weights
    in pageable memory brings them back (the driver's own pageable copy is slower)."""
    n = src.numel()
    bufs = [torch.empty(min(stage, n), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done: list[Any] = [None, None]
    for i, at in enumerate(range(0, n, stage)):
        k, m = i % 2, min(stage, n - at)
        if done[k] is not None:
            done[k].synchronize()  # the GPU has taken what this buffer held
        bufs[k][:m].copy_(src[at:at + m])
        dst[at:at + m].copy_(bufs[k][:m], non_blocking=True)
        done[k] = torch.cuda.Event()
        done[k].record()
    torch.cuda.synchronize()
    del bufs
    empty_host_cache(torch)


def empty_host_cache(torch: Any) -> None:
    """torch keeps freed pinned blocks for reuse; the staging buffers would stay in the process
    (and in its next checkpoint) as shared memory."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


Job = tuple[Callable[[], Any], threading.Event, dict[str, Any]]


def handler(engine: Engine, jobs: queue.Queue[Job]) -> type[BaseHTTPRequestHandler]:
    """The HTTP routes; whatever touches the GPU is queued for the main thread."""

    def on_main(fn: Callable[[], Any]) -> tuple[int, Any]:
        done: threading.Event = threading.Event()
        box: dict[str, Any] = {}
        jobs.put((fn, done, box))
        if not done.wait(600):
            return 504, {"error": "the main thread did not answer in 600 s"}
        return (200, box["value"]) if "value" in box else (500, {"error": box.get("error", "unknown")})

    def completion() -> tuple[int, Any]:
        if engine.sleeping:
            return 503, {"error": "sleeping"}
        t = time.monotonic()
        code, got = on_main(engine.generate)
        if code != 200:
            return code, got
        return 200, {"tokens": got, "seconds": round(time.monotonic() - t, 4), "pid": os.getpid()}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, value: Any) -> None:
            body = (json.dumps(value) + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = urlsplit(self.path).path
            if path == "/generate":
                self._answer(*completion())
            elif path in ("/healthz", "/health"):
                self._answer(200, "ok")
            elif path == "/is_sleeping":
                self._answer(200, {"is_sleeping": engine.sleeping})
            elif path == "/startup":
                self._answer(200, engine.rec)
            elif path == "/memory":
                self._answer(*on_main(engine.memory))
            else:
                self._answer(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            url = urlsplit(self.path)
            if url.path == "/v1/completions":
                self._answer(*completion())
            elif url.path == "/sleep":
                try:
                    sleep_level(url.query)
                except ValueError as exc:
                    self._answer(400, {"error": str(exc)})
                    return
                self._answer(*on_main(engine.sleep))
            elif url.path == "/wake_up":
                self._answer(*on_main(engine.wake_up))
            else:
                self._answer(404, {"error": "not found"})

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def run_jobs(jobs: queue.Queue[Job], until: threading.Event | None = None) -> None:
    """The main thread's loop: run what the HTTP threads queued (until ``until`` is set)."""
    while until is None or not until.is_set():
        fn, done, box = jobs.get()
        try:
            box["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the client gets the error
            box["error"] = f"{type(exc).__name__}: {exc}"
        done.set()


def serve(engine: Engine, port: int, address: str = "0.0.0.0") -> ThreadingHTTPServer:  # noqa: S104 - the pod's
    jobs: queue.Queue[Job] = queue.Queue()
    server = ThreadingHTTPServer((address, port), handler(engine, jobs))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    run_jobs(jobs)
    return server


# --- client helpers (the bench's side: no torch) ----------------------------------------------

def call(ip: str, path: str, method: str = "GET", port: int = PORT, timeout: float = 600) -> dict[str, Any]:
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(f"http://{ip}:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the pod's own address
        value: dict[str, Any] = json.loads(r.read())
        return value


def completion(ip: str, port: int = PORT, timeout: float = 600) -> dict[str, Any]:
    return call(ip, "/v1/completions", "POST", port, timeout)


def sleep(ip: str, port: int = PORT, timeout: float = 600) -> dict[str, Any]:
    return call(ip, "/sleep?level=1", "POST", port, timeout)


def wake_up(ip: str, port: int = PORT, timeout: float = 600) -> dict[str, Any]:
    return call(ip, "/wake_up", "POST", port, timeout)


def main() -> int:
    t0 = time.monotonic()
    worker = Worker(os.environ["MODEL_DIR"], os.environ.get("COMPILE_MODE", "reduce-overhead"),
                    int(os.environ.get("NEW_TOKENS", "32")), int(os.environ.get("WARMUP_CALLS", "3")))
    engine = EngineWorker(worker, float(os.environ.get("GPU_FRACTION", str(DEFAULT_FRACTION))),
                          os.environ.get("WEIGHTS_HOST", "pinned"), os.environ.get("STABLE_ADDRESSES", "1") != "0")
    engine.rec["phases_s"] = {k: round(v, 3) for k, v in engine.rec["phases_s"].items()}
    engine.rec["startup_s"] = round(time.monotonic() - t0, 3)
    text = json.dumps(engine.rec)
    print(text, flush=True)
    control = os.environ.get("REKINDLE_CONTROL_DIR")
    if control:
        atomic_write(Path(control) / "worker-startup.json", text)
        atomic_write(Path(control) / "ready-for-checkpoint", f"{os.getpid()}\n")
    serve(engine, int(os.environ.get("PORT", str(PORT))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
