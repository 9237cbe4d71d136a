"""runtime/workload/rekindle_tp.py: the tensor-parallel checkpoint protocol, with ranks as threads
over a fake torch.distributed, and with real torch.distributed (gloo, two processes) when torch is
installed."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runtime.workload import rekindle_tp
from runtime.workload.rekindle_tp import Outcome, TensorParallelGroup
from tests.waiting import wait_for

HELPER = Path(rekindle_tp.__file__)


class Stores:
    """A fake TCPStore factory: masters get fresh ports, clients must name a served one."""

    def __init__(self) -> None:
        self.ports = itertools.count(40000)
        self.served: set[int] = set()
        self.calls: list[tuple[int, bool, bool]] = []  # (port, is_master, use_libuv)
        self.lock = threading.Lock()

    def __call__(self, host: str, port: int, world: int, is_master: bool, **kw: Any) -> Any:
        assert host == "127.0.0.1"
        with self.lock:
            if is_master:
                port = next(self.ports)
                self.served.add(port)
            else:
                assert port in self.served, f"no store on {port}"
            self.calls.append((port, is_master, kw["use_libuv"]))
        return type("Store", (), {"port": port})()


class FakeDist:
    """One process's torch.distributed, writing what it does into a shared log."""

    def __init__(self, rank: int, log: list[tuple[str, int, Any]]) -> None:
        self.rank, self.log, self.up = rank, log, False

    def init_process_group(self, backend: str, store: Any, rank: int, world_size: int, timeout: Any) -> None:
        assert not self.up and rank == self.rank
        self.up = True
        self.log.append(("init", rank, store.port))

    def is_initialized(self) -> bool:
        return self.up

    def barrier(self) -> None:
        self.log.append(("barrier", self.rank, None))

    def destroy_process_group(self) -> None:
        assert self.up
        self.up = False
        self.log.append(("destroy", self.rank, None))


def run_ranks(world: int, control: Path, stores: Stores, log: list, agent: Any, **kw: Any) -> list[Any]:
    """init + before_checkpoint on ``world`` threads; ``agent(control)`` plays the node agent."""
    results: list[Any] = [None] * world
    groups = [TensorParallelGroup(r, world, backend="gloo", control_dir=str(control),
                                  dist=FakeDist(r, log), make_store=stores) for r in range(world)]

    def rank(r: int) -> None:
        groups[r].init()
        results[r] = (groups[r].before_checkpoint(**kw), time.monotonic())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    agent_thread = threading.Thread(target=agent, args=(control,))
    for t in (*threads, agent_thread):
        t.start()
    for t in (*threads, agent_thread):
        t.join(30)
        assert not t.is_alive()
    assert all(g.generation == 1 for g in groups)
    return results


def wait_file(path: Path, timeout: float = 10.0) -> None:
    wait_for(path.exists, timeout, f"{path} to appear", interval=0.01)


def test_ready_only_after_every_rank_is_down_then_rebuilt_on_a_fresh_store(tmp_path: Path) -> None:
    log: list[tuple[str, int, Any]] = []
    stores = Stores()
    seen: dict[str, Any] = {}

    def agent(control: Path) -> None:
        wait_file(control / "ready-for-checkpoint")
        seen["destroyed"] = sorted(r for op, r, _ in list(log) if op == "destroy")
        seen["at"] = time.monotonic()
        time.sleep(0.2)  # the checkpoint: nobody may move meanwhile
        seen["inits_during"] = [e for e in log if e[0] == "init" and e[2] != 40000]
        (control / "snapshot-complete").write_text("tp\n")

    results = run_ranks(3, tmp_path, stores, log, agent)
    assert seen["destroyed"] == [0, 1, 2]
    assert not seen["inits_during"]
    assert [o for o, _ in results] == [Outcome.SNAPSHOT_COMPLETE] * 3
    assert all(t > seen["at"] + 0.2 for _, t in results)
    # Generation 0 and 1 each on one store that rank 0 served; every store without libuv.
    assert sorted(p for op, _, p in log if op == "init") == [40000] * 3 + [40001] * 3
    assert [(p, m) for p, m, _ in stores.calls if m] == [(40000, True), (40001, True)]
    assert not any(libuv for _, _, libuv in stores.calls)
    assert (tmp_path / "tp-store-1").read_text() == "40001\n"


