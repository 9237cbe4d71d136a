"""Jobs: ready-probes under their per-pod and per-node caps, engine work on its own threads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from nri_plugin.jobs import Jobs, Work
from nri_plugin.policy import Intent, ProbeKind, ReadyProbe, Role
from nri_plugin.probes import ProbeSlots
from runtime import control
from runtime.status import Phase, StatusBook


class CountingEngine:
    """Probes that take a while and never succeed; counts how many run at once."""

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self.max_per_pod = 0
        self.max_total = 0
        self.probed: Counter[str] = Counter()
        self.engine_threads: list[str] = []

    async def probe(self, netns: str, probe: ReadyProbe) -> bool:
        pod = netns  # the tests use the netns path as the pod's name
        self.running[pod] += 1
        self.max_per_pod = max(self.max_per_pod, self.running[pod])
        self.max_total = max(self.max_total, sum(self.running.values()))
        self.probed[pod] += 1
        try:
            await asyncio.sleep(0.1)
        finally:
            self.running[pod] -= 1
        return False

    def checkpoint(self, work: Work) -> dict[str, float]:
        self.engine_threads.append(threading.current_thread().name)
        return {"dump": 0.0}

    restore = checkpoint


def _work(tmp_path, pod: str, container: str, probe: ReadyProbe) -> Work:
    ctl = control.ControlDir(tmp_path / "control" / pod / container)
    ctl.prepare()
    return Work(intent=Intent(Role.CHECKPOINT, "m", probe), control=ctl, container_id=f"{pod}-{container}",
                pid=1, namespace="default", pod=pod, pod_uid=f"uid-{pod}", container=container, image="",
                netns=pod)


def test_probes_respect_the_per_pod_and_per_node_caps(tmp_path):
    engine = CountingEngine()
    status = StatusBook(tmp_path / "state")
    probe = ReadyProbe(ProbeKind.HTTP, "127.0.0.1", 8080)

    async def body():
        jobs = Jobs(engine, status, probes=ProbeSlots(per_pod=1, per_node=3))
        for pod in ("a", "b", "c", "d", "e"):
            for ctr in ("one", "two", "three"):
                jobs.start(_work(tmp_path, pod, ctr, probe))
        # The loop stays free while probes wait for slots.
        lag = 0.0
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            lag = max(lag, time.monotonic() - t0 - 0.01)
        await jobs.shutdown()
        return lag

    lag = asyncio.run(body())
    assert engine.max_per_pod == 1 and engine.max_total == 3, (engine.max_per_pod, engine.max_total)
    assert set(engine.probed) == {"a", "b", "c", "d", "e"}, "every pod gets its turn"
    assert lag < 0.25  # nothing blocks the loop (a shared 2-core machine adds its own jitter)


def test_engine_work_runs_on_the_jobs_own_threads(tmp_path):
    engine = CountingEngine()
    status = StatusBook(tmp_path / "state")
    work = _work(tmp_path, "a", "one", ReadyProbe(ProbeKind.FILE))
    work.control.write("ready-for-checkpoint", "")

    async def body():
        jobs = Jobs(engine, status, max_parallel=2)
        jobs.start(work)
        st = await asyncio.to_thread(status.wait, "default", "a", "one", {Phase.PUBLISHED}, 5)
        await jobs.shutdown()
        return st

    assert asyncio.run(body()).phase is Phase.PUBLISHED
    assert engine.engine_threads and all(n.startswith("rekindle-engine") for n in engine.engine_threads)
