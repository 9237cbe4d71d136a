"""CUDA process checkpoint/restore through the driver API, for a long-lived agent.

Contract:

- :class:`CudaCheckpointer` owns ONE worker thread; every libcuda call (``cuInit`` included) runs on
  it, so the agent never execs a helper per action. libcuda is loaded and ``cuInit`` called on first
  use, on that thread. A missing libcuda / checkpoint API / GPU raises
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
  answers for contextless coordinators); any error means "not a CUDA process".
"""

from __future__ import annotations

import enum
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from runtime.cuda_driver import Driver, format_uuid, nvml_driver_version, parse_uuid, proc_driver_version
from runtime.errors import CudaError, CudaStuck, CudaUnavailable, RekindleError
from runtime.gpus import Gpu

log = logging.getLogger(__name__)

T = TypeVar("T")

PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"
NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: the driver's answer for a process without CUDA


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


class GpuMapError(RekindleError):
    """Source and target GPUs cannot be paired for a restore."""

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
    """All CUDA checkpoint calls of one agent, serialised on one dedicated worker thread."""

    def __init__(self, library: str | None = None, *,
                 driver_factory: Callable[[], Driver] | None = None) -> None:
        self._factory = driver_factory or (lambda: Driver(library or default_library()))
        self._driver: Driver | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rekindle-cuda")
        self._closed = False
        self._lock = threading.Lock()

    # ---- plumbing -------------------------------------------------------------------------
    def _run(self, fn: Callable[[Driver], T]) -> T:
        with self._lock:
            if self._closed:
                raise CudaUnavailable("CudaCheckpointer is closed")
            fut = self._pool.submit(self._call, fn)
        return fut.result()

    def _call(self, fn: Callable[[Driver], T]) -> T:
        if self._driver is None:
            drv = self._factory()
            try:
                drv.init()
            except CudaError as exc:
                raise CudaUnavailable(f"cuInit failed: {exc.name} ({exc.code})") from exc
            self._driver = drv
            log.debug("libcuda ready (CUDA driver API %d)", drv.version())
        return fn(self._driver)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CudaCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- single calls -----------------------------------------------------------------------
    def lock(self, pids: Iterable[int], timeout_ms: int = 0) -> None:
        pids = list(pids)
        self._run(lambda d: _each(pids, lambda p: d.lock(p, timeout_ms)))

    def checkpoint(self, pids: Iterable[int]) -> None:
        pids = list(pids)
        self._run(lambda d: _each(pids, d.checkpoint))

    def restore(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None) -> None:
        pids, pairs = list(pids), gpu_pairs(gpu_map)
        self._run(lambda d: _each(pids, lambda p: d.restore(p, pairs)))

    def unlock(self, pids: Iterable[int]) -> None:
        pids = list(pids)
        self._run(lambda d: _each(pids, d.unlock))

    def state(self, pid: int) -> ProcessState:
        return ProcessState(self._run(lambda d: d.get_state(pid)))

    def restore_tid(self, pid: int) -> int:
        return self._run(lambda d: d.restore_tid(pid))

    def find_cuda_pids(self, pids: Iterable[int]) -> list[int]:
        """The pids (in the given order, de-duplicated) that hold a CUDA restore thread."""
        cands = list(dict.fromkeys(int(p) for p in pids))

        def probe(d: Driver) -> list[int]:
            found = []
            for pid in cands:
                if not is_thread_group_leader(pid):
                    continue
                try:
                    d.restore_tid(pid)
                except CudaError as exc:
                    log.debug("pid %d is not a CUDA process: %s", pid, exc)
                    continue
                found.append(pid)
            return found

        return self._run(probe)

    def release(self, pids: Iterable[int]) -> list[int]:
        """Bring processes left locked or checkpointed (an agent that died mid-checkpoint) back
        to running; returns the pids that needed it."""
        pids = list(pids)

        def seq(d: Driver) -> list[int]:
            released = []
            for p in pids:
                state = ProcessState(d.get_state(p))
                if state is ProcessState.CHECKPOINTED:
                    d.restore(p, [])
                    state = ProcessState.LOCKED
                if state is ProcessState.LOCKED:
                    d.unlock(p)
                    released.append(p)
            return released

        return self._run(seq)

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
        undo fails too, :class:`CudaStuck` names the processes left locked or checkpointed.
        """
        pids = list(dict.fromkeys(pids))

        def seq(d: Driver) -> list[int]:
            locked: list[int] = []
            done: list[int] = []
            try:
                for p in pids:
                    try:
                        d.lock(p, lock_timeout_ms)
                    except CudaError as exc:
                        if exc.code == NOT_INITIALIZED:
                            log.info("pid %d has no CUDA context; not checkpointed", p)
                            continue
                        raise exc.about(p) from exc
                    locked.append(p)
                for p in locked:
                    try:
                        d.checkpoint(p)
                    except CudaError as exc:
                        raise exc.about(p) from exc
                    done.append(p)
            except CudaError as exc:
                stuck = _rollback(d, locked, done)
                if stuck:
                    raise CudaStuck(exc, stuck) from exc
                raise
            except BaseException:
                _rollback(d, locked, done)
                raise
            return locked

        return self._run(seq)

    def restore_all(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None) -> None:
        """Restore every process (remapping GPUs per ``gpu_map``), then unlock every one.

        All are restored before any is unlocked, so none runs GPU work while a peer's memory is
        still on the host. The first failure is raised at once, naming the pid, and nothing more
        is unlocked: a process restored but left locked, or one whose unlock answered
        CUDA_ERROR_ILLEGAL_STATE, cannot be brought back, and the caller must end the tree.
        """
        pids, pairs = list(dict.fromkeys(pids)), gpu_pairs(gpu_map)

        def seq(d: Driver) -> None:
            for step in (lambda p: d.restore(p, pairs), d.unlock):
                for p in pids:
                    try:
                        step(p)
                    except CudaError as exc:
                        raise exc.about(p) from exc

        self._run(seq)


def _each(pids: Iterable[int], call: Callable[[int], None]) -> None:
    for p in pids:
        call(p)


def _rollback(d: Driver, locked: list[int], checkpointed: list[int]) -> dict[int, str]:
    """Undo a partial checkpoint, newest first; returns the pids it could not bring back."""
    stuck: dict[int, str] = {}
    for p in reversed(locked):
        try:
            if p in checkpointed:
                d.restore(p)
            d.unlock(p)
        except CudaError as exc:
            stuck[p] = str(exc)
            log.error("rollback of pid %d failed, it stays %s: %s", p,
                      "checkpointed" if p in checkpointed else "locked", exc)
    return stuck


def default_library() -> str | None:
    """``REKINDLE_LIBCUDA`` overrides where libcuda is loaded from (None: the loader's search)."""
    return os.environ.get("REKINDLE_LIBCUDA") or None
