"""CUDA process checkpoint/restore through the driver API, for a long-lived agent.

Contract:

- :class:`CudaCheckpointer` runs every libcuda call (``cuInit`` included) on a worker thread of
  its own, so the agent never execs a helper per action. libcuda is loaded and ``cuInit`` called
  once, on first use. Sequences (``checkpoint_all``, ``restore_all``, ``release``) are driven
  from the caller, one call at a time; with ``parallel`` 1 (the default) one sequence at a time
  on one worker; with more, up to that many sequences at once, each on its own worker (pods
  restored together: each one's CUDA restore need not wait for the others').
- Every driver call has a deadline (``call_timeout``; a lock: its own timeout plus
  :data:`LOCK_GRACE`). A call that has not returned by then raises :class:`CudaTimeout` (a
  :class:`runtime.errors.CudaError`, code 909); the worker it hangs on is given up (a daemon
  thread, whatever it returns later is dropped) and the next call runs on a fresh one. After
  :data:`MAX_HUNG` calls still hang, the checkpointer answers :class:`CudaUnavailable`. A hung
  call in ``checkpoint_all`` is undone like any failure, by what the driver says of each process
  (:meth:`CudaCheckpointer.release`'s rule); a process it cannot vouch for is named in
  :class:`CudaStuck`, which the checkpoint flow answers by ending the source. So
  ``checkpoint_all`` returns or raises within the calls that answered plus two deadlines (the
  hung call and, at worst, the first undo call that hangs too: the undo stops there). A missing
  libcuda / checkpoint API / GPU raises
  :class:`runtime.errors.CudaUnavailable`; a failing driver call raises
  :class:`runtime.errors.CudaError` ``(call, code, name)``, e.g. ``cuCheckpointProcessLock``,
  ``1``, ``CUDA_ERROR_INVALID_VALUE``.
- PIDs are host PIDs (the caller's pid namespace). States follow ``CUprocessState``:
  RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING.
- :meth:`CudaCheckpointer.checkpoint_all` locks every pid, then checkpoints every pid (a pid
  whose lock answers CUDA_ERROR_NOT_INITIALIZED has no CUDA and is skipped) and returns the pids
  checkpointed; on failure it rolls back what it did (restore what was checkpointed, unlock what
  was locked, newest first) and re-raises, or raises :class:`runtime.errors.CudaStuck` naming
  the pids the rollback could not bring back.
  :meth:`CudaCheckpointer.restore_all` restores every pid, then unlocks every pid; the first
  failure is raised naming its pid and nothing more is unlocked (the caller ends the tree: a
  process left locked, or whose unlock answered ILLEGAL_STATE, never resumes).
- GPU remapping (driver >= 580): ``gpu_map`` maps old UUID -> new UUID and must cover every GPU
  the process sees, as a bijection; :func:`build_gpu_map` makes one from two ordered UUID lists.
- :class:`Checkpointer` is the part the flows use (a Protocol: tests hand in fakes).
- :meth:`CudaCheckpointer.find_cuda_pids` probes with get-restore-tid (not get-state, which also
  answers for contextless coordinators); any error means "not a CUDA process", except a probe
  that hangs, which is raised.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol, TypeVar

from runtime.errors import CudaError, CudaStuck, CudaUnavailable, Reason, RekindleError
from runtime.gpu.driver import Driver, format_uuid, nvml_driver_version, parse_uuid, proc_driver_version
from runtime.manifest import Gpu

log = logging.getLogger(__name__)

T = TypeVar("T")

PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"
NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: the driver's answer for a process without CUDA
TIMEOUT_CODE = 909  # CUDA_ERROR_TIMEOUT, for a call the agent stopped waiting for
LOCK, CHECKPOINT, RESTORE, UNLOCK, GET_STATE = (f"cuCheckpointProcess{n}" for n in (
    "Lock", "Checkpoint", "Restore", "Unlock", "GetState"))
# One driver call's deadline. The longest calls copy a process's device memory: 25-28 s for
# 49 GiB on H200 (bench/results/h200x2/restore-speed.json), about 2 GiB/s, so ~75 s for a full
# 141 GiB GPU.
CALL_TIMEOUT = 600.0
LOCK_GRACE = 10.0  # on top of a lock's own timeout, which the driver keeps
MAX_HUNG = 4  # driver calls left hanging before the checkpointer gives up on the driver


class CudaTimeout(CudaError):
    """A driver call that did not return within its deadline (it may still be running)."""

    def __init__(self, call: str, seconds: float, pid: int | None = None) -> None:
        super().__init__(call, TIMEOUT_CODE, f"no answer within {seconds:g} s", pid)
        self.seconds = seconds

    def about(self, pid: int) -> CudaTimeout:
        return CudaTimeout(self.call, self.seconds, pid)


class _Worker:
    """One daemon thread running submitted calls in order. A daemon, so that a call hung in the
    driver never holds up the agent's exit."""

    def __init__(self, n: int) -> None:
        self.given_up = False
        self._jobs: queue.SimpleQueue[tuple[Future[object], Callable[[], object]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"rekindle-cuda-{n}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fut, fn))  # type: ignore[arg-type]
        return fut

    def stop(self) -> None:
        self._jobs.put(None)


class ProcessState(enum.IntEnum):
    """``CUprocessState``; names print lower-case as cuda-checkpoint does."""

    UNKNOWN = -1
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5

    @classmethod
    def _missing_(cls, value: object) -> ProcessState:
        return cls.UNKNOWN

    def __str__(self) -> str:
        return self.name.lower()


class Checkpointer(Protocol):
    """What the checkpoint and restore flows ask of CUDA (:class:`CudaCheckpointer`, or a fake)."""

    def gpus(self) -> list[Gpu]: ...
    def driver_version(self) -> str: ...
    def find_cuda_pids(self, pids: Iterable[int]) -> list[int]: ...
    def release(self, pids: Iterable[int]) -> list[int]: ...
    def checkpoint_all(self, pids: Iterable[int], lock_timeout_ms: int = 0) -> list[int]: ...
    def restore_all(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None) -> None: ...
    def state(self, pid: int) -> ProcessState: ...
    def restore_tid(self, pid: int) -> int: ...


class GpuMapError(RekindleError):
    """Source and target GPUs cannot be paired for a restore."""

    reason_class = Reason.INCOMPATIBLE

    def __init__(self, reason: str) -> None:
        super().__init__(f"cannot map GPUs for restore: {reason}")
        self.reason = reason


def _norm_uuid(text: str) -> str:
    try:
        return format_uuid(parse_uuid(text))
    except ValueError as exc:
        raise GpuMapError(str(exc)) from None


def build_gpu_map(source_uuids: Sequence[str], target_uuids: Sequence[str]) -> dict[str, str] | None:
    """Pair the checkpoint's GPUs with the target's, position by position.

    Returns None when nothing moves (same UUIDs in the same order); otherwise every source GPU
    mapped to the target GPU at the same position (identity entries included: the driver wants
    every GPU the process sees in the map). Raises GpuMapError on a count mismatch, a malformed
    or duplicated UUID.
    """
    src = [_norm_uuid(u) for u in source_uuids]
    dst = [_norm_uuid(u) for u in target_uuids]
    if len(src) != len(dst):
        raise GpuMapError(f"the checkpoint used {len(src)} GPU(s), the target has {len(dst)}; "
                          "a restore needs the same count")
    for label, seq in (("source", src), ("target", dst)):
        if len(set(seq)) != len(seq):
            raise GpuMapError(f"duplicate UUID among the {label} GPUs: {seq}")
    if src == dst:
        return None
    return dict(zip(src, dst, strict=True))


def gpu_pairs(gpu_map: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """Validate a UUID map (bijective, well-formed) and return its (old, new) pairs."""
    if not gpu_map:
        return []
    pairs = [(_norm_uuid(o), _norm_uuid(n)) for o, n in gpu_map.items()]
    if len({n for _, n in pairs}) != len(pairs):
        raise GpuMapError(f"two GPUs map onto the same target: {dict(pairs)}")
    return pairs


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def is_thread_group_leader(pid: int) -> bool:
    """True unless /proc says ``pid`` is a thread of another process (cuda-checkpoint issue #41)."""
    text = _read_text(f"/proc/{pid}/status")
    if text is None:
        return True
    m = re.search(r"^Tgid:\s*(\d+)", text, re.M)
    return m is None or int(m.group(1)) == pid


class CudaCheckpointer:
    """All CUDA checkpoint calls of one agent, serialised on one worker thread at a time."""

    def __init__(self, library: str | None = None, *,
                 driver_factory: Callable[[], Driver] | None = None,
                 call_timeout: float = CALL_TIMEOUT, parallel: int = 1) -> None:
        self._factory = driver_factory or (lambda: Driver(library or default_library()))
        self._driver: Driver | None = None
        self.call_timeout = call_timeout
        self._workers = 0
        self._worker = self._new_worker()  # single calls, and every sequence when parallel is 1
        self._hung: list[_Worker] = []  # given up on, their call still in the driver
        self._closed = False
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        # Sequences at once (restores of pods started together, each on its own worker; their
        # calls name other processes): 1 is one sequence at a time on the one worker.
        self.parallel = max(1, parallel)
        self._slots = threading.BoundedSemaphore(self.parallel)
        self._spare: list[_Worker] = []
        self._local = threading.local()  # .worker: the sequence's own (parallel > 1), .depth

    # ---- plumbing -------------------------------------------------------------------------
    def _new_worker(self) -> _Worker:
        self._workers += 1
        return _Worker(self._workers)

    def _run(self, fn: Callable[[Driver], T], call: str = "libcuda", timeout: float | None = None) -> T:
        """``fn`` on the worker, waited for at most ``timeout`` (``call_timeout``) seconds."""
        limit = self.call_timeout if timeout is None else timeout
        own: _Worker | None = getattr(self._local, "worker", None)
        with self._lock:
            if self._closed:
                raise CudaUnavailable("CudaCheckpointer is closed")
            self._hung = [w for w in self._hung if w.thread.is_alive()]
            if len(self._hung) >= MAX_HUNG:
                raise CudaUnavailable(f"{len(self._hung)} CUDA driver calls never returned; "
                                      "CUDA checkpointing is off until the agent restarts")
            worker = own or self._worker
            fut = worker.submit(lambda: self._call(fn, worker))
        try:
            return fut.result(limit)
        except FutureTimeout:
            with self._lock:
                if own is not None and own is worker:  # the sequence's own: it goes on on a fresh one
                    worker.given_up = True
                    worker.stop()
                    self._hung.append(worker)
                    self._local.worker = self._new_worker()
                elif self._worker is worker:  # give it up; its late answer goes nowhere
                    worker.given_up = True
                    worker.stop()
                    self._hung.append(worker)
                    self._worker = self._new_worker()
            log.error("%s did not return within %g s; the thread it runs on is given up", call, limit)
            raise CudaTimeout(call, limit) from None

    def _call(self, fn: Callable[[Driver], T], worker: _Worker) -> T:
        with self._init_lock:  # two sequences' first calls load and init it once
            if self._driver is None:
                drv = self._factory()
                try:
                    drv.init()
                except CudaError as exc:
                    raise CudaUnavailable(f"cuInit failed: {exc.name} ({exc.code})") from exc
                self._driver = drv
                log.debug("libcuda ready (CUDA driver API %d)", drv.version())
        if worker.given_up:  # what ran before on this worker hung: its caller has moved on
            raise CudaUnavailable("a call given up on before it ran")
        return fn(self._driver)

    def _on(self, pid: int, call: str, fn: Callable[[Driver, int], T], timeout: float | None = None) -> T:
        """``fn(driver, pid)``; its error names the pid. (``pid`` is bound here, not by a closure
        over a loop variable: a call given up on may still run later.)"""
        try:
            return self._run(lambda d: fn(d, pid), call, timeout)
        except CudaError as exc:
            raise exc.about(pid) from exc

    def _lock_limit(self, timeout_ms: int) -> float:
        return timeout_ms / 1000 + LOCK_GRACE if timeout_ms > 0 else self.call_timeout

    @contextlib.contextmanager
    def _sequence(self) -> Iterator[None]:
        """One sequence: with ``parallel`` > 1 on a worker of its own (at most ``parallel`` at
        once), else on the one worker, one sequence at a time. Nested: the enclosing one's."""
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = depth
            return
        self._slots.acquire()
        self._local.depth = 1
        if self.parallel > 1:
            with self._lock:
                self._local.worker = self._spare.pop() if self._spare else self._new_worker()
        try:
            yield
        finally:
            worker = getattr(self._local, "worker", None)
            self._local.worker, self._local.depth = None, 0
            if worker is not None:
                with self._lock:
                    if self._closed:
                        worker.stop()
                    elif not worker.given_up:
                        self._spare.append(worker)
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._worker.stop()
            for w in self._spare:
                w.stop()
        self._worker.thread.join(self.call_timeout)

    def __enter__(self) -> CudaCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- single calls -----------------------------------------------------------------------
    def lock(self, pids: Iterable[int], timeout_ms: int = 0) -> None:
        for p in list(pids):
            self._on(p, LOCK, lambda d, q: d.lock(q, timeout_ms), self._lock_limit(timeout_ms))

    def checkpoint(self, pids: Iterable[int]) -> None:
        for p in list(pids):
            self._on(p, CHECKPOINT, lambda d, q: d.checkpoint(q))

    def restore(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None) -> None:
        pids, pairs = list(pids), gpu_pairs(gpu_map)
        for p in pids:
            self._on(p, RESTORE, lambda d, q: d.restore(q, pairs))

    def unlock(self, pids: Iterable[int]) -> None:
        for p in list(pids):
            self._on(p, UNLOCK, lambda d, q: d.unlock(q))

    def state(self, pid: int) -> ProcessState:
        return ProcessState(self._on(pid, GET_STATE, lambda d, q: d.get_state(q)))

    def restore_tid(self, pid: int) -> int:
        return self._on(pid, "cuCheckpointProcessGetRestoreThreadId", lambda d, q: d.restore_tid(q))

    def find_cuda_pids(self, pids: Iterable[int]) -> list[int]:
        """The pids (in the given order, de-duplicated) that hold a CUDA restore thread. A probe
        that hangs raises: a CUDA process taken for one without CUDA would go to CRIU as it is."""
        found = []
        for pid in dict.fromkeys(int(p) for p in pids):
            if not is_thread_group_leader(pid):
                continue
            try:
                self.restore_tid(pid)
            except CudaTimeout:
                raise
            except CudaError as exc:
                log.debug("pid %d is not a CUDA process: %s", pid, exc)
                continue
            found.append(pid)
        return found

    def release(self, pids: Iterable[int]) -> list[int]:
        """Bring processes left locked or checkpointed (an agent that died mid-checkpoint) back
        to running; returns the pids that needed it. Other states are left as they are."""
        with self._sequence():
            return [p for p in list(pids)
                    if self._settle(p, strict=False) in (ProcessState.CHECKPOINTED, ProcessState.LOCKED)]

    def _settle(self, pid: int, *, strict: bool = True, lock_pending: bool = False) -> ProcessState:
        """Back to running by what the driver says of ``pid`` (checkpointed: restore, then
        unlock; locked: unlock); returns the state it found. ``strict``: raise for any other
        state than running, or for running while a lock of ours may still land (``lock_pending``)."""
        state = ProcessState(self._on(pid, GET_STATE, lambda d, q: d.get_state(q)))
        if state is ProcessState.CHECKPOINTED:
            self._on(pid, RESTORE, lambda d, q: d.restore(q, []))
        elif state is not ProcessState.LOCKED:
            if strict and (lock_pending or state is not ProcessState.RUNNING):
                raise CudaError(GET_STATE, 401, f"CUDA_ERROR_ILLEGAL_STATE (the process is {state})", pid)
            return state
        self._on(pid, UNLOCK, lambda d, q: d.unlock(q))
        return state

    def gpus(self) -> list[Gpu]:
        """Every GPU CUDA sees, by ordinal (the list position)."""
        def read(d: Driver) -> list[Gpu]:
            out = []
            for i in range(d.device_count()):
                dev = d.device(i)
                out.append(Gpu(d.device_uuid(dev), d.device_name(dev)))
            return out
        return self._run(read)

    def cuda_version(self) -> int:
        """The driver API version, e.g. 13000."""
        return self._run(lambda d: d.version())

    def driver_version(self) -> str:
        """The kernel driver's version string (e.g. '580.159.04'): NVML, else /proc."""
        v = nvml_driver_version()
        if v:
            return v
        text = _read_text(PROC_DRIVER_VERSION)
        v = proc_driver_version(text) if text else None
        if v:
            return v
        raise CudaUnavailable(f"no NVIDIA driver version (NVML failed, {PROC_DRIVER_VERSION} unreadable)")

    # ---- whole sequences -------------------------------------------------------------------
    def checkpoint_all(self, pids: Iterable[int], lock_timeout_ms: int = 0) -> list[int]:
        """Lock every process, then checkpoint every one; returns the pids checkpointed.

        Order: all locks before any checkpoint, so no process is moved to the host while another
        still runs GPU work that may wait on it. A process whose lock answers
        CUDA_ERROR_NOT_INITIALIZED has no CUDA context and is skipped. Any other failure undoes
        what was done (restore, unlock, newest first) and re-raises it naming the pid; when the
        undo fails too, :class:`CudaStuck` names the processes left locked or checkpointed. A
        call that hangs is such a failure: its process is undone by the state the driver gives
        for it, and after an undo call that hangs too nothing more is asked of the driver (every
        process not yet undone is stuck).
        """
        pids = list(dict.fromkeys(pids))
        with self._sequence():
            locked: list[int] = []
            done: list[int] = []
            hung: int | None = None
            try:
                for p in pids:
                    try:
                        self._on(p, LOCK, lambda d, q: d.lock(q, lock_timeout_ms), self._lock_limit(lock_timeout_ms))
                    except CudaTimeout:
                        hung = p
                        raise
                    except CudaError as exc:
                        if exc.code == NOT_INITIALIZED:
                            log.info("pid %d has no CUDA context; not checkpointed", p)
                            continue
                        raise
                    locked.append(p)
                for p in locked:
                    try:
                        self._on(p, CHECKPOINT, lambda d, q: d.checkpoint(q))
                    except CudaTimeout:
                        hung = p
                        raise
                    done.append(p)
            except CudaError as exc:
                stuck = self._undo(locked, done, hung)
                if stuck:
                    raise CudaStuck(exc, stuck) from exc
                raise
            except BaseException:
                self._undo(locked, done, hung)
                raise
            return locked

    def restore_all(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None) -> None:
        """Restore every process (remapping GPUs per ``gpu_map``), then unlock every one.

        All are restored before any is unlocked, so none runs GPU work while a peer's memory is
        still on the host. The first failure (a call past its deadline included) is raised at
        once, naming the pid, and nothing more is unlocked: a process restored but left locked,
        or one whose unlock answered CUDA_ERROR_ILLEGAL_STATE, cannot be brought back, and the
        caller must end the tree.
        """
        pids, pairs = list(dict.fromkeys(pids)), gpu_pairs(gpu_map)
        with self._sequence():
            for p in pids:
                self._on(p, RESTORE, lambda d, q: d.restore(q, pairs))
            for p in pids:
                self._on(p, UNLOCK, lambda d, q: d.unlock(q))

    def _undo(self, locked: list[int], checkpointed: list[int], hung: int | None) -> dict[int, str]:
        """Undo a partial checkpoint, newest first; returns the pids it could not bring back."""
        order = list(reversed(locked))
        if hung is not None and hung not in locked:
            order.insert(0, hung)  # its lock hung: it may be locked by now
        stuck: dict[int, str] = {}
        gave_up = ""
        for p in order:
            if gave_up:
                stuck[p] = f"not undone: {gave_up}"
                continue
            try:
                if p == hung:
                    self._settle(p, lock_pending=p not in locked)
                    continue
                if p in checkpointed:
                    self._on(p, RESTORE, lambda d, q: d.restore(q, []))
                self._on(p, UNLOCK, lambda d, q: d.unlock(q))
            except CudaError as exc:
                stuck[p] = str(exc)
                log.error("rollback of pid %d failed, it stays %s: %s", p,
                          "checkpointed" if p in checkpointed else "locked", exc)
                if isinstance(exc, CudaTimeout):
                    gave_up = str(exc)
        return stuck


def default_library() -> str | None:
    """``REKINDLE_LIBCUDA`` overrides where libcuda is loaded from (None: the loader's search)."""
    return os.environ.get("REKINDLE_LIBCUDA") or None
