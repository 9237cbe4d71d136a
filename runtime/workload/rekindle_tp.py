"""Tensor-parallel ``torch.distributed`` workloads under Rekindle: take the process group down
before a checkpoint, build it again after the restore (or after the source's own checkpoint).

This file ships into workload images: copy it next to your code. It needs the Python standard
library and torch (imported when used) and nothing from Rekindle.

Why: the NVIDIA driver (580) cannot restore a process whose NCCL communicators are alive on
NCCL's default transports (P2P over cuMem or CUDA IPC, SHM on cuMem host memory): the restore
fails and the job stays stuck. Rekindle refuses such a checkpoint. With the communicators
destroyed before the checkpoint and built again afterwards, the restored job runs at full NVLink
speed.

Protocol (all ranks of a pod run in one container and share its control directory,
``$REKINDLE_CONTROL_DIR``; Dynamo's ``SNAPSHOT_CONTROL_DIR`` / ``DYN_SNAPSHOT_CONTROL_DIR`` work
too). Every rank calls :meth:`TensorParallelGroup.before_checkpoint` at the same point, with no
collective in flight:

1. barrier, wait for the device, ``destroy_process_group()`` (every group), drop the store;
2. mark itself down (``tp-down-<generation>-<rank>`` in the control dir);
3. rank 0 waits until every rank is down, then writes ``ready-for-checkpoint``: one file for
   the pod, written once no rank holds a communicator;
4. every rank waits for a new ``snapshot-complete`` or ``checkpoint-failed`` (the source, after
   the agent is done) or ``restore-complete`` (a restored copy: it wakes up in the new pod, whose
   control dir is mounted at the same path); they are written by the agent once the processes'
   GPU memory is back, so no CUDA call is made before;
5. rank 0 starts a fresh TCPStore on a free loopback port and writes the port to
   ``tp-store-<generation>``; every rank connects to it and calls ``init_process_group`` again
   with the same rank, world size and device; ``after_rebuild`` callbacks then run (recreate
   subgroups there).

It returns what ended the wait (:class:`Outcome`). Without a control dir (not run under
Rekindle) it returns ``Outcome.NOT_MANAGED`` at once and keeps the group.

Settings applied by :meth:`TensorParallelGroup.init` unless already set: ``USE_LIBUV=0`` (the
libuv TCPStore holds an io_uring instance, which CRIU cannot dump) and
``NCCL_SOCKET_IFNAME=lo`` (NCCL learns its bootstrap address once per process; a restored pod
has a new IP, loopback stays valid). The stores listen on 127.0.0.1.

Usage::

    from rekindle_tp import TensorParallelGroup

    group = TensorParallelGroup.from_env()  # RANK, WORLD_SIZE, LOCAL_RANK
    group.init()                            # process group over a loopback TCPStore
    ...                                     # load weights, warm up
    outcome = group.before_checkpoint()     # back with a working group, in the source or restored
"""

from __future__ import annotations

import enum
import gc
import inspect
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

CONTROL_ENV = ("REKINDLE_CONTROL_DIR", "SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR")
READY = "ready-for-checkpoint"
SNAPSHOT_COMPLETE = "snapshot-complete"
CHECKPOINT_FAILED = "checkpoint-failed"
RESTORE_COMPLETE = "restore-complete"
POLL = 0.05
LOOPBACK = "127.0.0.1"
DEFAULTS = {"USE_LIBUV": "0", "NCCL_SOCKET_IFNAME": "lo"}


class Outcome(enum.Enum):
    SNAPSHOT_COMPLETE = SNAPSHOT_COMPLETE  # the source: the artifact is published
    CHECKPOINT_FAILED = CHECKPOINT_FAILED  # the source: no artifact, the job goes on
    RESTORED = RESTORE_COMPLETE            # a restored copy in a new pod
    TIMEOUT = "timeout"                    # nothing came in time; the group was rebuilt anyway
    NOT_MANAGED = "not-managed"            # no control dir: nothing was done


SENTINELS = {SNAPSHOT_COMPLETE: Outcome.SNAPSHOT_COMPLETE, CHECKPOINT_FAILED: Outcome.CHECKPOINT_FAILED,
             RESTORE_COMPLETE: Outcome.RESTORED}


