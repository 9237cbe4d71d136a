"""Host-to-device (and back) copy rates, pinned and pageable: the ceiling of a CUDA restore.
Measured in a child Python, so this one never imports torch or holds the GPU."""

from __future__ import annotations

import json
import subprocess

from bench.common.units import GIB

H2D_CODE = r"""
import json, time, torch
n = int(%d)
dev = torch.device("cuda:0")
out = {}
for name, pin in (("pinned", True), ("pageable", False)):
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pin); host.fill_(1)
    d = torch.empty(n, dtype=torch.uint8, device=dev); torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter(); d.copy_(host, non_blocking=pin); torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t) / 1e9)
    out["h2d_" + name + "_gbps"] = round(best, 2)
    t = time.perf_counter(); host.copy_(d); torch.cuda.synchronize()
    out["d2h_" + name + "_gbps"] = round(n / (time.perf_counter() - t) / 1e9, 2)
    del host, d
print(json.dumps(out))
"""


def measure_h2d(python: str, gib: float) -> dict[str, float]:
    """``h2d_pinned_gbps``, ``h2d_pageable_gbps`` (best of 3) and the ``d2h_*`` rates of ``gib`` GiB,
    measured by ``python`` (one with torch)."""
    r = subprocess.run([python, "-c", H2D_CODE % int(gib * GIB)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])
