"""bench/entry_fill.py end to end on a few MiB: every shape fills real target processes, whose
memory the bench compares with the file (it exits otherwise), and the figures add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="process_vm_writev into other processes and a tmpfs mount: root")
def test_the_bench_fills_every_target_and_reports_each_shape(tmp_path: Path) -> None:
    out = tmp_path / "fill.json"
    done = subprocess.run([sys.executable, "-m", "bench.entry_fill", "--mib", "8", "--pods", "2", "--rounds", "1",
                           "--threads", "2", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    shapes = {(r["shape"], r["pods"]) for r in report["summary"]}
    assert shapes == {(s, p) for s in ("verified", "sealed", "copy") for p in (1, 2)}
    for r in report["summary"]:
        assert r["seconds"] > 0 and r["gbps"] > 0
        assert r["gbps"] == pytest.approx(r["pods"] * (8 << 20) / 1e9 / r["seconds"], rel=0.01)
    assert all(r["ratio_to_verified"] == 1.0 for r in report["summary"] if r["shape"] == "verified")
    assert "x one target" in done.stdout
