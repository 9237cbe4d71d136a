"""Long work outside the NRI handlers: wait-ready + checkpoint, and restore.

One asyncio task per container id, started from PostStartContainer (or from Synchronize after a
plugin restart) and cancelled on StopContainer/RemoveContainer. The engine calls are blocking
and run in the jobs' own thread pool (never Python's default executor, never the handlers'),
``max_parallel`` threads, and a semaphore of the same size bounds how many run at once on a
node. Ready-probes are coroutines (no thread while they wait), under the caps of
``ProbeSlots`` (per pod, per node) and a hard deadline each.

Outcomes always reach the container through its control dir, exactly once:
  checkpoint: ``snapshot-complete`` or ``checkpoint-failed`` (also when the engine declines
              with ``Skipped``: the artifact exists, or the pod runs other containers);
  restore:    ``restore-pid`` + ``restore-complete``, or ``restore-failed`` (the init then starts
              the original command — the cold start; under ``rekindle.dev/on-restore-failure: fail``
              it exits with the reason instead, and the record says ``restore-failed``). A restore
              cut short by the agent's death is failed by the next agent after ``Engine.recover``
              rolled back its rootfs changes (``rootfs-pending`` keeps the init from starting cold
              meanwhile).
A restore's outcome is ``restored`` only once the process runs: the container's init, which
adopted the restored process and exits with it, must still live ``settle`` seconds after the
tree was resumed (the CUDA restore, which runs after the resume, counts). If it dies first, the outcome is ``restore-exited`` with the exit status
containerd reports (a workload that crashes on resume, e.g. on a pod it does not expect).
and to the status record: the phase, the reason, the timings (with ``total``: the engine call),
the artifact's size, and while the engine runs its live progress (``nri_plugin.progress``).
Each task runs with the container and artifact bound to the log context, and engine calls run
in a copy of it, so the engine's log lines carry them too.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from runtime import control
from runtime.errors import RekindleError, reason_of
from runtime.pod.probe import release as release_probes
from runtime.proc import procfs
from runtime.status import ContainerStatus, Phase, Progress, StatusBook

from . import logs
from .outcomes import COLD_START, slower_than_cold
from .policy import Intent, ProbeKind, ReadyProbe, Role
from .probes import ProbeSlots
from .progress import ProgressRecorder

log = logging.getLogger(__name__)

READY_POLL = 0.2
PROBE_INTERVAL = 1.0
# Whole-probe deadline on top of the engine's own (1 s): a probe never holds its slot longer.
PROBE_DEADLINE = 2.0
# A restored process that lives this long after the restore counts as running: the init adopts
# it within 50 ms of restore-complete, and a process that trips over its new pod (another
# hostname, address or mount) does so as soon as it runs.
RESTORE_SETTLE = 1.0


@dataclass
class Work:
    intent: Intent
    control: control.ControlDir
    container_id: str
    pid: int
    namespace: str
    pod: str
    pod_uid: str
    container: str
    image: str
    netns: str
    timings: dict[str, float] = field(default_factory=dict)
    pod_id: str = ""          # the pod sandbox's id (to list the pod's other containers)
    bytes: int = 0            # the artifact's size once published or restored
    version: str = ""         # a restore's version, as its container's create checked it ("": the current one)
    # Set by Jobs for the engine call: progress(phase, bytes_done, bytes_total).
    progress: Callable[[str, int, int], None] | None = None

    @property
    def mode(self) -> str:
        return "source" if self.intent.role is Role.CHECKPOINT else "restore"

    @property
    def artifact(self) -> str:
        return self.intent.artifact

    @property
    def who(self) -> str:
        return f"{self.namespace}/{self.pod}:{self.container}"


def restore_failure_phase(intent: Intent) -> Phase:
    """What a failed restore is recorded as: a cold start, or a failure where the pod fails closed."""
    return Phase.RESTORE_FAILED if intent.fails_closed else Phase.COLD_START


class Skipped(RekindleError):
    """The engine declined the work on purpose (the reason says why); not a failure."""


class Engine(Protocol):
    def checkpoint(self, work: Work) -> dict[str, float]: ...
    def restore(self, work: Work) -> dict[str, float]: ...
    # A restore cut short by the agent's death: undo what it changed (None: nothing was pending;
    # else the problems met, none when the container is as before the restore).
    def recover(self, work: Work) -> list[str] | None: ...
    async def probe(self, netns: str, probe: ReadyProbe) -> bool: ...
    def exit_status(self, work: Work) -> int | None: ...


class Jobs:
    def __init__(self, engine: Engine, status: StatusBook, max_parallel: int = 2,
                 probes: ProbeSlots | None = None, settle: float = RESTORE_SETTLE) -> None:
        self.engine = engine
        self.settle = settle
        self.status = status
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running: set[str] = set()  # container ids whose engine call is under way
        self._resuming: set[str] = set()  # container ids whose cut-short restore is being undone
        self._slots = asyncio.Semaphore(max_parallel)
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="rekindle-engine")
        self._probes = probes or ProbeSlots()

    def start(self, work: Work) -> None:
        if work.container_id in self._tasks:
            return
        run = self._checkpoint if work.intent.role is Role.CHECKPOINT else self._restore
        self._start_task(work, run(work))

    def _start_task(self, work: Work, coro: Coroutine[object, object, None]) -> None:
        ctx = contextvars.copy_context()
        ctx.run(logs.bind, namespace=work.namespace, pod=work.pod, container=work.container,
                container_id=work.container_id, artifact=work.artifact)
        task = asyncio.get_running_loop().create_task(coro, name=f"rekindle-{work.container_id[:12]}",
                                                      context=ctx)
        self._tasks[work.container_id] = task
        task.add_done_callback(functools.partial(self._forget, work.container_id))

    def _forget(self, container_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(container_id, None)

    def resume(self, work: Work) -> None:
        """After a plugin restart: continue what can be continued, fail what was cut short.

        Synchronize also comes after containerd restarted while this process ran on: a
        container whose job is still in this process is left to that job."""
        if work.container_id in self._tasks:
            log.info("%s: its %s job runs on after the reconnect", work.who,
                     "checkpoint" if work.mode == "source" else "restore")
            return
        prev = self.status.read(work.namespace, work.pod, work.container)
        if work.intent.role is Role.CHECKPOINT:
            if prev is None or prev.phase in (Phase.WAITING_READY, Phase.CHECKPOINTING):
                log.info("%s: resuming checkpoint watch after plugin restart", work.who)
                self._call_soon(work)
            return
        outcome = any(work.control.exists(n) for n in
                      (control.RESTORE_COMPLETE, control.RESTORE_FAILED, control.COLD_START))
        if (outcome and not work.control.exists(control.ROOTFS_PENDING)) or work.container_id in self._resuming:
            return
        if outcome or (prev is not None and prev.phase is Phase.RESTORING):
            # Cut short: its rootfs changes are rolled back (in the pool: they may take long)
            # before restore-failed lets the init start cold; a completed one keeps them.
            self._resuming.add(work.container_id)
            self._loop.call_soon_threadsafe(self._start_task, work, self._fail_cut_short(work))
            return
        log.info("%s: starting restore after plugin restart", work.who)
        self._call_soon(work)

    async def _fail_cut_short(self, work: Work) -> None:
        try:
            ctx = contextvars.copy_context()
            problems = await asyncio.get_running_loop().run_in_executor(
                self._pool, ctx.run, self.engine.recover, work)
        except Exception as exc:  # noqa: BLE001 - reported to the pod like any failure
            log.error("%s: recovering the cut-short restore failed", work.who, exc_info=True)
            problems = [str(exc) or type(exc).__name__]
        finally:
            self._resuming.discard(work.container_id)
        if work.control.exists(control.RESTORE_COMPLETE):  # it had completed: its journal is dropped
            prev = self.status.read(work.namespace, work.pod, work.container)
            if prev is None or prev.phase is Phase.RESTORING:
                self._set(work, Phase.RESTORED, "restored; the agent restarted before it recorded it")
            return
        if work.control.exists(control.RESTORE_FAILED) or work.control.exists(control.COLD_START):
            return  # already failed
        reason = "the agent restarted during the restore"
        if problems:
            reason += ("; its rootfs changes could not all be rolled back, so the container will not "
                       "start cold on them: " + "; ".join(problems[:3]))
        work.control.write(control.RESTORE_FAILED, reason + "\n")
        phase = restore_failure_phase(work.intent)
        self._set(work, phase, reason)
        log.warning("%s: %s; %s", work.who, reason, phase.value)

    def _call_soon(self, work: Work) -> None:
        # Synchronize runs in a worker thread; tasks belong to the loop.
        loop = self._loop
        loop.call_soon_threadsafe(self.start, work)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def cancel(self, container_id: str, reason: str) -> None:
        """Stop waiting for a container. Engine work already running is left to finish: its
        thread cannot be interrupted, and its outcome must still be recorded (an exit-after
        checkpoint stops its own source, which is what triggers this; so does a restored
        process that dies while its restore settles)."""
        task = self._tasks.get(container_id)
        if task is None or task.done():
            return
        if container_id in self._running:
            log.info("%s on %s; letting the running checkpoint/restore finish", reason, container_id[:12])
            return
        log.info("cancelling work on %s: %s", container_id[:12], reason)
        self._tasks.pop(container_id, None)
        task.cancel()

    async def shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ flows
    async def _checkpoint(self, work: Work) -> None:
        self._set(work, Phase.WAITING_READY, "")
        t0 = time.monotonic()
        how = await self._wait_ready(work)
        work.timings["wait_ready"] = round(time.monotonic() - t0, 3)
        work.timings[COLD_START] = round(_running_for(work.pid) or work.timings["wait_ready"], 3)
        log.info("%s: ready (%s) after %.1fs; checkpointing to %s", work.who, how,
                 work.timings["wait_ready"], work.artifact, extra={"phase": "wait_ready",
                                                                   "seconds": work.timings["wait_ready"]})
        self._set(work, Phase.CHECKPOINTING, "")
        if await self._run(self.engine.checkpoint, work, Phase.CHECKPOINTING, Phase.PUBLISHED,
                           Phase.CHECKPOINT_FAILED, control.CHECKPOINT_FAILED):
            log.info("%s: published %s/%s (%s)", work.who, work.namespace, work.artifact, _fmt(work.timings),
                     extra={"phase": "published", "seconds": work.timings.get("total")})

    async def _wait_ready(self, work: Work) -> str:
        probe = work.intent.ready_probe
        try:
            while True:
                if probe.kind is ProbeKind.FILE:
                    found = work.control.ready()
                    if found:
                        return found
                elif await self._probe(work, probe):
                    return str(probe)
                await asyncio.sleep(READY_POLL if probe.kind is ProbeKind.FILE else PROBE_INTERVAL)
        finally:
            release_probes(work.netns)  # connections a cut-short wait still holds (none once ready)

    async def _probe(self, work: Work, probe: ReadyProbe) -> bool:
        async with self._probes.slot(work.pod_uid):
            try:
                async with asyncio.timeout(PROBE_DEADLINE):
                    return await self.engine.probe(work.netns, probe)
            except TimeoutError:
                return False

    async def _restore(self, work: Work) -> None:
        self._set(work, Phase.RESTORING, "")
        # On failure the init reads restore-failed and starts the original command: the cold start.
        # On success the record stays restoring until the process is seen to run.
        # Under on-restore-failure: fail the init exits with the reason instead, and never runs it.
        if not await self._run(self.engine.restore, work, Phase.RESTORING, Phase.RESTORING,
                               restore_failure_phase(work.intent), control.RESTORE_FAILED):
            return
        self._running.add(work.container_id)  # its exit (a StopContainer) must not cut the watch short
        # The settle counts from the resume: the process already ran through the CUDA restore.
        wait = max(0.0, self.settle - work.timings.get("cuda_restore", 0.0))
        try:
            died = await self._died(work, wait)
        finally:
            self._running.discard(work.container_id)
        if died is not None:
            log.warning("%s: %s", work.who, died, extra={"phase": Phase.RESTORE_EXITED.value})
            self._set(work, Phase.RESTORE_EXITED, died)
            return
        note = slower_than_cold(work.timings)
        self._set(work, Phase.RESTORED, "", note=note, route=_route_of(work.control))
        log.info("%s: restored from %s (%s)%s", work.who, work.artifact, _fmt(work.timings), f"; {note}" if note else "",
                 extra={"phase": "restored", "seconds": work.timings.get("total")})

    async def _died(self, work: Work, wait: float) -> str | None:
        """Why the restored process is not running ``wait`` seconds after the restore, or None
        if it is. Watches the container's init (a pidfd: no polling), which exits with it."""
        if work.pid <= 0 or wait <= 0:
            return None
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(work.pid)
        except ProcessLookupError:
            fd = -1
        except OSError as exc:  # no pidfd here: the process cannot be watched, take the restore
            log.warning("%s: cannot watch the restored container's init (%s)", work.who, exc)
            return None
        if fd >= 0:
            gone: asyncio.Future[None] = loop.create_future()

            def exited() -> None:
                if not gone.done():
                    gone.set_result(None)
            loop.add_reader(fd, exited)
            try:
                await asyncio.wait_for(gone, wait)
            except TimeoutError:
                return None  # it runs
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        try:
            code = await loop.run_in_executor(self._pool, contextvars.copy_context().run,
                                              self.engine.exit_status, work)
        except Exception as exc:  # noqa: BLE001 - the death is reported either way
            log.warning("%s: no exit status: %s", work.who, exc)
            code = None
        return "the restored process exited right after the restore (" + _exit_text(code) + ")"

    async def _run(self, fn: Callable[[Work], dict[str, float]], work: Work, running: Phase, ok: Phase, failed: Phase, failure_file: str) -> bool:
        """Run one engine call; record and report its outcome (the file tells the container)."""
        self._running.add(work.container_id)
        recorder = ProgressRecorder(lambda p: self._set(work, running, "", progress=p))
        work.progress = recorder
        try:
            async with self._slots:
                t0 = time.monotonic()
                ctx = contextvars.copy_context()  # the engine's log lines carry this task's fields
                timings = await asyncio.get_running_loop().run_in_executor(self._pool, ctx.run, fn, work)
        except asyncio.CancelledError:
            raise
        except Skipped as exc:
            reason = str(exc)
            log.info("%s: %s", work.who, reason, extra={"phase": Phase.SKIPPED.value})
            if not work.control.exists(control.RESTORE_COMPLETE):
                work.control.write(failure_file, f"skipped: {reason}\n")
            self._set(work, Phase.SKIPPED, reason)
            return False
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the pod
            reason = str(exc) or type(exc).__name__
            log.error("%s: %s %s failed: %s", work.who, "checkpoint" if work.mode == "source" else "restore from",
                      work.artifact, reason, exc_info=not isinstance(exc, RekindleError))
            if not work.control.exists(control.RESTORE_COMPLETE):
                work.control.write(failure_file, reason + "\n")
            self._set(work, failed, reason, cause=exc)
            return False
        finally:
            self._running.discard(work.container_id)
            work.progress = None
        work.timings.update(timings)
        work.timings["total"] = round(time.monotonic() - t0, 3)
        work.bytes = recorder.total_bytes
        self._set(work, ok, "")
        return True

    def _set(self, work: Work, phase: Phase, reason: str, progress: Progress | None = None,
             cause: BaseException | None = None, note: str = "", route: str = "") -> None:
        kind = reason_of(cause) if cause is not None else None
        self.status.record(ContainerStatus(
            namespace=work.namespace, pod=work.pod, container=work.container,
            role=work.intent.role.value, artifact=work.artifact, phase=phase, reason=reason,
            container_id=work.container_id, pod_uid=work.pod_uid, timings=dict(work.timings),
            progress=progress, bytes=work.bytes, reason_class=kind.value if kind is not None else "", note=note,
            route=route))


def _route_of(ctl: control.ControlDir) -> str:
    """The route the restore wrote into its timings (``""`` where it wrote none readable): the
    status says how the pages came back, not only how long it took."""
    try:
        doc = json.loads(ctl.read(control.TIMINGS) or "{}")
        route = doc.get("route") if isinstance(doc, dict) else None
        if not isinstance(route, dict):
            return ""
        return f"{route.get('kind', '')}: {route.get('path', '')} ({route.get('reason', '')})"
    except (OSError, ValueError):
        return ""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code > 128 and code - 128 < signal.NSIG:
        try:
            return f"exit status {code}: {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit status {code}"


def _running_for(pid: int) -> float | None:
    """Seconds since process ``pid`` started (the container's init: its start), None if unknown.
    Unlike the wait for ready, this counts from the container's start even when the agent
    restarted meanwhile."""
    ticks = procfs.start_time(pid)
    if ticks is None:
        return None
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return since if since > 0 else None


def _fmt(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in timings.items())
