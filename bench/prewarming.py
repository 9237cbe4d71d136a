"""Benchmark: the node cache's pre-warming through containerd and the real plugin, against its targets.

Usage (root): ``python -m bench.prewarming --case cpu-1gib|synthetic-16gib|llm-7b [--out-dir DIR]
[--json FILE] [--work DIR] [--pairs N] [--deadline-s S]``

One plugin, the node's, registered with the sandbox's containerd: its node cache on a
``huge=always`` tmpfs (the chart's default), pre-warming on, looking at the store every
``--interval`` seconds (1, the least it takes; the chart's default is 30), the product's restore
path (``auto``), and for a CPU case ``REKINDLE_MAP=all`` (a CPU tree has no CUDA driver's host
copy, the default's one mapped range). Once both artifacts are published, the cache is bound to
2.5 of them (a restore's entry made while another warms must fit beside it, or the two restores
of step 2 would take different routes). Two source pods are cold-started and checkpointed by
annotation: ``<case>-other`` (not marked), then ``<case>-pw`` (``rekindle.dev/prewarm: "true"``).
(The CLI's ``rekindle checkpoint`` of the first source would save the second cold start; the
bench keeps the plugin's own path, the one users take.)

The pre-warmer does not skip a version its own node published: a marked version it has not
seen, whose entry the cache lacks, is written whoever published it (tests/e2e/test_prewarm.py
relies on it). So the source's plugin is the node's plugin, and the warm-ups are:

- ``fresh``: the one the marked source's publish starts, the plugin running, the artifact's
  bytes in the page cache as the checkpoint left them (set against the page-cache read);
- ``disk``, ``page-cache`` (and ``during``, below): another node's publish, simulated. A look
  remembers each name's version for the life of the plugin (and does not write a version's
  entry twice), so: the plugin is stopped, its entry of the version removed, the name's link
  taken from the store, the plugin started again (its first look finds no such name); then the
  page cache is dropped (disk) or the artifact read in (page-cache) and the same link put back
  as a publish puts it (a new symlink renamed over the name). To the running plugin that is a
  version published elsewhere whose bytes wait in the shared store. The bench holds the version
  open meanwhile, as a reader: the plugin's store sweep at its start never removes it.

A warm-up runs from the publish (the link's mtime) to the entry complete (the mtime of its
``entry.json``, which ``NodeCache.write`` writes last before renaming the entry into place, and
whose presence ``NodeCache.has``, so the pre-warmer's ``warm``, looks at). Also given: from the
look that queued it (the plugin's log; publish to look is up to one interval by design) and the
writer's own seconds (its ``warm on this node`` line). One read: every file of the version read
once in the same page-cache state (dropped before each read, or read in first), in two shapes
(16 threads of 8 MiB reads; the prefetch's 4 of 2 MiB), the faster counting.

The targets:

1. warm-up <= 1.10x one read (publish to complete over the read, from disk and the page cache);
2. a restore slowed <= 5% by a warm-up: ``<case>-other`` restored alone, then while the marked
   artifact warms from disk (the restore's pod started once the plugin logs that it writes the
   entry); each in a plugin just restarted with an empty cache and the marked name away, the
   page cache dropped first, so each is that artifact's first restore on the node. Also the
   interrupted warm-up's time and pauses, against the undisturbed one;
3. the node's first restore of the marked version once pre-warmed (its ``timings.json``: route
   ``mapped``, cache ``warm``) within 5% of the normal mapped path: with pre-warming off (plugin
   restarted, cache emptied), one untimed restore makes the entry and a timed one maps it. A
   second restore on the pre-warmed entry is shown too. The artifact is read into the page cache
   before each.

Each restore is timed from its container's create to the plugin's ``restored`` and to the first
answer, which must be its source's. One run of each (``--pairs`` repeats step 2): a few percent
is within the noise of one restore. Writes ``--json`` (default OUT_DIR/prewarm.json) after every
step; prints tables and ratios, asserts no timing. ``--deadline-s`` skips a step that would not
end in time (1.5x the longest so far); the page-cache warm-up runs last, the targets' steps
first. Exit 1 when a pod's answer differed or a step failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import bench_main, results
from bench.common.disk import drop_caches, pick_image_root
from bench.common.plugin import cache_dir, cache_entries, restart_plugin
from bench.common.restore_rig import RestoreRig
from bench.common.units import GIB
from bench.common.workload import CASES, Workload
from devtools import phases
from devtools.sandbox import Runtime, Sandbox, SandboxConfig, hold_e2e_lock
from runtime.pages.nodecache import ENTRY, TMP, TMPFS_MAGIC, fs_magic
from runtime.store import ArtifactStore, load_key, readahead
from runtime.store.volume import LINK_PREFIX
from tests.gpu import gpu_pods

log = logging.getLogger(__name__)

NAMESPACE = "default"
STATE_FILE = "prewarm.json"  # nri_plugin.prewarm.STATE_FILE
POLL_S = 0.05
CACHE_ENTRIES = 2.5  # the node cache's bound, in artifacts
TARGETS = {"warm_up": 1.10, "restore_during": 1.05, "first_mapped": 1.05}
# one read's shapes: (label, threads, read size)
SHAPES = (("deep", 16, 8 << 20), ("shallow", readahead.THREADS, readahead.CHUNK))


# --- the plugin's log and the figures (pure) ---------------------------------------------------

LINE = re.compile(r"^(?P<date>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) +\w+ +nri_plugin\.prewarm: "
                  r"pre-warm: (?P<msg>.*)$", re.M)
WARM = re.compile(r"(?P<label>\S+) \S+ warm on this node: (?P<mib>[0-9.]+) MiB in (?P<s>[0-9.]+)s "
                  r"\((?P<pauses>\d+) pause\(s\) for restores(?:, the first (?P<first>[0-9.]+)s in, "
                  r"(?P<paused>[0-9.]+)s paused in all)?")
REFUSED = re.compile(r"(?P<label>\S+) \S+ refused: (?P<why>.*)")


@dataclass
class WarmLog:
    """What the plugin logged of one warm-up (epoch seconds, from its log's local times)."""

    queued_at: float | None = None  # the look that found the version
    writing_at: float | None = None  # its spans chosen, the entry's write begun
    warm_at: float | None = None
    write_s: float | None = None  # the writer's own seconds (restores' pauses included)
    mib: float | None = None
    pauses: int | None = None  # chunks that waited for a restore
    first_pause_s: float | None = None  # into the write, when a restore (or its prefetch) first held the disk
    paused_s: float | None = None
    refused: str = ""

    @property
    def done(self) -> bool:
        return self.warm_at is not None or bool(self.refused)


def log_time(date: str, ms: str) -> float:
    return time.mktime(time.strptime(date, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def parse_warm_log(text: str, label: str) -> WarmLog:
    """The first warm-up of ``label`` (namespace/name) in ``text``, the plugin's log from some
    point on (nri_plugin.prewarm's lines)."""
    out = WarmLog()
    for m in LINE.finditer(text):
        t, msg = log_time(m["date"], m["ms"]), m["msg"]
        if out.queued_at is None and msg.startswith(f"{label} ") and msg.endswith("queued for this node's cache"):
            out.queued_at = t
        elif out.writing_at is None and msg.startswith(f"writing {label} "):
            out.writing_at = t
        elif (w := WARM.match(msg)) and w["label"] == label:
            out.warm_at, out.write_s, out.mib, out.pauses = t, float(w["s"]), float(w["mib"]), int(w["pauses"])
            if w["first"] is not None:
                out.first_pause_s, out.paused_s = float(w["first"]), float(w["paused"])
            break
        elif (r := REFUSED.match(msg)) and r["label"] == label:
            out.refused = r["why"]
            break
    return out


# /proc/vmstat counters that tell a restore slowed by the kernel (compaction for huge pages, reclaim)
VMSTAT = ("compact_stall", "compact_fail", "thp_file_alloc", "thp_file_fallback", "thp_fault_fallback",
          "pgmajfault", "allocstall_normal", "allocstall_movable", "pgscan_direct")


def vmstat(text: str, keys: Sequence[str] = VMSTAT) -> dict[str, int]:
    """The ``keys`` of /proc/vmstat's text (name value per line)."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[0] in keys}


def cpu_busy(stat_text: str) -> int:
    """The node's busy jiffies (every CPU, all but idle and iowait) from /proc/stat's text."""
    fields = [int(x) for x in stat_text.splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def proc_cpu(stat_text: str) -> int:
    """A process's utime + stime in jiffies (its threads' included) from /proc/PID/stat's text."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 3) if start is not None and end is not None else None


def overlap(a: tuple[float | None, float | None], b: tuple[float | None, float | None]) -> float | None:
    """Seconds two (start, end) windows share; None when either is open."""
    if None in a or None in b:
        return None
    return round(max(0.0, min(a[1], b[1]) - max(a[0], b[0])), 3)  # type: ignore[type-var, operator]


def met(value: float | None, target: float) -> str:
    return "-" if value is None else ("yes" if value <= target else "NO")


@dataclass
class ReadOnce:
    """The version's files read once, in a page-cache state."""

    page_cache: str  # dropped | read in | not dropped: <why>
    bytes: int  # their sizes
    stored_bytes: int  # what they take (a bulk file's holes take nothing)
    seconds: dict[str, float] = field(default_factory=dict)  # per shape

    @property
    def best_s(self) -> float | None:
        return min(self.seconds.values()) if self.seconds else None


@dataclass
class WarmUp:
    """One warm-up of the marked version on this node."""

    kind: str  # fresh | disk | page-cache | during
    published_at: float  # the name's link's mtime
    complete_at: float | None = None  # its entry's entry.json's mtime
    log: WarmLog = field(default_factory=WarmLog)
    read: ReadOnce | None = None
    error: str = ""

    def figures(self, read_s: float | None) -> dict[str, float | None]:
        """Its times, and over ``read_s`` (one read in its page-cache state)."""
        whole = span(self.published_at, self.complete_at)
        seen = span(self.log.queued_at, self.complete_at)
        return {"publish_to_warm_s": whole, "seen_to_warm_s": seen,
                "look_delay_s": span(self.published_at, self.log.queued_at), "write_s": self.log.write_s,
                "x_read": ratio(whole, read_s), "seen_x_read": ratio(seen, read_s)}

    def record(self) -> dict[str, Any]:
        """Itself as the result document keeps it, its figures and its read's included."""
        rec = asdict(self)
        rec["read_s"] = self.read.best_s if self.read else None
        rec["read_page_cache"] = self.read.page_cache if self.read else "-"
        rec["figures"] = self.figures(rec["read_s"])
        return rec


def with_read(rec: dict[str, Any], read_s: float | None, page_cache: str) -> dict[str, Any]:
    """A warm-up's record with its figures over another read (the fresh one's: the page cache's)."""
    w = WarmUp(rec["kind"], rec["published_at"], rec["complete_at"], WarmLog(**rec["log"]))
    return {**rec, "read_s": read_s, "read_page_cache": page_cache, "figures": w.figures(read_s)}


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with its value from the document (the fresh warm-up's record
    set against the page-cache read on the way: shown, not a target, its page cache being what
    the checkpoint and the source's stop left)."""
    warm = {w["kind"]: i for i, w in enumerate(doc["warm_ups"])}
    ups = doc["warm_ups"]
    if "fresh" in warm and "page-cache" in warm:
        ups[warm["fresh"]] = with_read(ups[warm["fresh"]], ups[warm["page-cache"]]["read_s"], "read in (page-cache's)")
    out = [{"what": f"warm-up ({kind}) over one read", "value": ups[warm[kind]]["figures"]["x_read"],
            "target": TARGETS["warm_up"]} for kind in ("disk", "page-cache") if kind in warm]
    out += [{"what": f"restore during a warm-up over alone ({i})", "value": p.get("ratio"),
             "target": TARGETS["restore_during"]} for i, p in enumerate(doc["pairs"])]
    if "ratio" in doc["mapped"]:
        out.append({"what": "first restore, pre-warmed, over the mapped path", "value": doc["mapped"]["ratio"],
                    "target": TARGETS["first_mapped"]})
    return out


# --- tables (pure) -------------------------------------------------------------------------------

def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def grid(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *rows))


def warm_table(warm_ups: Sequence[dict[str, Any]]) -> str:
    rows = []
    for w in warm_ups:
        f, lg = w.get("figures", {}), w.get("log", {})
        state = w.get("error") or lg.get("refused") or "warm"
        rows.append([w["kind"], w.get("read_page_cache", "-"), _num(w.get("read_s")), _num(f.get("publish_to_warm_s")),
                     _num(f.get("seen_to_warm_s")), _num(f.get("look_delay_s")), _num(f.get("write_s")),
                     _num(lg.get("mib"), "{:.0f}"), _num(lg.get("pauses"), "{}"), _num(f.get("x_read"), "{:.3f}"),
                     _num(f.get("seen_x_read"), "{:.3f}"), met(f.get("x_read"), TARGETS["warm_up"]), state[:60]])
    return grid(("warm-up", "read's page cache", "one read s", "publish->warm s", "seen->warm s", "look delay s",
                 "write s", "MiB", "pauses", "x read", "seen x read", "<=1.10x", "state"), rows)


def restore_row(name: str, r: dict[str, Any]) -> list[str]:
    route = r.get("route") or {}
    cache = r.get("node_cache") or {}
    return [name, r.get("page_cache", "-"), _num(r.get("restore_s")), _num(r.get("first_answer_s")),
            f"{route.get('path', '-')}/{route.get('kind', '-')}", str(cache.get("state", "-")),
            _num(cache.get("mapped_bytes", 0) / 2**20 if cache else None, "{:.0f}"),
            _num(cache.get("store_bytes_read", 0) / 2**20 if cache else None, "{:.0f}"),
            str(r.get("identical", "-")), str(r.get("failure") or r.get("error") or "")[:60]]


RESTORE_HEAD = ("restore", "page cache", "restore s", "first answer s", "route", "cache", "mapped MiB",
                "store read MiB", "identical", "failure")


def phase_table(pairs: Sequence[dict[str, Any]]) -> str:
    """Each restore phase's seconds, alone and during a warm-up, pair by pair: where the time went."""
    runs = [(f"{k}-{i}", p.get(k, {}).get("phases") or {}) for i, p in enumerate(pairs) for k in ("alone", "during")]
    names = [k for k in dict.fromkeys(k for _n, ph in runs for k in ph) if k not in ("source_cold_start", "total")]
    rows = [[k, *(_num(ph.get(k), "{:.3f}") for _n, ph in runs)] for k in [*names, "total"]]
    return grid(("phase s", *(n for n, _ph in runs)), rows)


def pair_line(i: int, p: dict[str, Any]) -> str:
    """A pair's ratios, whether the warm-up still ran when the restore took the disk, and the
    plugin's CPU seconds in each restore (to its first answer)."""
    pauses = p.get("warm_up_pauses")
    how = ("-" if pauses is None else f"it paused {pauses} time(s) for the restore" if pauses
           else "it was done before the restore took the disk")
    if p.get("warm_up_yielded_after_s") is not None:
        how += (f", first {p['warm_up_yielded_after_s']:.2f}s after the pod's create, "
                f"{_num(p.get('warm_up_paused_s'))}s paused")
    cpu = [(p.get(k, {}).get("counters") or {}).get("plugin_cpu_ms") for k in ("alone", "during")]
    return (f"pair {i}: restore x{_num(p.get('ratio'), '{:.3f}')}, first answer x{_num(p.get('answer_ratio'), '{:.3f}')};"
            f" the warm-up: {how}, x{_num(p.get('warm_up_over_disk'), '{:.3f}')} the undisturbed one from disk;"
            f" plugin CPU s {' / '.join(_num(c / 1000 if c is not None else None) for c in cpu)}")


def targets_table(doc: dict[str, Any]) -> str:
    rows = [[t["what"], _num(t.get("value"), "{:.3f}"), f"<= {t['target']:.2f}", met(t.get("value"), t["target"])]
            for t in doc.get("targets", [])]
    return grid(("target", "value", "want", "met"), rows)


def tables(doc: dict[str, Any]) -> str:
    """The whole run: its warm-ups, its restores and their ratios, the targets."""
    out = [f"\n{doc['case']}: pre-warm interval {doc['interval_s']:g} s, store on {doc.get('store_fs')}, "
           f"artifact {_num(doc.get('artifact_bytes', {}).get('artifact', 0) / GIB)} GiB",
           "\n1. warm-up against one read of the artifact:", warm_table(doc["warm_ups"])]
    rows = []
    for i, p in enumerate(doc["pairs"]):
        rows += [restore_row(f"alone-{i}", p.get("alone", {})), restore_row(f"during-{i}", p.get("during", {}))]
    out += ["\n2. a restore during a warm-up against alone:", grid(RESTORE_HEAD, rows), phase_table(doc["pairs"])]
    out += [pair_line(i, p) for i, p in enumerate(doc["pairs"])]
    m = doc["mapped"]
    rows = [restore_row(k, m[k]) for k in ("prewarmed-first", "prewarmed-second", "makes-entry", "entry-from-restore")
            if k in m]
    out += ["\n3. the first restore of a pre-warmed version against the mapped path:", grid(RESTORE_HEAD, rows),
            f"first/entry-from-restore x{_num(m.get('ratio'), '{:.3f}')} (first answer "
            f"x{_num(m.get('answer_ratio'), '{:.3f}')}), first/second x{_num(m.get('first_over_second'), '{:.3f}')}",
            "\ntargets:", targets_table(doc)]
    if doc["skipped"] or doc["failures"]:
        out.append(f"skipped: {[s['step'] for s in doc['skipped']]}; failures: "
                   f"{[(f['step'], f['error'][-160:]) for f in doc['failures']]}")
    return "\n".join(out)


# --- the store's name and the node cache ---------------------------------------------------------

class Name:
    """An artifact's name in the store: its link taken away, and put back as a publish does it."""

    def __init__(self, store: Path, name: str) -> None:
        self.dir, self.name = store / NAMESPACE, name
        self.target = ""

    @property
    def link(self) -> Path:
        return self.dir / self.name

    @property
    def version(self) -> Path:
        """The version dir the name points to (or pointed to, while it is away)."""
        return self.dir / (self.target or os.readlink(self.link))

    def published_at(self) -> float:
        return os.lstat(self.link).st_mtime

    def hide(self) -> None:
        if self.link.is_symlink():
            self.target = os.readlink(self.link)
            os.unlink(self.link)
        elif not self.target:
            raise FileNotFoundError(f"no link at {self.link}")

    def ensure(self) -> None:
        """The link back where a failed step left it taken away."""
        if self.target and not self.link.is_symlink():
            self.publish()

    def publish(self) -> float:
        """A new symlink to the same version renamed over the name (``ArtifactStore``'s switch); its mtime."""
        tmp = self.dir / f"{LINK_PREFIX}{self.name}-{secrets.token_hex(8)}"
        os.symlink(self.target, tmp)
        os.rename(tmp, self.link)
        return self.published_at()


def entry_of(plugin: Any, label: str) -> Path | None:
    """The node cache's complete entry of ``label`` (namespace/name), if any."""
    for d in cache_entries(plugin):
        with contextlib.suppress(OSError, ValueError):
            if json.loads((d / ENTRY).read_text()).get("label") == label:
                return d
    return None


def writing(plugin: Any) -> bool:
    return any(cache_dir(plugin).glob(f"{TMP}*"))


def looked_at(plugin: Any) -> float:
    """When the plugin's pre-warmer last recorded its state (each look does), 0 before any."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return float(json.loads((Path(plugin.state_dir) / STATE_FILE).read_text())["updated"])
    return 0.0


def remove_entries(plugin: Any, label: str | None = None) -> list[str]:
    """Remove the complete entries (of ``label`` only, if given); their names."""
    gone = []
    for d in cache_entries(plugin):
        with contextlib.suppress(OSError, ValueError):
            if label is None or json.loads((d / ENTRY).read_text()).get("label") == label:
                shutil.rmtree(d)
                gone.append(d.name)
    return gone


def try_drop() -> str:
    """The page cache dropped: "dropped", or why not."""
    try:
        drop_caches()
        return "dropped"
    except OSError as e:
        return f"not dropped: {e}"


def wait_until(what: str, done: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(POLL_S)
    return got


# --- the bench ---------------------------------------------------------------------------------

class Prewarm(RestoreRig):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args, {
            "what": "bench/prewarming.py through containerd 1.7 + runc + CRIU + CNI + the plugin",
            "host": results.host(), "case": args.case, "interval_s": args.interval,
            "restore_path": args.restore_path, "sources": {}, "warm_ups": [], "pairs": [], "mapped": {},
            "skipped": [], "failures": []})
        self.marked, self.other = f"{args.case}-pw", f"{args.case}-other"
        self.t0 = time.monotonic()
        self.longest = 0.0
        self.plugin: Any = None
        self.cri: Any = None
        self.wl = Workload(args.case, args)
        self.refs: dict[str, Any] = {}  # each artifact's source's answer
        self.name: Name | None = None  # the marked one's, once published
        self.held = contextlib.ExitStack()  # a reader of the marked version: no store sweep removes it
        self.cache_bytes = 0  # the node cache's bound once the artifacts are known (0: the plugin's)

    # --- helpers ---

    def env(self, interval: float) -> dict[str, str]:
        return plugin_env(interval, self.args.restore_path, map_all=self.wl.cpu, cache_bytes=self.cache_bytes)

    def files(self, name: str) -> list[Path]:
        """The version's files (the marked one's also while its name is away)."""
        top = self.name.version if self.name is not None and name == self.marked else \
            phases.artifact_dir(self.plugin.store, NAMESPACE, name)
        return [p for p in top.rglob("*") if p.is_file()]

    def read_in(self, name: str) -> None:
        phases.read_gbps(self.files(name), 16, limit=1 << 62)

    def step(self, name: str, fn: Callable[[], None]) -> None:
        """Run one step unless the deadline is too near; record a failure and go on."""
        left = self.args.deadline_s - (time.monotonic() - self.t0)
        if left < 1.5 * self.longest:
            self.doc["skipped"].append({"step": name, "left_s": round(left, 1)})
            print(f"step {name}: skipped, {left:.0f} s left", flush=True)
            return
        t = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one step's failure is recorded, the others still run
            log.exception("step %s", name)
            self.doc["failures"].append({"step": name, "error": str(e)[-2000:]})
            if self.name is not None:
                self.name.ensure()
        finally:
            self.longest = max(self.longest, time.monotonic() - t)
            self.save()

    def restart(self, hide: bool, label: str | None = None, interval: float | None = None) -> None:
        """The plugin restarted, its node cache's entries (``label``'s, or all) removed while it
        is stopped, the marked name taken from the store (``hide``): a fresh plugin whose looks
        have not seen the marked version. Back once it looked at the store."""
        with contextlib.suppress(TimeoutError):  # a writer mid-entry would hold its exit up
            wait_until("the cache writer to be idle", lambda: not writing(self.plugin), self.args.warm_timeout)
        self.plugin.stop()
        if hide and self.name is not None:
            self.name.hide()
        remove_entries(self.plugin, label)
        interval = self.args.interval if interval is None else interval
        began = time.time()
        restart_plugin(self.plugin, self.env(interval))
        if interval:
            wait_until("the plugin's first look", lambda: looked_at(self.plugin) > began, 30 + 3 * interval)

    def counters(self) -> dict[str, int]:
        """The kernel's counters of interest, and the CPU milliseconds of the node and the plugin."""
        out = vmstat(Path("/proc/vmstat").read_text())
        ms = 1000 // os.sysconf("SC_CLK_TCK")
        out["node_busy_ms"] = cpu_busy(Path("/proc/stat").read_text()) * ms
        with contextlib.suppress(OSError, AttributeError):
            out["plugin_cpu_ms"] = proc_cpu(Path(f"/proc/{self.plugin.proc.pid}/stat").read_text()) * ms
        return out

    def read_once(self, name: str, disk: bool) -> ReadOnce:
        files = self.files(name)
        size = sum(p.stat().st_size for p in files)
        rec = ReadOnce("read in", size, sum(p.stat().st_blocks * 512 for p in files))
        for shape, threads, chunk in SHAPES:
            if disk:
                rec.page_cache = try_drop()
            else:
                phases.read_gbps(files, 16, limit=size)
            t = time.perf_counter()
            phases.read_gbps(files, threads, limit=size, chunk=chunk)
            rec.seconds[shape] = round(time.perf_counter() - t, 3)
        return rec

    # --- warm-ups ---

    def warm_log(self, offset: int) -> WarmLog:
        return parse_warm_log(self.plugin.log()[offset:], f"{NAMESPACE}/{self.marked}")

    def await_warm(self, kind: str, published: float, offset: int, read: ReadOnce | None) -> WarmUp:
        """The marked version's warm-up logged after ``offset``, to its end: its record."""
        w = WarmUp(kind, published, read=read)
        label = f"{NAMESPACE}/{self.marked}"
        try:
            w.log = wait_until(f"{label}'s warm-up", lambda: (lambda lg: lg if lg.done else None)(
                self.warm_log(offset)), self.args.warm_timeout)
            entry = entry_of(self.plugin, label)
            if entry is not None:
                w.complete_at = (entry / ENTRY).stat().st_mtime
            elif not w.log.refused:
                w.error = "logged warm, but no complete entry"
        except TimeoutError as e:
            w.error = str(e)
            w.log = self.warm_log(offset)
        rec = w.record()
        self.doc["warm_ups"].append(rec)
        self.save()
        print(f"\nwarm-up {kind}:\n{warm_table([rec])}", flush=True)
        return w

    def fresh(self) -> None:
        """The warm-up the marked source's publish started (the plugin running all along)."""
        assert self.name is not None
        self.await_warm("fresh", self.name.published_at(), 0, None)

    def rewarm(self, disk: bool) -> None:
        """Another node's publish of the marked version, simulated (see the module's note)."""
        assert self.name is not None
        self.restart(hide=True, label=f"{NAMESPACE}/{self.marked}")
        read = self.read_once(self.marked, disk)
        if disk:
            read.page_cache = try_drop()
        else:
            self.read_in(self.marked)
        offset = len(self.plugin.log())
        self.await_warm("disk" if disk else "page-cache", self.name.publish(), offset, read)

    # --- restores ---

    def restore(self, name: str, step: str, page_cache: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"step": step, "artifact": name, "page_cache": page_cache}
        self.wl.reference = self.refs[name]
        pod = self.cri.run_pod_sandbox(f"pw-{step}-{secrets.token_hex(3)}", annotations={"rekindle.dev/restore": name})
        self.pods.append(pod)
        before = self.counters()
        rec["started_at"] = time.time()
        t0 = time.monotonic()
        cid = self.wl.start(self.cri, pod)
        try:
            self.await_restore(self.cri, self.plugin, self.wl, pod, self.args.restore_path, t0, rec)
        except Exception as e:  # noqa: BLE001 - the pod's failure is its record
            log.exception("restore %s", step)
            rec["error"] = str(e)[-2000:]
        finally:
            rec["counters"] = delta(before, self.counters())  # to the first answer
            (self.args.out_dir / f"worker-{step}.log").write_text(gpu_pods.container_logs(self.cri, cid)[-100_000:])
            self.stop(self.cri, pod)
        if rec.get("identical") is not True:
            self.doc["failures"].append({"step": step, "error": rec.get("failure") or rec.get("error") or "differed"})
        print(grid(RESTORE_HEAD, [restore_row(step, rec)]), flush=True)
        return rec

    def other_cache(self) -> str:
        """The page cache dropped (the marked artifact's warm-up reads the disk), and with
        ``--pair-cache read-in`` the other artifact read in again: its state, in words."""
        dropped = try_drop()
        if self.args.pair_cache == "dropped":
            return dropped
        self.read_in(self.other)
        return f"{self.other} read in"

    def pair(self, i: int) -> None:
        """The other artifact restored alone, then during the marked one's warm-up from disk; each
        in a plugin just restarted with no entry in its cache and the marked name away."""
        assert self.name is not None
        rec: dict[str, Any] = {}
        self.doc["pairs"].append(rec)
        self.restart(hide=True)
        rec["alone"] = alone = self.restore(self.other, f"alone-{i}", self.other_cache())
        self.restart(hide=True)
        page_cache = self.other_cache()
        offset = len(self.plugin.log())
        published = self.name.publish()
        wait_until("the warm-up's write to begin", lambda: (lambda lg: lg.writing_at or lg.done)(
            self.warm_log(offset)), self.args.warm_timeout)
        rec["during"] = during = self.restore(self.other, f"during-{i}", f"{page_cache} before the warm-up")
        w = self.await_warm("during", published, offset, None)
        restored_at = during["started_at"] + during["restore_s"] if "restore_s" in during else None
        rec["overlap_s"] = overlap((during["started_at"], restored_at), (w.log.writing_at, w.complete_at))
        rec["warm_up_pauses"] = w.log.pauses  # 0: it was done before the restore took the disk
        if w.log.first_pause_s is not None and w.log.writing_at is not None:
            # from the restore's pod created to the warm-up's first wait (its prefetch or restore holds the disk)
            rec["warm_up_yielded_after_s"] = round(w.log.writing_at + w.log.first_pause_s - during["started_at"], 3)
            rec["warm_up_paused_s"] = w.log.paused_s
        rec["ratio"] = ratio(during.get("restore_s"), alone.get("restore_s"))
        rec["answer_ratio"] = ratio(during.get("first_answer_s"), alone.get("first_answer_s"))
        disk = next((d for d in self.doc["warm_ups"] if d["kind"] == "disk"), None)
        if disk is not None:  # the interrupted warm-up against the undisturbed one (both from disk)
            rec["warm_up_over_disk"] = ratio(span(published, w.complete_at), disk["figures"]["publish_to_warm_s"])

    def mapped(self) -> None:
        """The first restore of the pre-warmed version, a second one, and (pre-warming off) the
        normal mapped path: an entry made by an earlier restore."""
        assert self.name is not None
        label, m = f"{NAMESPACE}/{self.marked}", self.doc["mapped"]
        if entry_of(self.plugin, label) is None:  # the last pair's entry: no pair ran, or it failed
            self.rewarm(disk=False)
        for step in ("prewarmed-first", "prewarmed-second"):
            self.read_in(self.marked)
            m[step] = self.restore(self.marked, step, "read in")
            self.save()
        self.restart(hide=False, interval=0)
        self.read_in(self.marked)
        m["makes-entry"] = self.restore(self.marked, "makes-entry", "read in")
        wait_until(f"{label}'s entry from a restore", lambda: entry_of(self.plugin, label) is not None
                   and not writing(self.plugin), self.args.warm_timeout)
        self.read_in(self.marked)
        m["entry-from-restore"] = self.restore(self.marked, "entry-from-restore", "read in")
        first, made = m["prewarmed-first"], m["entry-from-restore"]
        m["ratio"] = ratio(first.get("restore_s"), made.get("restore_s"))
        m["answer_ratio"] = ratio(first.get("first_answer_s"), made.get("first_answer_s"))
        m["first_over_second"] = ratio(first.get("restore_s"), m["prewarmed-second"].get("restore_s"))

    # --- the run ---

    def sources(self) -> None:
        """The other artifact's source, then the marked one's (pre-warming on: its publish is
        the ``fresh`` warm-up); each one's answer kept for its restores."""
        for name, notes in ((self.other, {}), (self.marked, {"rekindle.dev/prewarm": "true"})):
            self.doc["sources"][name] = self.source(self.cri, self.plugin, self.wl, name, notes)
            self.refs[name] = self.wl.reference
            self.save()
        self.name = Name(self.plugin.store, self.marked)
        key = load_key(Path(self.plugin.state_dir) / "hmac.key")
        self.held.enter_context(ArtifactStore(str(self.plugin.store)).open(
            NAMESPACE, self.marked, key, version=os.readlink(self.name.link)))
        self.doc["artifact_bytes"] = size = phases.phase_bytes(self.name.version)
        # Room for both artifacts' entries: the one warming and the one a restore makes meanwhile
        # (a quarter of the node's memory, the default, may hold one 7B model's and not two).
        self.doc["cache_bytes"] = self.cache_bytes = int(CACHE_ENTRIES * size["artifact"])

    def measure(self) -> None:
        """The steps, the targets' first: a deadline skips the page-cache warm-up first."""
        self.sources()
        self.step("fresh", self.fresh)
        self.step("disk", lambda: self.rewarm(disk=True))
        for i in range(self.args.pairs):
            self.step(f"pair-{i}", functools.partial(self.pair, i))
        self.step("mapped", self.mapped)
        self.step("page-cache", lambda: self.rewarm(disk=False))

    def run(self) -> int:
        args, doc = self.args, self.doc
        if not self.describe(self.wl):
            return 1
        # two artifacts in the store; the node cache is a tmpfs
        need = int((self.wl.gib or 15) * GIB * 1.15 * 2) + 4 * GIB
        work = args.work or pick_image_root(["/var/tmp", "/dev/shm"], need) / "rekindle-prewarm"
        doc["store_dir"] = str(work)
        lock = hold_e2e_lock()  # the default sandbox: never beside an e2e session
        try:
            sb = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
            started = not sb.is_running()
            sb.up()
            self.cri = sb.cri(timeout=120.0)
            shutil.rmtree(work, ignore_errors=True)
            self.plugin = gpu_pods.start_plugin(sb, work / "plugin")
            try:
                doc["store_fs"] = "tmpfs" if fs_magic(str(work)) == TMPFS_MAGIC else "disk"
                restart_plugin(self.plugin, self.env(args.interval))
                doc["plugin_env"] = self.plugin.env
                self.measure()
            except Exception as e:  # noqa: BLE001 - a source failed: what was measured is kept
                log.exception("prewarm bench")
                doc["failures"].append({"step": "sources", "error": str(e)[-2000:]})
            finally:
                self.held.close()
                doc["targets"] = targets(doc)
                self.save()
                self.clean_up(self.cri, self.plugin, work)
                with contextlib.suppress(OSError):
                    shutil.rmtree(work)
                if started:
                    sb.down()
        finally:
            lock.close()
        doc["wall_s"] = round(time.monotonic() - self.t0, 1)
        self.save()
        print(tables(doc) + f"\n\nwall {doc['wall_s']} s", flush=True)
        return 1 if doc["failures"] else 0


