"""The load figure: ``pods`` pods created at once through CRI, half annotated to restore one
published artifact, half plain, on containerd 1.7 with the plugin; and the same burst without
the plugin, for what it adds.

Contract: ``load_figure(rig, pods, warmup_mib, baseline)`` publishes the artifact from one source
pod (then removes it), releases every pod's thread at one barrier (RunPodSandbox,
CreateContainer, StartContainer, as kubelet does), waits for every restore's final status and
every pod to answer, and returns the figure: NRI timeouts (containerd log lines of a plugin
request timing out or the plugin being closed), the plugin's handler times (its ``served
<method> in <ms>`` lines: decode to reply, queueing included), CRI latencies seen by the client,
restores against cold starts (and why), restored pods answering as their source, and the wall
time. With ``baseline`` the same burst first runs with the plugin stopped (every pod cold).
Every pod is removed after each burst.
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
SERVED_RE = re.compile(r"served (\S+) (\S+) in ([0-9.]+) ms")


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


def _burst(rig: Rig, wl: Workload, pods: int, tag: str) -> tuple[list[dict[str, Any]], float]:
    """Create ``pods`` pods at once (even ones annotated to restore); their records, and when
    the burst started (monotonic)."""
    assert rig.cri is not None
    cri = rig.cri
    barrier = threading.Barrier(pods)

    def one(i: int) -> dict[str, Any]:
        restore = i % 2 == 0
        rec: dict[str, Any] = {"i": i, "restore": restore}
        barrier.wait()
        try:
            t0 = time.monotonic()
            pod = cri.run_pod_sandbox(f"drill-{tag}-{i:03d}",
                                      annotations={"rekindle.dev/restore": ARTIFACT} if restore else {})
            rec["pod"] = pod
            t1 = time.monotonic()
            cid = cri.create_container(pod, CONTAINER, IMAGE, command=wl.command, env=wl.env)
            t2 = time.monotonic()
            cri.start_container(cid)
            rec.update(cid=cid, run_s=t1 - t0, create_s=t2 - t1, start_s=time.monotonic() - t2)
        except Exception as exc:  # noqa: BLE001 - counted in the figure
            rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec

    t_start = time.monotonic()
    with ThreadPoolExecutor(pods) as ex:
        recs = list(ex.map(one, range(pods)))
    rig.pods.extend(r["pod"] for r in recs if "pod" in r)
    return recs, t_start


def _answers(rig: Rig, recs: list[dict[str, Any]], t_start: float, deadline: float) -> None:
    """Record in each pod's record when it first answered GET / (``ready_s``) and what."""
    assert rig.cri is not None
    for r in recs:
        if "cid" not in r:
            continue
        ip = rig.cri.pod_ip(r["pod"].id)
        while time.monotonic() < deadline:
            try:
                r["body"] = http(ip, "/", 1.0)
                r["ready_s"] = time.monotonic() - t_start
                break
            except OSError:
                time.sleep(0.1)


def _cri(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if "cid" in r]
    return {"RunPodSandbox": summary([r["run_s"] for r in ok]),
            "CreateContainer": summary([r["create_s"] for r in ok]),
            "StartContainer": summary([r["start_s"] for r in ok])}


def _remove_all(rig: Rig, recs: list[dict[str, Any]]) -> None:
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(rig.stop_pod, [r["pod"] for r in recs if "pod" in r]))


def load_figure(rig: Rig, pods: int = 100, warmup_mib: int = 16, baseline: bool = True,
                timeout: float = 600.0) -> dict[str, Any]:
    wl = Workload(warmup_mib)
    fig: dict[str, Any] = {"pods": pods, "restore_pods": (pods + 1) // 2, "warmup_mib": warmup_mib}
    if baseline:
        rig.plugin.stop()
        recs, t0 = _burst(rig, wl, pods, "base")
        _answers(rig, recs, t0, t0 + timeout)
        fig["without_plugin"] = {"cri_s": _cri(recs), "errors": [r["error"] for r in recs if "error" in r],
                                 "answering": sum("ready_s" in r for r in recs),
                                 "wall_s": round(max([r.get("ready_s", 0.0) for r in recs] or [0.0]), 2)}
        _remove_all(rig, recs)
        rig.restart_plugin()

    src = rig.start_pod("drill-load-src", wl, {"rekindle.dev/checkpoint": ARTIFACT})
    st = rig.wait_status(src, {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 180)
    ref = fields(rig.wait_serving(src) or "")
    rig.stop_pod(src.pod)
    if st is None or st.phase is not Phase.PUBLISHED:
        return {**fig, "error": f"the load artifact was not published: {st.reason if st else 'no status'}"}

    containerd_log = rig.sandbox.paths.log
    clog_start = containerd_log.stat().st_size
    rig.tail.mark()
    recs, t_start = _burst(rig, wl, pods, "load")
    created_s = time.monotonic() - t_start
    deadline = t_start + timeout
    outcomes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in recs:
        if "cid" in r and r["restore"]:
            st = rig.status.wait("default", r["pod"].name, CONTAINER, {Phase.RESTORED, Phase.COLD_START},
                                 max(0.0, deadline - time.monotonic()), poll=0.1)
            phase = st.phase.value if st else "no status"
            outcomes[phase] = outcomes.get(phase, 0) + 1
            if st is not None and st.reason:
                reasons[st.reason[:160]] = reasons.get(st.reason[:160], 0) + 1
    _answers(rig, recs, t_start, deadline)
    wall_s = max([r.get("ready_s", 0.0) for r in recs] or [0.0])

    text = rig.tail.text()
    restoring = {f"default/{r['pod'].name}" for r in recs if r["restore"] and "pod" in r}
    served: dict[str, list[float]] = {}
    by_kind: dict[str, list[float]] = {"restore pods": [], "plain pods": [], "no pod": []}
    for method, pod, ms in SERVED_RE.findall(text):
        served.setdefault(method, []).append(float(ms))
        kind = "no pod" if pod == "-" else "restore pods" if pod in restoring else "plain pods"
        by_kind[kind].append(float(ms))
    with open(containerd_log, "rb") as f:
        f.seek(clog_start)
        runtime_log = f.read().decode(errors="replace")
    timeouts = [ln for ln in runtime_log.splitlines() if any(n in ln for n in NRI_TIMEOUT_NEEDLES)]
    ok = [r for r in recs if "cid" in r]
    fig.update({
        "errors": [r["error"] for r in recs if "error" in r],
        "nri_timeouts": len(timeouts), "nri_timeout_lines": timeouts[:10],
        "plugin_overruns": text.count("overran its"),
        "handler_ms": {"all": summary([v for vs in served.values() for v in vs]),
                       **{m: summary(vs) for m, vs in sorted(served.items())}},
        "handler_ms_by_pod": {k: summary(v) for k, v in by_kind.items()},
        "cri_s": _cri(recs),
        "restores": outcomes, "cold_start_reasons": reasons,
        "answering": sum("ready_s" in r for r in ok),
        "restored_serving_on": sum(1 for r in ok if r["restore"] and same_start(r.get("body", ""), ref)),
        "plain_started_cold": sum(1 for r in ok if not r["restore"] and r.get("body")
                                  and count_of(r["body"]) == 1),
        "ready_s": summary([r["ready_s"] for r in ok if "ready_s" in r]),
        "created_s": round(created_s, 2), "wall_s": round(wall_s, 2),
    })
    _remove_all(rig, recs)
    return fig
