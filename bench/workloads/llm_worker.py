"""An LLM inference server's start-up, for the checkpoint/restore benchmark (bench/llm_restore.py).

Usage: ``MODEL_DIR=/model python llm_worker.py`` (in a pod: the node's Python with torch and
transformers, the model dir mounted read-only).

Start-up, phase by phase, each timed (``phases_s``):

1. ``import``: ``import torch, transformers``;
2. ``load``: ``AutoModelForCausalLM.from_pretrained(MODEL_DIR)`` to ``cuda:0`` in bf16;
3. ``eager_generate``: one greedy ``generate`` of a fixed prompt, eager (dynamic cache);
4. ``compile_warmup``: generate with a static KV cache and the decode step compiled by
   ``torch.compile(mode=COMPILE_MODE)`` (transformers' own generate compile path; ``forward`` is
   compiled directly where that path is missing), ``WARMUP_CALLS`` calls. A compile error is
   recorded (``compile_error``) and the server then runs eager.

The last warm-up call's new tokens are the reference (``reference_tokens``). It writes the record
(JSON) to stdout and to ``$REKINDLE_CONTROL_DIR/worker-startup.json``, then
``$REKINDLE_CONTROL_DIR/ready-for-checkpoint``, then serves HTTP on ``0.0.0.0:$PORT``:
``GET /generate`` -> ``{"tokens": [...], "seconds": s}`` (the same greedy generate),
``GET /healthz`` -> ``ok``, ``GET /startup`` -> the start-up record. All GPU work runs on the main
thread (CUDA graph trees are per thread); the HTTP thread only queues requests.

Environment: ``MODEL_DIR`` (required), ``COMPILE_MODE`` (``reduce-overhead``; ``none`` = eager),
``NEW_TOKENS`` (32), ``WARMUP_CALLS`` (3), ``PORT`` (8080).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PROMPT = [(i * 7919 + 13) % 150_000 for i in range(64)]  # fixed token ids; no tokenizer needed
GIB = 1 << 30


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class Worker:
    def __init__(self, model_dir: str, mode: str, new_tokens: int, warmup_calls: int) -> None:
        self.mode, self.new_tokens = mode, new_tokens
        self.rec: dict[str, Any] = {"pid": os.getpid(), "compile_mode": mode, "new_tokens": new_tokens,
                                    "prompt_len": len(PROMPT), "phases_s": {}}
        ph = self.rec["phases_s"]
        t = time.monotonic()
        import torch  # noqa: PLC0415 - timed on purpose
        import transformers  # noqa: PLC0415
        ph["import"] = time.monotonic() - t
        self.torch = torch
        self.rec["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}

        t = time.monotonic()
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.bfloat16, device_map="cuda:0")
        except TypeError:  # older transformers: torch_dtype
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, torch_dtype=torch.bfloat16, device_map="cuda:0")
        self.model.eval()
        self.model.generation_config.eos_token_id = None  # random weights: always new_tokens tokens
        torch.cuda.synchronize()
        ph["load"] = time.monotonic() - t
        self.rec["params"] = sum(p.numel() for p in self.model.parameters())
        self.input_ids = torch.tensor([PROMPT], device="cuda:0")
        self.gen_kwargs: dict[str, Any] = {"disable_compile": True}

        t = time.monotonic()
        self.rec["eager_tokens"] = self.generate()
        ph["eager_generate"] = time.monotonic() - t

        t = time.monotonic()
        self.rec["warmup_calls_s"] = []
        if mode != "none":
            try:
                self._compile(transformers, warmup_calls)
            except Exception as exc:  # noqa: BLE001 - recorded; the server then runs eager
                self.rec["compile_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
                self.rec["compile_traceback"] = traceback.format_exc()[-4000:]
                self.gen_kwargs = {"disable_compile": True}
                self.rec["compile_path"] = "eager (compile failed)"
        else:
            self.rec["compile_path"] = "eager"
        self.rec["reference_tokens"] = self.generate()
        ph["compile_warmup"] = time.monotonic() - t
        self.rec["eager_matches_reference"] = self.rec["eager_tokens"] == self.rec["reference_tokens"]
        self._shutdown_compile_workers()
        self.rec["gpu_allocated_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        self.rec["gpu_reserved_gib"] = round(torch.cuda.memory_reserved() / GIB, 3)

    def _compiled_graphs(self) -> int:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        return int(counters["stats"]["unique_graphs"])

    def _compile(self, transformers: Any, calls: int) -> None:
        cc = getattr(transformers, "CompileConfig", None)
        if cc is not None:  # transformers compiles the decode step itself when the cache is static
            self.gen_kwargs = {"cache_implementation": "static", "compile_config": cc(mode=self.mode),
                               "disable_compile": False}
            self.rec["compile_path"] = "generate (static cache, compiled decode step)"
            self._warm(calls)
            if self._compiled_graphs() > 0:
                return
            self.rec["compile_path_note"] = "generate compiled nothing; compiling forward instead"
        self.model.forward = self.torch.compile(self.model.forward, mode=self.mode, dynamic=False)
        self.gen_kwargs = {"cache_implementation": "static", "disable_compile": True}
        self.rec["compile_path"] = "model.forward (static cache)"
        self._warm(calls)

    def _warm(self, calls: int) -> None:
        for _ in range(calls):
            t = time.monotonic()
            self.generate()
            self.rec["warmup_calls_s"].append(round(time.monotonic() - t, 3))
        self.rec["compiled_graphs"] = self._compiled_graphs()

    def _shutdown_compile_workers(self) -> None:
        """Inductor's compile worker processes are idle from here on; a server keeps one process."""
        try:
            from torch._inductor.async_compile import shutdown_compile_workers  # noqa: PLC0415

            shutdown_compile_workers()
            self.rec["compile_workers_shut_down"] = True
        except Exception as exc:  # noqa: BLE001
            self.rec["compile_workers_shut_down"] = f"{type(exc).__name__}: {exc}"

    def generate(self) -> list[int]:
        torch = self.torch
        gc = self.model.generation_config
        extra = {k: v for k, v in self.gen_kwargs.items() if hasattr(gc, k)}  # older transformers lack some
        if len(extra) != len(self.gen_kwargs):
            self.rec["generate_kwargs_unknown"] = sorted(set(self.gen_kwargs) - set(extra))
        with torch.inference_mode():
            out = self.model.generate(self.input_ids, attention_mask=torch.ones_like(self.input_ids),
                                      max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                      do_sample=False, pad_token_id=0, **extra)
        torch.cuda.synchronize()
        return [int(x) for x in out[0, len(PROMPT):].tolist()]


