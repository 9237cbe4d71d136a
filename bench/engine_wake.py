"""Benchmark: the engine worker's first decode after a wake-up, by where its weights slept.

Usage (a GPU node, its Python with torch and transformers):
``python -m bench.engine_wake [--model-dir DIR] [--fraction 0.4] [--rounds 2] [--json OUT]``

Through the plugin, the first completion after a wake-up took 2.4 s with pinned sleeping weights
and 0.3 s with pageable ones, the same arena and addresses; the source showed it too, so it is in
the worker, not the restore. One process, one model, the variants in turn, each ``--rounds``
times (sleep, wake-up, then the first decode and a warm one, all timed):

- ``pageable`` (the baseline): the weights sleep in pageable memory, back through two pinned
  staging buffers that are freed at once;
- ``pinned``: the weights sleep in one pinned buffer that goes to torch's host cache after the
  wake-up (as vLLM's does), then the decode;
- ``pinned-emptied``: the same, the host cache emptied (the pinned buffer freed) before the decode;
- ``pinned-idle``: the same as ``pinned``, 3 s idle between the wake-up and the decode (whether
  the cost is time-bound work in the background);
- ``pinned-profiled``: ``pinned`` with the first decode under ``torch.profiler``: its costliest
  operations by self CPU time.

Each decode's CPU user and system seconds are recorded beside its wall time (a kernel-side cost,
such as page faults on host memory, shows as system time). Every decode's tokens must equal the
reference. The speed of light is the warm decode (``decode_s``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.model import DEFAULT_DIR, make_in_child

VARIANTS = ("pageable", "pinned", "pinned-emptied", "pinned-idle", "pinned-profiled")


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def timed(fn: Any) -> tuple[Any, dict[str, float]]:
    """fn()'s value with its wall, user and system seconds."""
    u0, s0 = _cpu()
    t = time.monotonic()
    value = fn()
    wall = time.monotonic() - t
    u1, s1 = _cpu()
    return value, {"wall_s": round(wall, 3), "user_s": round(u1 - u0, 3), "sys_s": round(s1 - s0, 3)}


def top_ops(prof: Any, n: int = 15) -> list[dict[str, Any]]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1),
             "cpu_total_ms": round(e.cpu_time_total / 1000, 1)} for e in rows]


def one_round(engine: Any, variant: str, reference: list[int]) -> dict[str, Any]:
    from bench.workloads.engine_worker import empty_host_cache  # noqa: PLC0415 - needs torch

    torch = engine.torch
    engine.weights_host = "pageable" if variant == "pageable" else "pinned"
    slept, sleep_t = timed(engine.sleep)
    woke, wake_t = timed(engine.wake_up)
    rec: dict[str, Any] = {"variant": variant, "sleep": sleep_t, "wake_up": wake_t,
                           "copy_gbps": woke.get("copy_gbps"), "host_pinned": woke.get("host_pinned")}
    if variant == "pinned-emptied":
        _, rec["empty_host_cache"] = timed(lambda: empty_host_cache(torch))
    if variant == "pinned-idle":
        time.sleep(3)
    if variant == "pinned-profiled":
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tokens, rec["first_decode"] = timed(engine.generate)
        rec["first_decode_ops"] = top_ops(prof)
    else:
        tokens, rec["first_decode"] = timed(engine.generate)
    warm_tokens, rec["warm_decode"] = timed(engine.generate)
    rec["tokens_match"] = tokens == reference and warm_tokens == reference
    if variant != "pinned-emptied":
        empty_host_cache(torch)  # the next round starts with an empty host cache
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--fraction", type=float, default=0.4, help="the KV pool's share of the GPU")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {VARIANTS}")
    made, err = make_in_child(args.model_dir)
    if made is None:
        print(err, file=sys.stderr)
        return 1
    from bench.workloads.engine_worker import EngineWorker  # noqa: PLC0415 - imports torch
    from bench.workloads.llm_worker import Worker  # noqa: PLC0415

    worker = Worker(str(args.model_dir), "reduce-overhead", 32, 3)
    engine = EngineWorker(worker, args.fraction, "pinned", stable=True)
    reference = engine.rec["reference_tokens"]
    out: dict[str, Any] = {"decode_s": engine.rec["decode_s"], "stable_addresses": engine.rec["stable_addresses"],
                           "arena_bytes": engine.rec.get("arena_bytes"), "versions": engine.rec["versions"],
                           "fraction": args.fraction, "rounds": []}
    for r in range(args.rounds):
        for v in variants:
            rec = one_round(engine, v, reference)
            rec["round"] = r
            out["rounds"].append(rec)
            print(f"{v:16s} round {r}: wake {rec['wake_up']['wall_s']:.3f} s ({rec['copy_gbps']} GB/s), "
                  f"first decode {rec['first_decode']['wall_s']:.3f} s (user {rec['first_decode']['user_s']:.2f}, "
                  f"sys {rec['first_decode']['sys_s']:.2f}), warm {rec['warm_decode']['wall_s']:.3f} s, "
                  f"tokens {'match' if rec['tokens_match'] else 'DIFFER'}", flush=True)
    base = [r["first_decode"]["wall_s"] for r in out["rounds"] if r["variant"] == "pageable"]
    for v in variants:
        mine = [r["first_decode"]["wall_s"] for r in out["rounds"] if r["variant"] == v]
        ratio = f"{min(mine) / min(base):.2f}x pageable" if base and min(base) > 0 else ""
        print(f"{v:16s} best first decode {min(mine):.3f} s  {ratio}  (warm decode {out['decode_s']:.3f} s)")
    for r in out["rounds"]:
        for op in r.get("first_decode_ops", [])[:10]:
            print(f"  {op['self_cpu_ms']:9.1f} ms  x{op['calls']:<5d} {op['op']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["tokens_match"] for r in out["rounds"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