def test_an_older_sentinel_does_not_end_the_wait(tmp_path: Path) -> None:
    """A restored copy wakes in a control dir that may hold sentinels it has seen before: only a
    new one counts (here: restore-complete written after the checkpoint)."""
    (tmp_path / "snapshot-complete").write_text("an earlier cycle\n")
    (tmp_path / "checkpoint-failed").write_text("an earlier cycle\n")
    log: list = []
    written: dict[str, float] = {}

    def agent(control: Path) -> None:
        wait_file(control / "ready-for-checkpoint")
        time.sleep(0.3)
        written["at"] = time.monotonic()
        (control / "restore-complete").write_text("tp\n")

    results = run_ranks(2, tmp_path, Stores(), log, agent)
    assert [o for o, _ in results] == [Outcome.RESTORED] * 2
    assert all(t >= written["at"] for _, t in results)


def test_checkpoint_failed_rebuilds_and_says_so(tmp_path: Path) -> None:
    def agent(control: Path) -> None:
        wait_file(control / "ready-for-checkpoint")
        (control / "checkpoint-failed").write_text("checkpoint refused: ...\n")

    results = run_ranks(2, tmp_path, Stores(), [], agent)
    assert [o for o, _ in results] == [Outcome.CHECKPOINT_FAILED] * 2


def test_timeout_rebuilds_anyway(tmp_path: Path) -> None:
    log: list = []
    results = run_ranks(2, tmp_path, Stores(), log, lambda control: None, timeout=0.3)
    assert [o for o, _ in results] == [Outcome.TIMEOUT] * 2
    assert [op for op, r, _ in log if r == 1] == ["init", "barrier", "destroy", "init"]


def test_without_a_control_dir_nothing_is_torn_down(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in rekindle_tp.CONTROL_ENV:
        monkeypatch.delenv(name, raising=False)
    log: list = []
    g = TensorParallelGroup(0, 1, dist=FakeDist(0, log), make_store=Stores())
    assert g.before_checkpoint() is Outcome.NOT_MANAGED
    assert log == []


def test_helper_imports_nothing_from_rekindle() -> None:
    """It ships into workload images alone."""
    text = HELPER.read_text()
    assert "import runtime" not in text and "from runtime" not in text and "nri_plugin" not in text
    load = ("import importlib.util as u, sys; s = u.spec_from_file_location('rekindle_tp', sys.argv[1]); "
            "s.loader.exec_module(u.module_from_spec(s)); "
            "print(sorted(m for m in sys.modules if m.startswith(('runtime', 'torch'))))")
    out = subprocess.run([sys.executable, "-I", "-c", load, str(HELPER)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- real torch.distributed (gloo) ------------------------------------------------------------

RANK = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from rekindle_tp import TensorParallelGroup
g = TensorParallelGroup.from_env(backend="gloo")
g.init()
def allreduce():
    t = torch.full((4,), float(g.rank + 1))
    dist.all_reduce(t)
    return t.tolist()
before = allreduce()
outcome = g.before_checkpoint(timeout=60)
after = allreduce()
print(json.dumps({"rank": g.rank, "before": before, "after": after, "outcome": outcome.value,
                  "libuv": os.environ.get("USE_LIBUV"), "generation": g.generation}), flush=True)
dist.destroy_process_group()
"""


def torch_python() -> str | None:
    """A Python with torch: ``$REKINDLE_TORCH_PYTHON``, or this one when it has torch."""
    if os.environ.get("REKINDLE_TORCH_PYTHON"):
        return os.environ["REKINDLE_TORCH_PYTHON"]
    return sys.executable if importlib.util.find_spec("torch") is not None else None


@pytest.mark.skipif(torch_python() is None, reason="no Python with torch (set REKINDLE_TORCH_PYTHON)")
def test_real_gloo_group_goes_down_and_comes_back(tmp_path: Path) -> None:
    python = torch_python()
    assert python is not None
    procs = [subprocess.Popen([python, "-c", RANK], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(HELPER.parent),  # as a workload image has it
                                   "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "REKINDLE_CONTROL_DIR": str(tmp_path), "GLOO_SOCKET_IFNAME": "lo"})
             for r in range(2)]
    try:
        wait_file(tmp_path / "ready-for-checkpoint", timeout=120)
        # Both ranks hold no process group now: no gloo connection between them is left.
        for p in procs:
            conns = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
            assert f"pid={p.pid}," not in conns, conns
        (tmp_path / "snapshot-complete").write_text("tp\n")
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    got = [json.loads(out) for out, _ in outs]
    assert all(r["before"] == r["after"] == [3.0] * 4 for r in got), got
    assert {r["outcome"] for r in got} == {"snapshot-complete"} and {r["libuv"] for r in got} == {"0"}
