"""A JAX process shaped like a served model, driven over stdin/stdout (for labs run by hand):
XLA's default allocator (it preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the GPU unless
``XLA_PYTHON_CLIENT_PREALLOCATE=false``), ``--gib`` GiB held in one array, and a jitted chain of
matmuls over PRNG-drawn arrays whose sum is the answer.

Lines in: ``compute`` (the answer again), ``jit-new`` (a function jitted for the first time now:
proves the compiler still works), ``quit``. Lines out: ``ready <answer>``, ``answer <x>``,
``jitted <x>``. faulthandler is on, so a fatal signal prints every Python thread's stack.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys


def main() -> None:
    faulthandler.enable()
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    import jax  # noqa: PLC0415 - after faulthandler
    import jax.numpy as jnp  # noqa: PLC0415

    keys = jax.random.split(jax.random.PRNGKey(7), 6)
    x = jax.random.normal(keys[0], (2048, 2048), jnp.float32)
    ws = [jax.random.normal(k, (2048, 2048), jnp.float32) / 45.0 for k in keys[1:5]]
    held = jnp.full((int(args.gib * (1 << 28)),), 3.0, jnp.float32)  # 4-byte floats

    @jax.jit
    def chain(x: jax.Array) -> jax.Array:
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    def answer() -> float:
        return float(jnp.sum(chain(x)).block_until_ready()) + float(jnp.sum(held[:: 1 << 16]))

    print("ready", repr(answer()), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "compute":
            print("answer", repr(answer()), flush=True)
        elif cmd == "jit-new":
            f = jax.jit(lambda a: jnp.cos(a) * 2.0 + a.T @ a)
            print("jitted", repr(float(jnp.sum(f(x)).block_until_ready())), flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
