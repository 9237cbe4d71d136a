"""Benchmark: several pods restored at once from one artifact on one node, the node's memory sampled.

Usage (root): ``python -m bench.scale_out --case llm-7b|synthetic-16gib|cpu-1gib --pods 4
[--rounds bulk:off,bulk:warm,stream:warm] [--out-dir DIR] [--json FILE]``

What it shows: with the node-local artifact cache, a restore whose cache entry is complete maps
the CUDA driver's host copy from the cache file instead of copying it, so pods restored from one
artifact on one node share those host pages; without it every pod holds its own copy.

The workloads, the source pod and the per-pod wait are bench/restore_speed.py's (bench.common's
workload and restore_rig): one source pod is cold-started (timed) and checkpointed by annotation, then
stopped. Then, for each round ``PATH:CACHE`` (PATH ``bulk`` or ``stream``: the plugin restarted
with ``REKINDLE_RESTORE_PATH``; CACHE ``off``: ``REKINDLE_CACHE_BYTES=0``, no cache; ``warm``: the cache on, and one untimed
restore first, then a wait until a complete entry (``<state dir>/cache/v1/*/entry.json``) is
there; ``cold``: the cache on, its entries removed while the plugin is stopped, before each run;
an optional third field, ``unregister`` or ``continue``, sets ``REKINDLE_LET_GO``: how a streamed
restore that makes the entry lets each mapped piece go (``runtime.pages.sink``);
``--map-ranges`` sets ``REKINDLE_MAP``: the plugin's default maps only the CUDA driver's host
copy, which a CPU workload has not, so its pods are filled from the entry, not mapped), two runs: one pod alone, then ``--pods`` pods at once (their containers created together, one
thread each). The artifact is read into the page cache before each run (restore_speed's
``page-cache``). Each pod is timed from its container create to the plugin's ``restored`` and to
its first answer, which must be the source's; its ``timings.json`` gives its restore phases and,
where the engine wrote one, its ``cache`` object.

While a run goes, a thread samples every 0.1 s, from the first container create until every pod
answered and ``--steady-s`` (5) after: the node's used memory (MemTotal - MemAvailable) and the
summed PSS of every process in the run's containers (found by their pid namespaces). Host bytes
are counted from the node's used memory just before the run; ``steady_*`` is the median of the
samples after the last answer. MemAvailable counts page cache as available, mapped or not, so a
range mapped from a cache file on disk shows in the PSS (shared: each of N pods counts 1/N of
it), hardly in the host bytes; on a tmpfs cache it shows in both.

Writes ``--json`` (default OUT_DIR/scale-out.json) after every run: ``case``, ``pods``,
``cold_start_s``, ``source``, ``runs`` (one object per run: ``round``, ``pods``, ``path``,
``cache``, per-pod ``restore_s``, ``first_answer_s`` and ``cache_info``, their maxima,
``peak_host_bytes``, ``peak_pss_bytes``, ``steady_host_bytes``, ``steady_pss_bytes``,
``identical``, ``ratio_to_one`` (the run's max first answer over the one-pod run's of the same
round), ``vs_bulk_off`` (ratios against the ``bulk:off`` run of as many pods), or ``error``).
Prints a table per round and, at the end, all runs and their ratios against ``bulk:off``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import bench_main, results
from bench.common.disk import pick_image_root
from bench.common.plugin import cache_dir, cache_entries, read_timings, restart_plugin
from bench.common.restore_rig import RestoreRig
from bench.common.units import GIB
from bench.common.workload import CASES, Workload
from devtools import phases
from devtools.cri import Pod
from devtools.sandbox import Runtime, Sandbox, SandboxConfig, hold_e2e_lock
from runtime.container.containers import resolve_container
from runtime.container.namespaces import processes_in
from runtime.errors import ContainerNotFound
from tests.gpu import gpu_pods

log = logging.getLogger(__name__)

PATHS = ("bulk", "stream")
CACHES = ("off", "cold", "warm")
SAMPLE_S = 0.1
# the plugin's measurement settings a run of this bench hands on to it from its own environment
PASSED_ENV = ("REKINDLE_STREAM_THREADS", "REKINDLE_STREAM_WARM_REST", "REKINDLE_LET_GO")
LET_GOS = ("unregister", "continue")  # $REKINDLE_LET_GO: how a streamed restore lets a mapped piece go
WARM_POLL_S = 0.2


# --- rounds ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Round:
    path: str
    cache: str
    let_go: str = ""  # a third field: $REKINDLE_LET_GO for the round (else the plugin's, or passed on)

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.cache}" + (f":{self.let_go}" if self.let_go else "")

    def env(self, map_ranges: str = "", pods: int = 1) -> dict[str, str]:
        """The plugin's environment for the round ('warm' and 'cold' keep the cache's default
        bound, on a huge tmpfs); ``map_ranges``: what a restore from the cache maps (the
        plugin's default if empty); ``pods`` restores may run at once (all of them)."""
        passed = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}  # measurement settings
        return {"REKINDLE_RESTORE_PATH": self.path, "REKINDLE_MAX_PARALLEL": str(max(2, pods)),
                **({"REKINDLE_CACHE_BYTES": "0"} if self.cache == "off" else {"REKINDLE_CACHE_TMPFS": "1"}),
                **({"REKINDLE_MAP": map_ranges} if map_ranges else {}), **passed,
                **({"REKINDLE_LET_GO": self.let_go} if self.let_go else {})}