def plugin_env(interval: float, path: str, map_all: bool, cache_bytes: int = 0) -> dict[str, str]:
    """The plugin's environment: pre-warming every ``interval`` s (0: off), the node cache on a
    huge tmpfs (the chart's default) bound to ``cache_bytes`` (0: the plugin's default), restores
    by ``path``, every large range mapped (``map_all``)."""
    return {"REKINDLE_PREWARM_INTERVAL": f"{interval:g}", "REKINDLE_CACHE_TMPFS": "1", "REKINDLE_RESTORE_PATH": path,
            **({"REKINDLE_MAP": "all"} if map_all else {}),
            **({"REKINDLE_CACHE_BYTES": str(cache_bytes)} if cache_bytes else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--pairs", type=int, default=1, help="restores alone and during a warm-up (default %(default)s)")
    ap.add_argument("--pair-cache", choices=("dropped", "read-in"), default="dropped",
                    help="step 2's restores: page cache dropped, or the restored artifact read in after")
    ap.add_argument("--interval", type=float, default=1.0, help="the plugin's --prewarm-interval (1..)")
    ap.add_argument("--restore-path", choices=("auto", "bulk", "stream"), default="auto")
    bench_main.add_rig_arguments(ap, "prewarm-out", "wait for a warm-up or an entry")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="no step begins that would end after this")
    args = ap.parse_args(argv)
    if args.pairs < 0 or args.interval < 1:
        ap.error("--pairs must be 0 or more, --interval at least 1")
    if not bench_main.prepare(args, "prewarming", "prewarm.json"):
        return 2
    return Prewarm(args).run()


if __name__ == "__main__":
    sys.exit(main())
