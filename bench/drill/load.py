"""The load figure: ``pods`` pods created at once through CRI, half annotated to restore one
published artifact, half plain, on containerd 1.7 with the plugin.

Contract: ``load_figure(rig, pods, warmup_mib)`` publishes the artifact from one source pod
(then removes it), releases every pod's thread at one barrier (RunPodSandbox, CreateContainer,
StartContainer, as kubelet does), waits for every restore's final status and every plain pod's
container to run, and returns the figure: NRI timeouts (containerd log lines of a plugin request
timing out or the plugin being closed), the plugin's handler times (its ``served <method> in
<ms>`` lines: decode to reply, queueing included), CRI latencies seen by the client, restores
against cold starts (and why), pods answering, and the wall time. Every pod is removed after.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.drill.rig import CONTAINER, IMAGE, Rig, Workload, count_of, fields, http, same_start
from runtime.status import Phase

ARTIFACT = "load"
# What containerd 1.7 / NRI 0.6 logs when a plugin misses its request budget or is dropped.
NRI_TIMEOUT_NEEDLES = ("context deadline exceeded", "closing plugin", "failed to handle event",
                       "plugin request timed out")
SERVED_RE = re.compile(r"served (\S+) in ([0-9.]+) ms")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return round(ordered[int(rank) - 1], 3)


def summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": round(max(values), 3) if values else None}


def load_figure(rig: Rig, pods: int = 100, warmup_mib: int = 16, timeout: float = 600.0) -> dict[str, Any]:
    assert rig.cri is not None
    cri = rig.cri
    wl = Workload(warmup_mib)
    src = rig.start_pod("drill-load-src", wl, {"rekindle.dev/checkpoint": ARTIFACT})
    st = rig.wait_status(src, {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 180)
    ref = fields(rig.wait_serving(src) or "")
    rig.stop_pod(src.pod)
    if st is None or st.phase is not Phase.PUBLISHED:
        return {"error": f"the load artifact was not published: {st.reason if st else 'no status'}"}

    containerd_log = rig.sandbox.paths.log
    clog_start = containerd_log.stat().st_size
    rig.tail.mark()
    barrier = threading.Barrier(pods)

    def one(i: int) -> dict[str, Any]:
        restore = i % 2 == 0
        rec: dict[str, Any] = {"i": i, "restore": restore}
        barrier.wait()
        try:
            t0 = time.monotonic()
            pod = cri.run_pod_sandbox(f"drill-load-{i:03d}",
                                      annotations={"rekindle.dev/restore": ARTIFACT} if restore else {})
            rec["pod"] = pod
            t1 = time.monotonic()
            cid = cri.create_container(pod, CONTAINER, IMAGE, command=wl.command, env=wl.env)
            t2 = time.monotonic()
            cri.start_container(cid)
            t3 = time.monotonic()
            rec.update(cid=cid, run_s=t1 - t0, create_s=t2 - t1, start_s=t3 - t2, started_at=t3)
        except Exception as exc:  # noqa: BLE001 - counted in the figure
            rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec

    t_start = time.monotonic()
    with ThreadPoolExecutor(pods) as ex:
        recs = list(ex.map(one, range(pods)))
    created_s = time.monotonic() - t_start
    for r in recs:
        if "pod" in r:
            rig.pods.append(r["pod"])

    deadline = t_start + timeout
    outcomes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    answering = 0
    for r in recs:
        if "cid" not in r:
            continue
        if r["restore"]:
            st = rig.status.wait("default", r["pod"].name, CONTAINER, {Phase.RESTORED, Phase.COLD_START},
                                 max(0.0, deadline - time.monotonic()), poll=0.1)
            phase = st.phase.value if st else "no status"
            outcomes[phase] = outcomes.get(phase, 0) + 1
            if st is not None and st.reason:
                key = st.reason[:160]
                reasons[key] = reasons.get(key, 0) + 1
        answered_at = _wait_answer(rig, r, deadline)
        r["ready_s"] = answered_at - t_start if answered_at else None
        answering += r["ready_s"] is not None
    wall_s = time.monotonic() - t_start

    text = rig.tail.text()
    served: dict[str, list[float]] = {}
    for method, ms in SERVED_RE.findall(text):
        served.setdefault(method, []).append(float(ms))
    with open(containerd_log, "rb") as f:
        f.seek(clog_start)
        runtime_log = f.read().decode(errors="replace")
    timeouts = [ln for ln in runtime_log.splitlines() if any(n in ln for n in NRI_TIMEOUT_NEEDLES)]
    ok = [r for r in recs if "cid" in r]
    fig = {
        "pods": pods, "restore_pods": sum(r["restore"] for r in recs), "warmup_mib": warmup_mib,
        "errors": [r["error"] for r in recs if "error" in r],
        "nri_timeouts": len(timeouts), "nri_timeout_lines": timeouts[:10],
        "plugin_overruns": text.count("overran its"),
        "handler_ms": {"all": summary([v for vs in served.values() for v in vs]),
                       **{m: summary(vs) for m, vs in sorted(served.items())}},
        "cri_s": {"RunPodSandbox": summary([r["run_s"] for r in ok]),
                  "CreateContainer": summary([r["create_s"] for r in ok]),
                  "StartContainer": summary([r["start_s"] for r in ok])},
        "restores": outcomes, "cold_start_reasons": reasons,
        "answering": answering,
        "restored_serving_on": sum(1 for r in ok if r["restore"] and same_start(r.get("body", ""), ref)),
        "ready_s": summary([r["ready_s"] for r in ok if r.get("ready_s") is not None]),
        "created_s": round(created_s, 2), "wall_s": round(wall_s, 2),
    }
    _remove_all(rig, [r["pod"] for r in recs if "pod" in r])
    return fig


def _wait_answer(rig: Rig, r: dict[str, Any], deadline: float) -> float:
    """When the pod first answered GET / (monotonic), 0.0 if it did not by the deadline; a restored
    pod must answer from where its source was (count > 1)."""
    assert rig.cri is not None
    ip = rig.cri.pod_ip(r["pod"].id)
    while time.monotonic() < deadline:
        try:
            body = http(ip, "/", 1.0)
            r["count"] = count_of(body)
            r["body"] = body
            r["answered_at"] = time.monotonic()
            return r["answered_at"]
        except OSError:
            time.sleep(0.1)
    r["answered_at"] = 0.0
    return 0.0


def _remove_all(rig: Rig, pods: list[Any]) -> None:
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(rig.stop_pod, pods))