def parse_rounds(text: str) -> list[Round]:
    """``bulk:off,stream:warm,stream:cold:continue`` -> rounds; ValueError naming what is wrong."""
    rounds = []
    for part in (p.strip() for p in text.split(",")):
        path, sep, rest = part.partition(":")
        cache, _, let_go = rest.partition(":")
        if not sep or path not in PATHS or cache not in CACHES or (let_go and let_go not in LET_GOS):
            raise ValueError(f"round {part!r}: want PATH:CACHE[:LET_GO], PATH one of {PATHS}, CACHE one of {CACHES}, "
                             f"LET_GO one of {LET_GOS}")
        rounds.append(Round(path, cache, let_go))
    return rounds


def _rounds_arg(text: str) -> list[Round]:
    try:
        return parse_rounds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- memory sampling --------------------------------------------------------------------------

def _kib_field(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no {name} line")


def meminfo_used(text: str) -> int:
    """The node's used memory in bytes, MemTotal - MemAvailable, from /proc/meminfo's text."""
    return _kib_field(text, "MemTotal") - _kib_field(text, "MemAvailable")


def rollup_pss(text: str) -> int:
    """A process's PSS in bytes, from its /proc/PID/smaps_rollup text."""
    return _kib_field(text, "Pss")


def node_used(proc: str = "/proc") -> int:
    with open(f"{proc}/meminfo") as f:
        return meminfo_used(f.read())


def pss_of(pids: Iterable[int], proc: str = "/proc") -> int:
    """Summed PSS of the processes; one that exits meanwhile counts nothing."""
    total = 0
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/smaps_rollup") as f:
                total += rollup_pss(f.read())
        except (OSError, ValueError):
            continue
    return total


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic()
    used: int  # node used memory, bytes
    pss: int  # summed PSS of the run's processes, bytes


class Sampler:
    """A thread that samples the node's used memory and the PSS of ``pids()`` every ``interval``
    seconds from ``start`` to ``stop``."""

    def __init__(self, pids: Callable[[], list[int]], interval: float = SAMPLE_S, proc: str = "/proc") -> None:
        self.pids, self.interval, self.proc = pids, interval, proc
        self.samples: list[Sample] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._done.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(Sample(time.monotonic(), node_used(self.proc), pss_of(self.pids(), self.proc)))
            except Exception:  # noqa: BLE001 - one lost sample is no reason to stop sampling
                log.exception("memory sample")
            if self._done.wait(self.interval):
                return


def memory_figures(samples: Sequence[Sample], baseline: int, answered_at: float | None) -> dict[str, Any]:
    """Peaks over every sample and medians over those from ``answered_at`` on (None: no steady
    figures), host bytes counted from ``baseline``."""
    out: dict[str, Any] = {"samples": len(samples), "baseline_host_bytes": baseline,
                           "peak_host_bytes": None, "peak_pss_bytes": None,
                           "steady_host_bytes": None, "steady_pss_bytes": None}
    if not samples:
        return out
    out["peak_host_bytes"] = max(s.used for s in samples) - baseline
    out["peak_pss_bytes"] = max(s.pss for s in samples)
    steady = [s for s in samples if answered_at is not None and s.t >= answered_at]
    if steady:
        out["steady_host_bytes"] = int(statistics.median(s.used for s in steady)) - baseline
        out["steady_pss_bytes"] = int(statistics.median(s.pss for s in steady))
    return out


class PodProcs:
    """Host pids of every process in the containers added so far (each container's pid
    namespace, which the restored tree joins), for the sampler's thread."""

    def __init__(self, containerd_state: str) -> None:
        self.state = containerd_state
        self._cids: list[str] = []
        self._pidns: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, cid: str) -> None:
        with self._lock:
            self._cids.append(cid)

    def __call__(self) -> list[int]:
        with self._lock:
            todo = [c for c in self._cids if c not in self._pidns]
        for cid in todo:  # a task not started yet has no init to read: next sample
            try:
                self._pidns[cid] = resolve_container(self.state, cid).namespaces["pid"].inode
            except (ContainerNotFound, OSError, KeyError, ValueError):
                continue
        return sorted({p for ino in self._pidns.values() for p in processes_in(ino)})


