"""One CUDA framework's way of serving, for the framework matrix (tests/gpu/test_frameworks.py).

  framework_worker.py --framework torch-eager|torch-compile|jax|cupy [--procs 2]

Each computes an answer on the GPU the way that framework serves: PyTorch eager (cuBLAS);
PyTorch with ``torch.compile(mode="reduce-overhead")`` (Triton kernels replayed from CUDA graphs);
JAX (a jitted chain; the allocator as ``XLA_PYTHON_*`` says: preallocating by default); CuPy
(cuBLAS, cuFFT and a kernel compiled by NVRTC). ``--procs 2``: a child process computes a second
answer on the same GPU, asked through a pipe (a two-process CUDA pod).

Control dir protocol (``$REKINDLE_CONTROL_DIR``): once ready it writes ``answers.json``
(``{"answer": ..., "pid": ..., "ready_s": ...}``) and ``ready-for-checkpoint``. A file ``ask``
(content: an id) is answered by ``reply.json``: the answer computed again, and ``fresh``: the
result of something compiled or jitted for the first time now (after a restore: the compiler
and the driver's module loading still work).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

N = 2048
Fresh = Callable[[int], float]


def torch_eager() -> tuple[Callable[[], float], Fresh]:
    import torch  # noqa: PLC0415

    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(N, N, device="cuda", generator=g)
    w = torch.randn(N, N, device="cuda", generator=g) / 45
    held = torch.full((256 << 20,), 2.0, device="cuda")  # 1 GiB of float32 kept on the GPU

    def answer() -> float:
        return float((x @ w).relu().sum()) + float(held[:: 1 << 20].sum())

    def fresh(n: int) -> float:  # a kernel of a shape never run before: cuBLAS picks and loads anew
        a = torch.randn(N + n, 257 + n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
        return float((a.T @ a).trace())

    return answer, fresh


def torch_compile() -> tuple[Callable[[], float], Fresh]:
    import torch  # noqa: PLC0415

    g = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(N, N, device="cuda", generator=g)
    w = torch.randn(N, N, device="cuda", generator=g) / 45

    @torch.compile(mode="reduce-overhead")
    def step(a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ w).sin() * 3 + 1

    for _ in range(3):  # compiled, then recorded as a CUDA graph, then replayed
        step(x)
    torch.cuda.synchronize()

    def answer() -> float:
        return float(step(x).sum())

    def fresh(n: int) -> float:  # Inductor and Triton compile a function never seen before
        f = torch.compile(lambda a: (a * (n + 2)).cos().sum(dim=0))
        return float(f(x[: 64 + n]).sum())

    return answer, fresh


def jax_chain() -> tuple[Callable[[], float], Fresh]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    keys = jax.random.split(jax.random.PRNGKey(13), 5)
    x = jax.random.normal(keys[0], (N, N), jnp.float32)
    ws = [jax.random.normal(k, (N, N), jnp.float32) / 45.0 for k in keys[1:]]

    @jax.jit
    def chain(a: Any) -> Any:
        for w in ws:
            a = jnp.tanh(a @ w)
        return a

    def answer() -> float:
        return float(jnp.sum(chain(x)).block_until_ready())

    def fresh(n: int) -> float:  # XLA compiles (ptxas) a function never jitted before
        f = jax.jit(lambda a: jnp.cos(a) * (n + 2.0) + a.T @ a)
        return float(jnp.sum(f(x)).block_until_ready())

    return answer, fresh


KERNEL = r"""
extern "C" __global__ void scale(const float* a, float* b, float k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i] * k + %d.0f;
}
"""


def cupy_mix() -> tuple[Callable[[], float], Fresh]:
    import cupy as cp  # noqa: PLC0415

    rs = cp.random.RandomState(14)
    x = rs.standard_normal((N, N), dtype=cp.float32)
    w = rs.standard_normal((N, N), dtype=cp.float32) / 45
    sig = rs.standard_normal(1 << 20, dtype=cp.float32)
    scale = cp.RawKernel(KERNEL % 1, "scale")  # NVRTC, at start
    out = cp.empty_like(sig)

    def answer() -> float:
        scale(((sig.size + 255) // 256,), (256,), (sig, out, cp.float32(0.5), cp.int32(sig.size)))
        spectrum = cp.abs(cp.fft.rfft(out)).sum()
        return float((x @ w).sum()) + float(spectrum)

    def fresh(n: int) -> float:  # NVRTC compiles a kernel never compiled before
        k = cp.RawKernel(KERNEL % (n + 7), "scale")
        k(((sig.size + 255) // 256,), (256,), (sig, out, cp.float32(2.0), cp.int32(sig.size)))
        return float(out.sum())

    return answer, fresh


FRAMEWORKS = {"torch-eager": torch_eager, "torch-compile": torch_compile, "jax": jax_chain, "cupy": cupy_mix}


def child(framework: str, conn: Any) -> None:
    """The second process of a two-process pod: its own CUDA context, asked over a pipe."""
    answer, fresh = FRAMEWORKS[framework]()
    conn.send(answer())
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send((answer(), fresh(msg)))


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    ap.add_argument("--procs", type=int, choices=(1, 2), default=1)
    args = ap.parse_args()
    control = Path(os.environ["REKINDLE_CONTROL_DIR"])
    t0 = time.monotonic()
    peer = None
    if args.procs == 2:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA is not fork-safe
        here, there = ctx.Pipe()
        peer = ctx.Process(target=child, args=(args.framework, there), daemon=True)
        peer.start()
    answer, fresh = FRAMEWORKS[args.framework]()

    def both(n: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"answer": answer()}
        if n is not None:
            out["fresh"] = fresh(n)
        if peer is not None:
            if n is None:
                out["child"] = here.recv()
            else:
                here.send(n)
                out["child"], out["child_fresh"] = here.recv()
        return out

    first = both(None)
    atomic_write(control / "answers.json", json.dumps({**first, "pid": os.getpid(),
                                                        "ready_s": round(time.monotonic() - t0, 3)}))
    atomic_write(control / "ready-for-checkpoint", f"{os.getpid()}\n")
    print(f"framework_worker {args.framework} x{args.procs}: ready {first}", flush=True)
    ask = control / "ask"
    n = 0
    while True:
        if ask.exists():
            rid = ask.read_text().strip()
            ask.unlink()
            n += 1
            atomic_write(control / "reply.json", json.dumps({"id": rid, **both(n)}))
        time.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main())