def control_dir_from_env() -> str | None:
    return next((os.environ[n] for n in CONTROL_ENV if os.environ.get(n)), None)


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class TensorParallelGroup:
    """One rank's view of the job's default process group, and its checkpoint protocol.

    ``dist``, ``synchronize`` and ``make_store`` default to torch's (``torch.distributed``,
    ``torch.cuda.synchronize`` when the device is a GPU, ``torch.distributed.TCPStore``); they
    are parameters so the protocol can run without GPUs.
    """

    def __init__(self, rank: int, world_size: int, device: Any = None, *, backend: str = "nccl",
                 control_dir: str | None = None, timeout: timedelta = timedelta(minutes=10),
                 dist: Any = None, synchronize: Callable[[], None] | None = None,
                 make_store: Callable[..., Any] | None = None) -> None:
        self.rank, self.world_size, self.device, self.backend = rank, world_size, device, backend
        self.control_dir = control_dir if control_dir is not None else control_dir_from_env()
        self.timeout = timeout
        self.generation = 0
        self.after_rebuild: list[Callable[[], None]] = []
        self._dist = dist
        self._synchronize = synchronize
        self._make_store = make_store
        self._store: Any = None

    @classmethod
    def from_env(cls, backend: str = "nccl", **kwargs: Any) -> TensorParallelGroup:
        """Rank, world size and device from ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = None
        if backend == "nccl" and kwargs.get("dist") is None:
            import torch  # noqa: PLC0415 - only when used

            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        return cls(rank, world, device, backend=backend, **kwargs)

    # ---- plumbing ------------------------------------------------------------------------
    @property
    def dist(self) -> Any:
        if self._dist is None:
            import torch.distributed  # noqa: PLC0415 - only when used

            self._dist = torch.distributed
        return self._dist

    def _sync_device(self) -> None:
        if self._synchronize is not None:
            self._synchronize()
        elif self.device is not None and getattr(self.device, "type", None) == "cuda":
            import torch  # noqa: PLC0415

            torch.cuda.synchronize(self.device)

    def _path(self, name: str) -> str:
        if not self.control_dir:
            raise RuntimeError("no control dir: set REKINDLE_CONTROL_DIR or pass control_dir")
        return os.path.join(self.control_dir, name)

    def _store_for(self, generation: int) -> Any:
        """Rank 0 serves a fresh store on a free loopback port and says which in a file."""
        make = self._make_store or self.dist.TCPStore
        addr = self._path(f"tp-store-{generation}")
        if self.rank == 0:
            store = make(LOOPBACK, 0, self.world_size, True, timeout=self.timeout,
                         wait_for_workers=False, use_libuv=False)
            _atomic_write(addr, f"{store.port}\n")
            return store
        port = int(self._wait_for(lambda: _read_int(addr), what=addr))
        return make(LOOPBACK, port, self.world_size, False, timeout=self.timeout, use_libuv=False)

    def _wait_for(self, probe: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        limit = self.timeout.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            got = probe()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: {what} not there after {limit:.0f}s")
            time.sleep(POLL)

    def _connect(self) -> None:
        self._store = self._store_for(self.generation)
        kwargs: dict[str, Any] = {"backend": self.backend, "store": self._store, "rank": self.rank,
                                  "world_size": self.world_size, "timeout": self.timeout}
        if self.device is not None and "device_id" in inspect.signature(self.dist.init_process_group).parameters:
            kwargs["device_id"] = self.device  # communicators now, not at the first collective
        self.dist.init_process_group(**kwargs)

    # ---- the protocol ----------------------------------------------------------------------
    def init(self) -> None:
        """Build the default process group (generation 0)."""
        for key, value in DEFAULTS.items():
            os.environ.setdefault(key, value)
        self._connect()

    def teardown(self) -> None:
        """Every rank: no collective in flight, then no communicator, no store."""
        if self.dist.is_initialized():
            self.dist.barrier()
            self._sync_device()
            self.dist.destroy_process_group()
        self._store = None
        gc.collect()  # the store's sockets and threads go with its last reference

    def before_checkpoint(self, timeout: float | None = None) -> Outcome:
        """Tear down, let the agent checkpoint, wait, rebuild. ``timeout`` (seconds, None:
        forever) bounds the wait for the agent; the group is rebuilt in every case."""
        if not self.control_dir:
            return Outcome.NOT_MANAGED
        baseline = {n: _identity(self._path(n)) for n in SENTINELS}
        gen = self.generation
        self.teardown()
        _atomic_write(self._path(f"tp-down-{gen}-{self.rank}"), f"{os.getpid()}\n")
        if self.rank == 0:
            downs = [self._path(f"tp-down-{gen}-{r}") for r in range(self.world_size)]
            self._wait_for(lambda: True if all(os.path.exists(p) for p in downs) else None,
                           what=f"every rank down (generation {gen})")
            _atomic_write(self._path(READY), f"{os.getpid()}\n")

        def new_sentinel() -> Outcome | None:
            for name, outcome in SENTINELS.items():
                now = _identity(self._path(name))
                if now is not None and now != baseline[name]:
                    return outcome
            return None

        try:
            outcome: Outcome = self._wait_for(new_sentinel, what="the agent's answer",
                                              timeout=float("inf") if timeout is None else timeout)
        except TimeoutError:
            outcome = Outcome.TIMEOUT
        self.generation = gen + 1
        self._connect()
        for hook in self.after_rebuild:
            hook()
        return outcome


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