def remove_sealed(path: Path) -> None:
    """Remove a file or tree (the node cache's entries: read-only files in 0700 directories)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# --- figures and tables (pure) ------------------------------------------------------------------

def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _max(values: Sequence[float | None]) -> float | None:
    """The largest, None when any is missing (a pod that failed has no time to compare)."""
    return None if not values or any(v is None for v in values) else max(v for v in values if v is not None)


def summarize(rec: dict[str, Any], per_pod: Sequence[dict[str, Any]]) -> None:
    """The run's per-pod lists and maxima, from each pod's record, into ``rec``."""
    rec["restore_s"] = [p.get("restore_s") for p in per_pod]
    rec["first_answer_s"] = [p.get("first_answer_s") for p in per_pod]
    rec["max_restore_s"] = _max(rec["restore_s"])
    rec["max_first_answer_s"] = _max(rec["first_answer_s"])
    rec["identical"] = bool(per_pod) and all(p.get("identical") is True for p in per_pod)
    rec["cache_info"] = [p.get("cache") for p in per_pod]


def set_ratio_to_one(one: dict[str, Any], many: dict[str, Any]) -> None:
    one["ratio_to_one"] = 1.0 if one.get("max_first_answer_s") else None
    firsts = one.get("first_answer_s") or [None]
    many["ratio_to_one"] = ratio(many.get("max_first_answer_s"), firsts[0])


COMPARED = ("max_first_answer_s", "peak_host_bytes", "peak_pss_bytes", "steady_pss_bytes")


def set_vs_bulk_off(runs: Sequence[dict[str, Any]]) -> None:
    """Each run's figures over those of the ``bulk:off`` run with as many pods (absent without one)."""
    base = {r["pods"]: r for r in runs if r.get("round") == "bulk:off" and "error" not in r}
    for r in runs:
        b = base.get(r.get("pods"))
        if b is None or "error" in r:
            r.pop("vs_bulk_off", None)
            continue
        r["vs_bulk_off"] = {k: ratio(r.get(k), b.get(k)) for k in COMPARED}


