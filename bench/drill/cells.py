"""One cell of the fault table: a phase of a checkpoint or a restore, one fault landed in it,
then every check of what must hold afterwards.

Contract: ``checkpoint_cell`` starts a source pod, waits (polling, with a deadline) until the
phase is under way as seen from outside (a ``criu dump`` process, the tree stopped after the
dump, the ``phase <previous>:`` line of the plugin's log), lands the fault, and waits for the
checkpoint's final status; ``restore_cell`` does the same for a pod restoring the drill's base
artifact (its work dir, its private copies, a ``criu restore`` process, the restored tree
stopped for the fill). Both return a ``Cell``: the phase asked for, the phase the fault actually
landed in (the first phase that had not ended when the fault took hold), the outcome, and
``checks``: each one's name, whether it held, and what was seen. Both leave no pod behind.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.drill import observe
from bench.drill.faults import Fault, heal, inject
from bench.drill.rig import CONTAINER, PodRun, Rig, Workload, count_of, fields, http, same_start
from runtime import control, housekeeping
from runtime.status import Phase
from runtime.store import gc as store_gc

CHECKPOINT_PHASES = ("inspect", "criu_dump", "rootfs_capture", "shm_capture", "split", "publish")
# A restore's phases on each path (--restore-path): the bulk path fills the stopped tree, the
# streamed one (the default) lets it run and serves its memory (stream_start, then the serve).
RESTORE_PHASES = {"bulk": ("open", "inspect", "stage", "rootfs_apply", "criu_restore", "fill"),
                  "stream": ("open", "inspect", "stage", "rootfs_apply", "criu_restore", "stream_start", "stream")}
# Rows of the restore table: open and inspect are one row (together they take milliseconds), and
# so are the serve's start and the serve.
SERVE = "stream_start/stream"
RESTORE_ROWS = ("open/inspect", "stage", "rootfs_apply", "criu_restore", "fill", SERVE)


def restore_rows(path: str) -> tuple[str, ...]:
    """The rows a restore on ``path`` has (``fill`` on the bulk path, the serve on the streamed one)."""
    return tuple(r for r in RESTORE_ROWS if r != ("fill" if path == "stream" else SERVE))
SETTLE_TIMEOUT = 240.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Cell:
    flow: str  # checkpoint | restore
    phase: str
    fault: str
    landed: str = ""
    outcome: str = ""
    reason: str = ""
    seconds: float = 0.0
    injected: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(c.ok for c in self.checks)

    def check(self, name: str, ok: object, detail: object = "") -> bool:
        self.checks.append(Check(name, bool(ok), str(detail)))
        return bool(ok)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def landed(order: tuple[str, ...], ended: list[str]) -> str:
    for ph in order:
        if ph not in ended:
            return ph
    return f"after {order[-1]}"


def slug(phase: str) -> str:
    return phase.replace("_", "-").replace("/", "-")


# ---------------------------------------------------------------------- triggers
Trigger = Callable[[Rig, PodRun, str], bool]


def _ended(rig: Rig, phase: str) -> bool:
    return phase in rig.tail.phases()


def _tree_stopped_after_dump(rig: Rig, run: PodRun, marker: str) -> bool:
    return bool(observe.stopped(run.pidns)) and not observe.criu_op("dump", marker) and \
        all(p.state == "T" for p in observe.stopped(run.pidns))


CHECKPOINT_TRIGGERS: dict[str, Trigger] = {
    "inspect": lambda rig, run, marker: "; checkpointing to " in rig.tail.text(),
    "criu_dump": lambda rig, run, marker: observe.criu_op("dump", marker),
    "rootfs_capture": lambda rig, run, marker: _ended(rig, "criu_dump") or _tree_stopped_after_dump(rig, run, marker),
    "shm_capture": lambda rig, run, marker: _ended(rig, "rootfs_capture"),
    "split": lambda rig, run, marker: _ended(rig, "shm_capture"),
    "publish": lambda rig, run, marker: _ended(rig, "split"),
}


def _work_dirs(rig: Rig, marker: str) -> list[Any]:
    return [p for p in (rig.plugin.state_dir / "logs").glob("restore-*") if marker in f"/{p.name}-"]


def _staging_files(rig: Rig, marker: str) -> bool:
    return any((d / "private").is_dir() and any((d / "private").iterdir()) for d in _work_dirs(rig, marker))


RESTORE_TRIGGERS: dict[str, Trigger] = {
    "open/inspect": lambda rig, run, marker: bool(_work_dirs(rig, marker)),
    "stage": lambda rig, run, marker: _ended(rig, "inspect") or _staging_files(rig, marker),
    # Once the apply changed the rootfs: a kill before its first change would test nothing.
    "rootfs_apply": lambda rig, run, marker: _ended(rig, "stage") and rig.rootfs_changed(run),
    "criu_restore": lambda rig, run, marker: observe.criu_op("restore", marker) or _ended(rig, "rootfs_apply"),
    # Not "the tree is stopped": CRIU leaves it stopped before criu_restore ends (confinement).
    "fill": lambda rig, run, marker: _ended(rig, "criu_restore"),
    # Once the serve is under way: the tree runs from the end of stream_start on, its memory arriving.
    SERVE: lambda rig, run, marker: _ended(rig, "stream_start"),
}


# ---------------------------------------------------------------------- shared checks
def _sweep_checks(cell: Cell, rig: Rig, name: str, published: bool, namespace: str = "default") -> None:
    """No partial artifact visible (``published``: the name must be a complete signed version,
    else nothing); leftovers only where the sweep removes them; then gone."""
    listed = [x for x in rig.store.list(namespace) if x.name == name]
    if published:
        try:
            ok, version = rig.artifact_ok(name, namespace)
            cell.check("store: name is a complete signed version", ok, f"{name} -> {version}, every digest matches")
        except Exception as exc:  # noqa: BLE001 - a finding
            cell.check("store: name is a complete signed version", False, f"{name}: {exc}")
    else:
        cell.check("store: nothing under the name", not listed,
                   f"{name}: absent" if not listed else f"{name}: {[(x.version, x.problem) for x in listed]}")
    # Leaks are counted before this drill sweeps anything: what the plugin left (its own sweep at
    # start and its housekeeping included) is what a node would keep.
    before = store_gc.leftovers(rig.store, namespace)
    cell.check("store: no leftover (before any sweep by the drill)", not before,
               [f"{x.kind}:{x.entry}" for x in before] or "none")
    stale = observe.restore_work_dirs(rig.plugin.state_dir) + observe.checkpoint_stagings(rig.plugin.state_dir)
    cell.check("node: no private copies or dumps left (before any sweep by the drill)", not stale,
               [p.name for p in stale] or "none")
    # Then clean up for the next cell (the checks above already counted what was there).
    store_gc.sweep(rig.store, namespace, grace=0.0)
    housekeeping.sweep_restore_copies(rig.plugin.state_dir / "logs")


def _layer_checks(cell: Cell, rig: Rig, run: PodRun, who: str, source_token: str, restored: bool) -> None:
    """The pod's rootfs is whole: every file of the drill's layer from one start, the source's
    when restored, its own when cold; no restore journal left in it."""
    tokens, journal = rig.layer(run)
    want = "the source's" if restored else "its own"
    whole = len(tokens) == 1 and sum(tokens.values()) == rig.layer_files
    mine = bool(source_token) and (source_token in tokens) == restored
    cell.check(f"{who}: rootfs whole, {want} layer", whole and mine,
               f"{ {t[:8]: n for t, n in tokens.items()} } (source {source_token[:8] or '?'}), want {rig.layer_files} files")
    cell.check(f"{who}: no restore journal in the rootfs", not journal, journal or "none")


def _process_checks(cell: Cell, run: PodRun, marker: str, who: str) -> None:
    procs = observe.scan()
    servers = observe.servers(run.pidns, procs=procs)
    cell.check(f"{who}: exactly one server process", len(servers) == 1, f"{len(servers)}: {[p.pid for p in servers]}")
    stopped = observe.stopped(run.pidns, procs)
    cell.check(f"{who}: no process stopped", not stopped, [f"{p.pid}:{p.comm}:{p.state}" for p in stopped] or "none")
    criu = observe.criu(marker, procs)
    cell.check("node: no CRIU process", not criu, [p.pid for p in criu] or "none")


def _gone_checks(cell: Cell, rig: Rig, runs: list[PodRun], mounts_before: Counter[str]) -> None:
    for run in runs:
        rig.stop_pod(run.pod)
    left = observe.wait_until(lambda: not any(observe.in_pidns(r.pidns) for r in runs), 20.0, 0.1)
    rest = [f"{p.pid}:{p.comm}" for r in runs for p in observe.in_pidns(r.pidns)]
    cell.check("node: nothing left in the pods' pid namespaces once removed", left, rest or "none")
    new = observe.wait_until(lambda: not (observe.mount_table() - mounts_before), 10.0, 0.1)
    extra = sorted((observe.mount_table() - mounts_before).elements())
    cell.check("node: no stale mount", new, "host mounts as before the cell" if new else f"NEW: {extra}")


# ---------------------------------------------------------------------- promises
# What the design promises for each cell (docs/design.md, "The plugin process"): a containerd
# restart never stops the plugin's work; a full disk fails a checkpoint (it must write) and
# starts a restore cold where the restore still had to write; a plugin killed mid-restore
# makes the restarted plugin declare it a cold start, and a killed checkpoint is resumed.
def promised_checkpoint(fault: Fault) -> set[Phase]:
    return {Fault.CONTAINERD: {Phase.PUBLISHED}, Fault.DISK_FULL: {Phase.CHECKPOINT_FAILED},
            Fault.KILL: {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}}[fault]


def promised_restore(fault: Fault, row: str) -> set[Phase]:
    # the fill and the serve write nothing to the store or the node's work disk
    if fault is Fault.CONTAINERD or (fault is Fault.DISK_FULL and row in ("fill", SERVE)):
        return {Phase.RESTORED}
    if fault is Fault.KILL:
        return {Phase.COLD_START}
    return {Phase.RESTORED, Phase.COLD_START}


def _promise_check(cell: Cell, promised: set[Phase], got: Phase | None) -> None:
    cell.check("outcome: as the design promises for this cell", got in promised,
               f"{got.value if got else 'no status'}; promised {sorted(p.value for p in promised)}")


def _landed_check(cell: Cell, aimed: str) -> None:
    phases = aimed.split("/")  # a restore row may name two phases
    cell.check("fault: landed in its phase", cell.landed in phases, f"aimed at {aimed}, landed in {cell.landed}")


# ---------------------------------------------------------------------- checkpoint
def checkpoint_cell(rig: Rig, wl: Workload, phase: str, fault: Fault) -> Cell:
    cell = Cell("checkpoint", phase, fault.value)
    t0 = time.monotonic()
    name = f"c-{slug(phase)}-{fault.value}"
    marker = f"/staging-default-{name}-"  # the checkpoint's private staging: CRIU's images dir
    mounts_before = observe.mount_table()
    rig.tail.mark()
    # Inspect writes nothing and lasts milliseconds: a full store can only be there before it.
    early = (phase, fault) == ("inspect", Fault.DISK_FULL)
    inj = inject(fault, rig, marker) if early else None
    src = rig.start_pod(f"drill-{name}", wl, {"rekindle.dev/checkpoint": name})
    runs = [src]
    try:
        if inj is None:
            if not observe.wait_until(lambda: CHECKPOINT_TRIGGERS[phase](rig, src, marker), 180.0):
                cell.error = f"the phase was never seen under way; plugin log:\n{rig.tail.text()[-2000:]}"
                return cell
            inj = inject(fault, rig, marker, src.pidns)
        cell.injected = {"after_s": round(inj.seconds, 3), **inj.seen}
        cell.landed = landed(CHECKPOINT_PHASES, rig.tail.phases(inj.at))
        st = rig.wait_status(src, {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, SETTLE_TIMEOUT)
        if fault is Fault.DISK_FULL and st is not None and st.phase is Phase.CHECKPOINT_FAILED:
            # The store fills up while the fill and the checkpoint both write: the fault took
            # hold in the phase that failed (a phase logs its end line on failure too).
            cell.landed = (rig.tail.phases() or ["inspect"])[-1]
        heal(fault, rig)
        outcomes: dict[Phase | None, str] = {Phase.PUBLISHED: "published", Phase.CHECKPOINT_FAILED: "checkpoint failed"}
        cell.outcome = outcomes.get(st.phase if st else None, f"stuck ({st.phase.value if st else 'no status'})")
        cell.reason = st.reason if st else ""
        if fault is Fault.KILL and "resuming checkpoint watch" in rig.tail.text():
            cell.outcome += ", re-run after the restart"
        cell.check("outcome: published or failed, recorded", st is not None and st.phase in
                   (Phase.PUBLISHED, Phase.CHECKPOINT_FAILED), cell.outcome)
        _promise_check(cell, promised_checkpoint(fault), st.phase if st else None)
        _landed_check(cell, phase)
        ref = _source_checks(cell, rig, src, marker)
        _sweep_checks(cell, rig, name, published=st is not None and st.phase is Phase.PUBLISHED)
        if st is not None and st.phase is Phase.PUBLISHED:
            runs.append(_restore_probe(cell, rig, wl, name, ref))
            rig.artifact_bytes = max(rig.artifact_bytes, rig.store_bytes())
            rig.store.delete("default", name)  # room on the small store for the next cell
        _gone_checks(cell, rig, runs, mounts_before)
    except Exception as exc:  # noqa: BLE001 - the cell records it; the drill goes on
        cell.error = f"{type(exc).__name__}: {exc}"
    finally:
        _end_cell(cell, rig, fault, runs, t0)
    return cell


def _end_cell(cell: Cell, rig: Rig, fault: Fault, runs: list[PodRun], t0: float) -> None:
    """Whatever happened in the cell: undo the fault, stop its pods, time it."""
    heal(fault, rig)
    for run in runs:
        rig.stop_pod(run.pod)
    if fault is Fault.DISK_FULL:
        for d in rig.disks:
            d.fit(None)
    cell.seconds = round(time.monotonic() - t0, 1)


def _source_checks(cell: Cell, rig: Rig, src: PodRun, marker: str) -> dict[str, str]:
    """The source serves on; returns its answer's fields (what a restore of it must show)."""
    ip = rig.ip(src)
    ref: dict[str, str] = {}
    try:
        first = http(ip)
        a, b = count_of(first), count_of(http(ip))
        verify = http(ip, "/verify", 10.0).strip()
        ref = fields(first)
        tokens, _journal = rig.layer(src)
        ref["token"] = next(iter(tokens), "") if len(tokens) == 1 else ""
        cell.check("source: keeps serving", b == a + 1 and "verify=ok" in verify, f"count {a} -> {b}, {verify}")
    except OSError as exc:
        cell.check("source: keeps serving", False, f"no answer: {exc}")
    _process_checks(cell, src, marker, "source")
    return ref