def serve(worker: Worker, port: int) -> None:
    """HTTP on a thread; generate requests are run here, on the main thread."""
    jobs: queue.Queue[tuple[threading.Event, dict[str, Any]]] = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/generate":
                done, box = threading.Event(), {}
                jobs.put((done, box))
                done.wait(600)
                body, code = (json.dumps(box) + "\n").encode(), 200 if "tokens" in box else 500
            elif self.path == "/healthz":
                body, code = b"ok\n", 200
            elif self.path == "/startup":
                body, code = (json.dumps(worker.rec) + "\n").encode(), 200
            else:
                body, code = b"not found\n", 404
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)  # noqa: S104 - the pod's own network
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    while True:
        done, box = jobs.get()
        try:
            t = time.monotonic()
            box["tokens"] = worker.generate()
            box["seconds"] = round(time.monotonic() - t, 4)
            box["pid"] = os.getpid()
        except Exception as exc:  # noqa: BLE001 - the client gets the error
            box["error"] = f"{type(exc).__name__}: {exc}"
        done.set()


def main() -> int:
    t0 = time.monotonic()
    worker = Worker(os.environ["MODEL_DIR"], os.environ.get("COMPILE_MODE", "reduce-overhead"),
                    int(os.environ.get("NEW_TOKENS", "32")), int(os.environ.get("WARMUP_CALLS", "3")))
    worker.rec["phases_s"] = {k: round(v, 3) for k, v in worker.rec["phases_s"].items()}
    worker.rec["startup_s"] = round(time.monotonic() - t0, 3)
    text = json.dumps(worker.rec)
    print(text, flush=True)
    control = os.environ.get("REKINDLE_CONTROL_DIR")
    if control:
        atomic_write(Path(control) / "worker-startup.json", text)
        atomic_write(Path(control) / "ready-for-checkpoint", f"{os.getpid()}\n")
    serve(worker, int(os.environ.get("PORT", "8080")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