def _gib(v: Any) -> str:
    return f"{v / GIB:.2f}" if isinstance(v, (int, float)) else "-"


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def _grid(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns as wide as their widest cell; a row shorter than the head ends in a free text (an
    error) that sets no width."""
    full = [r for r in rows if len(r) == len(head)]
    widths = [max(len(h), *(len(r[i]) for r in full)) if full else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        if len(cells) < len(head):
            return "  ".join([c.ljust(w) for c, w in zip(cells[:-1], widths)] + [cells[-1]])
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join(line(r) for r in (head, *rows))


RUN_HEAD = ("pods", "path", "cache", "max restore s", "max first answer s", "ratio to one", "peak host GiB",
            "peak PSS GiB", "steady PSS GiB", "identical", "engine cache")


def table(runs: Sequence[dict[str, Any]]) -> str:
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([str(r.get("pods")), r["path"], r["cache"], f"ERROR: {r['error'].splitlines()[-1][:200]}"])
            continue
        states = sorted({c.get("state", "?") if isinstance(c, dict) else "-" for c in r.get("cache_info", [])})
        rows.append([str(r["pods"]), r["path"], r["cache"], _num(r.get("max_restore_s")),
                     _num(r.get("max_first_answer_s")), _num(r.get("ratio_to_one")), _gib(r.get("peak_host_bytes")),
                     _gib(r.get("peak_pss_bytes")), _gib(r.get("steady_pss_bytes")), str(r.get("identical")),
                     ",".join(states) or "-"])
    return _grid(RUN_HEAD, rows)


def vs_bulk_off_table(runs: Sequence[dict[str, Any]]) -> str:
    rows = [[str(r["pods"]), r["round"], *(_num(r["vs_bulk_off"].get(k)) for k in COMPARED)]
            for r in runs if r.get("vs_bulk_off")]
    return _grid(("pods", "round", "max first answer x", "peak host x", "peak PSS x", "steady PSS x"), rows)


# --- the bench --------------------------------------------------------------------------------

class ScaleOut(RestoreRig):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args, {
            "what": "bench/scale_out.py through containerd 1.7 + runc + CRIU + CNI + the plugin",
            "host": results.host(), "case": args.case, "pods": args.pods,
            "rounds": [r.spec for r in args.rounds], "artifact": "page-cache", "sample_s": SAMPLE_S,
            "steady_s": args.steady_s, "map_ranges": args.map_ranges or "(plugin default)", "runs": []})
        self.containerd_state = ""

    def fresh_plugin(self, plugin: Any, rnd: Round) -> None:
        """The plugin restarted with the round's environment; for 'cold', its cache emptied while it is stopped."""
        plugin.stop()
        cache = cache_dir(plugin)
        if rnd.cache == "cold" and cache.is_dir():
            for entry in cache.iterdir():
                remove_sealed(entry)
        restart_plugin(plugin, rnd.env(self.args.map_ranges, self.args.pods))

    def warm_up(self, cri: Any, plugin: Any, wl: Workload, rnd: Round) -> str | None:
        """One untimed restore, then the wait for a complete cache entry; the error, or None."""
        pod = cri.run_pod_sandbox(f"scale-warmup-{rnd.path}", annotations={"rekindle.dev/restore": self.args.case})
        self.pods.append(pod)
        rec: dict[str, Any] = {"round": rnd.spec}
        self.doc.setdefault("warm_ups", []).append(rec)
        t0 = time.monotonic()
        cid = wl.start(cri, pod)
        try:
            if not self.await_restore(cri, plugin, wl, pod, rnd.path, t0, rec):
                return f"the warm-up restore started cold: {rec.get('failure')}"
            rec["cache"] = (read_timings(plugin, pod) or {}).get("cache")
            deadline = time.monotonic() + self.args.warm_timeout
            while not cache_entries(plugin):
                if time.monotonic() > deadline:
                    return (f"no complete cache entry ({cache_dir(plugin)}/*/entry.json) "
                            f"{self.args.warm_timeout:.0f} s after the warm-up restore answered")
                time.sleep(WARM_POLL_S)
            rec["entries"] = [p.name for p in cache_entries(plugin)]
            return None
        finally:
            (self.args.out_dir / f"worker-warmup-{rnd.path}.log").write_text(
                gpu_pods.container_logs(cri, cid)[-100_000:])
            self.stop(cri, pod)

    def one_pod(self, cri: Any, plugin: Any, wl: Workload, pod: Pod, path: str, procs: PodProcs,
                go: threading.Barrier, cids: list[str | None], i: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"pod": pod.name}
        try:
            go.wait()
            t0 = time.monotonic()
            cids[i] = cid = wl.start(cri, pod)
            procs.add(cid)
            self.await_restore(cri, plugin, wl, pod, path, t0, rec)
            doc = read_timings(plugin, pod) or {}
            rec["restore_phases"] = doc.get("restore")
            rec["cache"] = doc.get("cache")
        except Exception as e:  # noqa: BLE001 - one pod's failure is the run's figure, not the bench's end
            log.exception("pod %s", pod.name)
            rec["error"] = str(e)[-2000:]
        return rec

    def burst(self, cri: Any, plugin: Any, wl: Workload, rnd: Round, n: int, art: Path) -> dict[str, Any]:
        """``n`` pods restored at once; their figures, the memory's included."""
        runs: list[dict[str, Any]] = self.doc["runs"]
        rec: dict[str, Any] = {"round": rnd.spec, "pods": n, "path": rnd.path, "cache": rnd.cache}
        runs.append(rec)
        phases.read_gbps([p for p in art.rglob("*") if p.is_file()], 16, limit=1 << 62)
        pods = [cri.run_pod_sandbox(f"scale-{rnd.path}-{rnd.cache}-{len(runs)}-{i}",
                                    annotations={"rekindle.dev/restore": self.args.case}) for i in range(n)]
        self.pods.extend(pods)
        procs = PodProcs(self.containerd_state)
        cids: list[str | None] = [None] * n
        go = threading.Barrier(n)
        baseline = node_used()
        sampler = Sampler(procs)
        answered_at: float | None = None
        sampler.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                per_pod = list(pool.map(lambda i: self.one_pod(cri, plugin, wl, pods[i], rnd.path, procs, go, cids, i),
                                        range(n)))
            answered_at = time.monotonic()
            time.sleep(self.args.steady_s)  # the steady window: samples after the last answer
        finally:
            rec.update(memory_figures(sampler.stop(), baseline, answered_at))
            for i, (pod, cid) in enumerate(zip(pods, cids)):
                if cid is not None:
                    (self.args.out_dir / f"worker-{rnd.path}-{rnd.cache}-{n}-{i}.log").write_text(
                        gpu_pods.container_logs(cri, cid)[-100_000:])
                self.stop(cri, pod)
        summarize(rec, per_pod)
        rec["per_pod"] = per_pod
        return rec

    def round(self, cri: Any, plugin: Any, wl: Workload, rnd: Round, art: Path) -> bool:
        """One pod alone, then ``--pods`` at once; False when a run failed."""
        runs: list[dict[str, Any]] = self.doc["runs"]
        first = len(runs)
        ok = True
        try:
            self.fresh_plugin(plugin, rnd)
            err = self.warm_up(cri, plugin, wl, rnd) if rnd.cache == "warm" else None
            if err is not None:
                log.error("round %s: %s", rnd.spec, err)
                runs.append({"round": rnd.spec, "pods": self.args.pods, "path": rnd.path, "cache": rnd.cache,
                             "error": err})
                return False
            one = self.burst(cri, plugin, wl, rnd, 1, art)
            self.save()
            if rnd.cache == "cold":  # the one pod filled the cache: empty it again
                self.fresh_plugin(plugin, rnd)
            many = self.burst(cri, plugin, wl, rnd, self.args.pods, art)
            set_ratio_to_one(one, many)
            ok = bool(one["identical"] and many["identical"])
        except Exception as exc:  # noqa: BLE001 - record it, go on with the next round
            log.exception("round %s failed", rnd.spec)
            runs.append({"round": rnd.spec, "pods": self.args.pods, "path": rnd.path, "cache": rnd.cache,
                         "error": str(exc)[-2000:]})
            ok = False
        finally:
            set_vs_bulk_off(runs)
            self.save()
            print(f"\nround {rnd.spec}:\n{table(runs[first:])}", flush=True)
            if rnd.spec != "bulk:off" and any(r.get("vs_bulk_off") for r in runs[first:]):
                print(f"against bulk:off:\n{vs_bulk_off_table(runs[first:])}", flush=True)
        return ok

    def run(self) -> int:
        args, doc = self.args, self.doc
        wl = Workload(args.case, args)
        if not self.describe(wl):
            return 1
        # the artifact, and the node cache's copy of its host part
        need = int((wl.gib or 15) * GIB * 1.15 * 2) + 4 * GIB
        work = args.work or pick_image_root(["/var/tmp", "/dev/shm"], need) / "rekindle-scale-out"
        doc["store_dir"] = str(work)
        lock = hold_e2e_lock()  # the default sandbox: never beside an e2e session
        try:
            sb = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
            started = not sb.is_running()
            sb.up()
            self.containerd_state = str(sb.paths.state)
            cri = sb.cri(timeout=120.0)
            shutil.rmtree(work, ignore_errors=True)
            plugin = gpu_pods.start_plugin(sb, work / "plugin")
            status = 0
            try:
                doc["source"] = self.source(cri, plugin, wl)
                doc["cold_start_s"] = doc["source"]["cold_start_s"]
                self.save()
                art = phases.artifact_dir(plugin.store, "default", args.case)
                doc["artifact_bytes"] = phases.phase_bytes(art)
                for rnd in args.rounds:
                    if not self.round(cri, plugin, wl, rnd, art):
                        status = 1
            finally:
                self.clean_up(cri, plugin, work)
                with contextlib.suppress(OSError):
                    remove_sealed(work)  # the node cache's entries too
                if started:
                    sb.down()
        finally:
            lock.close()
        print(f"\n{args.case}, {args.pods} pods, cold start {doc.get('cold_start_s')} s:\n{table(doc['runs'])}"
              f"\n\nagainst bulk:off:\n{vs_bulk_off_table(doc['runs'])}", flush=True)
        return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--pods", type=int, default=4, help="pods restored at once (default %(default)s)")
    ap.add_argument("--rounds", type=_rounds_arg, default=parse_rounds("bulk:off,bulk:warm,stream:warm"),
                    help="PATH:CACHE[:LET_GO],... (PATH bulk|stream, CACHE off|cold|warm, LET_GO unregister|continue)")
    bench_main.add_rig_arguments(ap, "scale-out", "wait for a complete cache entry")
    ap.add_argument("--steady-s", type=float, default=5.0, help="sampling after the last answer")
    ap.add_argument("--map-ranges", choices=("", "driver", "all", "none"), default="",
                    help="what a restore from the node cache maps ($REKINDLE_MAP; default: the plugin's)")
    args = ap.parse_args(argv)
    if args.pods < 1:
        ap.error("--pods must be at least 1")
    if not bench_main.prepare(args, "scale_out", "scale-out.json"):
        return 2
    return ScaleOut(args).run()


if __name__ == "__main__":
    sys.exit(main())