def _restore_probe(cell: Cell, rig: Rig, wl: Workload, name: str, ref: dict[str, str]) -> PodRun:
    """The published artifact restores into a new pod, which answers as the source's process
    (its pid and the state file it wrote at start) with its memory intact."""
    dst = rig.start_pod(f"drill-{name}-dst", wl, {"rekindle.dev/restore": name})
    st = rig.wait_status(dst, {Phase.RESTORED, Phase.COLD_START}, SETTLE_TIMEOUT)
    body = rig.wait_serving(dst) or ""
    try:
        verify = http(rig.ip(dst), "/verify", 10.0).strip()
    except OSError as exc:
        verify = f"no answer: {exc}"
    restored = st is not None and st.phase is Phase.RESTORED
    cell.check("artifact: restores and serves on", restored and same_start(body, ref) and "verify=ok" in verify,
               f"{st.phase.value if st else None} {st.reason if st and st.reason else ''}; {body.strip()}; {verify}")
    _layer_checks(cell, rig, dst, "restored pod", ref.get("token", ""), restored)
    _process_checks(cell, dst, f"/restore-default-{name}-{dst.cid[:12]}-", "restored pod")
    return dst


# ---------------------------------------------------------------------- restore
def restore_cell(rig: Rig, wl: Workload, base: str, ref: dict[str, str], row: str, fault: Fault) -> Cell:
    """``ref``: the fields of the base artifact's source (a restored pod answers with them)."""
    cell = Cell("restore", row, fault.value)
    t0 = time.monotonic()
    mounts_before = observe.mount_table()
    rig.tail.mark()
    # Open and inspect write almost nothing and last milliseconds: a full disk can only be there before.
    early = fault is Fault.DISK_FULL and row == "open/inspect"
    early_inj = inject(fault, rig, "") if early else None
    dst = rig.start_pod(f"drill-r-{slug(row)}-{fault.value}", wl, {"rekindle.dev/restore": base})
    runs = [dst]
    marker = f"/restore-default-{base}-{dst.cid[:12]}-"
    who = f"default/{dst.name}:{CONTAINER}"
    try:
        if early_inj is not None:
            inj = early_inj
        elif not observe.wait_until(lambda: RESTORE_TRIGGERS[row](rig, dst, marker), 120.0):
            cell.error = f"the phase was never seen under way; plugin log:\n{rig.tail.text()[-2000:]}"
            return cell
        else:
            inj = inject(fault, rig, marker, dst.pidns)
        cell.injected = {"after_s": round(inj.seconds, 3), **inj.seen}
        cell.landed = landed(RESTORE_PHASES[rig.restore_path], rig.tail.phases(inj.at))
        st = rig.wait_status(dst, {Phase.RESTORED, Phase.COLD_START}, SETTLE_TIMEOUT)
        # A restore job still running in a live plugin ends with one of these lines; wait for it,
        # so that nothing it does afterwards can escape the checks.
        def text_after() -> str:
            return rig.tail.text()[inj.at - rig.tail.start:]
        job_runs = fault is not Fault.KILL or f"{who}: starting restore after plugin restart" in text_after()
        if job_runs:
            ended = observe.wait_until(lambda: f"{who}: restored from {base}" in rig.tail.text()
                                       or f"{who}: restore from {base} failed" in rig.tail.text(), SETTLE_TIMEOUT, 0.05)
            cell.check("plugin: the restore job ended", ended, "its end line is in the log" if ended else "no end line")
        heal(fault, rig)
        st = rig.status.read("default", dst.name, CONTAINER) or st
        outcomes: dict[Phase | None, str] = {Phase.RESTORED: "restored", Phase.COLD_START: "cold start"}
        cell.outcome = outcomes.get(st.phase if st else None, f"stuck ({st.phase.value if st else 'no status'})")
        cell.reason = st.reason if st else ""
        body = rig.wait_serving(dst) or ""
        ctl = rig.control(dst)
        files = sorted(n for n in (control.RESTORE_COMPLETE, control.RESTORE_FAILED, control.COLD_START)
                       if (ctl / n).exists())
        restored = st is not None and st.phase is Phase.RESTORED
        cold = st is not None and st.phase is Phase.COLD_START
        cell.check("outcome: restored or cold, recorded, told to the init once",
                   (restored and files == [control.RESTORE_COMPLETE])
                   or (cold and control.COLD_START in files and control.RESTORE_COMPLETE not in files),
                   f"{cell.outcome}; control files {files}")
        try:
            verify = http(rig.ip(dst), "/verify", 10.0).strip()
        except OSError as exc:
            verify = f"no answer: {exc}"
        _promise_check(cell, promised_restore(fault, row), st.phase if st else None)
        _landed_check(cell, row)
        _layer_checks(cell, rig, dst, "pod", ref.get("token", ""), restored)
        if restored:
            cell.check("pod: serves on from the checkpoint", same_start(body, ref) and "verify=ok" in verify,
                       f"{body.strip()}; {verify}")
        else:
            cell.check("pod: serves, started cold once", body and count_of(body) == 1 and "verify=ok" in verify,
                       f"{body.strip() or 'no answer'}; {verify}")
        observe.wait_until(lambda: observe.servers(dst.pidns), 30.0, 0.05)
        _process_checks(cell, dst, marker, "pod")
        _sweep_checks(cell, rig, base, published=True)  # a restore never touches what it reads
        _gone_checks(cell, rig, runs, mounts_before)
    except Exception as exc:  # noqa: BLE001 - the cell records it; the drill goes on
        cell.error = f"{type(exc).__name__}: {exc}"
    finally:
        _end_cell(cell, rig, fault, runs, t0)
    return cell
