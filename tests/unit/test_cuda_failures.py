"""What happens to a process tree whose CUDA state cannot be brought back: ended, not left hanging
(real processes, a fake driver)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from runtime import checkpoint
from runtime.container.containers import process_tree
from runtime.errors import CudaError, CudaStuck, SourceResumeFailed
from runtime.gpu import target
from runtime.gpu.cuda import ProcessState
from tests.waiting import wait_for


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone; or reaped between the open and the read
        return False


def wait_dead(pids: list[int], timeout: float = 10.0) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), timeout, f"processes {pids} to die")


@pytest.fixture
def tree() -> Iterator[list[int]]:
    """A root with two children, like a launcher and its ranks."""
    root = subprocess.Popen(["/bin/sh", "-c", "sleep 600 & sleep 600 & wait"])
    wait_for(lambda: len(process_tree(root.pid)) >= 3, 10, "the root's two children")
    pids = process_tree(root.pid)
    yield pids
    for p in pids:
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
    root.wait(10)


class FailingCuda:
    """restore_all fails; the second try (``release``) brings back the pids in ``recovers``; the
    driver then says ``states`` (running for a pid brought back)."""

    def __init__(self, exc: BaseException, recovers: tuple[int, ...] = (),
                 states: dict[int, ProcessState] | None = None) -> None:
        self.exc = exc
        self.calls: list[tuple[list[int], object]] = []
        self.recovers = recovers
        self.states = dict(states or {})
        self.released: list[int] = []

    def restore_all(self, pids: list[int], gpu_map: object = None) -> None:
        self.calls.append((pids, gpu_map))
        raise self.exc

    def release(self, pids: list[int]) -> list[int]:
        self.released += pids
        for p in pids:
            if p in self.recovers:
                self.states[p] = ProcessState.RUNNING
        return pids

    def state(self, pid: int) -> ProcessState:
        return self.states.get(pid, ProcessState.CHECKPOINTED)


def test_failed_cuda_restore_kills_the_restored_tree(tree: list[int]) -> None:
    cuda = FailingCuda(CudaError("cuCheckpointProcessUnlock", 401, "CUDA_ERROR_ILLEGAL_STATE", pid=tree[2]))
    with pytest.raises(CudaError, match="ILLEGAL_STATE"):
        target.cuda_restore(cuda, tree[1:], {"GPU-a": "GPU-b"}, tree[0], (tree[0],))
    assert cuda.calls == [(tree[1:], {"GPU-a": "GPU-b"})]
    wait_dead(tree)  # the children too, found from the root as the tree is now


def test_source_is_ended_when_a_rollback_leaves_it_stuck(tree: list[int]) -> None:
    cause = CudaError("cuCheckpointProcessCheckpoint", 999, "CUDA_ERROR_UNKNOWN", pid=tree[1])
    with pytest.raises(CudaStuck):
        with checkpoint._ends_source_on(CudaStuck, tree[0]):
            raise CudaStuck(cause, {tree[2]: "restore failed"})
    wait_dead(tree)


def test_source_runs_on_after_a_rollback_that_worked(tree: list[int]) -> None:
    with pytest.raises(CudaError):
        with checkpoint._ends_source_on(CudaStuck, tree[0]):
            raise CudaError("cuCheckpointProcessLock", 909, "CUDA_ERROR_TIMEOUT", pid=tree[1])
    time.sleep(0.2)
    assert all(alive(p) for p in tree)


def test_a_source_resume_that_fails_beside_the_split_ends_the_tree_and_is_raised_at_join(tree: list[int]) -> None:
    cuda = FailingCuda(CudaError("cuCheckpointProcessRestore", 999, "CUDA_ERROR_UNKNOWN", pid=tree[1]))
    resume = checkpoint._SourceResume(cuda, tree[1:], tree[0])  # type: ignore[arg-type]
    resume.start()
    t = checkpoint.Timings()
    with pytest.raises(SourceResumeFailed, match="UNKNOWN"):
        resume.join(t)  # the checkpoint raises here, before anything is published
    assert cuda.calls == [(tree[1:], None)] and "cuda_resume_source" in t
    assert cuda.released == tree[1:]  # tried once more before the tree was ended
    wait_dead(tree)


def test_a_failed_source_resume_that_a_second_try_brings_back_keeps_the_source(tree: list[int]) -> None:
    """The driver restores on the second try (what it says of each process decides it): the
    source runs on and nothing is raised."""
    cuda = FailingCuda(CudaError("cuCheckpointProcessRestore", 999, "CUDA_ERROR_UNKNOWN", pid=tree[1]),
                       recovers=tuple(tree[1:]))
    resume = checkpoint._SourceResume(cuda, tree[1:], tree[0])  # type: ignore[arg-type]
    resume.start()
    resume.join(checkpoint.Timings())
    assert cuda.released == tree[1:]
    time.sleep(0.2)
    assert all(alive(p) for p in tree)


def test_a_source_given_up_says_what_the_driver_and_criu_said(tree: list[int], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One process died after the dump (JAX did, of CRIU's EINTR), one stays checkpointed: the
    reason names the failed call, each process's state, and CRIU's last warnings."""
    gone, stuck = tree[1], tree[2]
    os.kill(gone, 9)
    wait_dead([gone])
    dump_log = tmp_path / "dump.log"
    dump_log.write_text("(00.1) Dumping pstree\n(14.2) Warn  (compel/arch/x86/src/lib/infect.c:419): "
                        "Will restore 845 with interrupted system call\n(14.3) Dumping finished successfully\n")
    cuda = FailingCuda(CudaError("cuCheckpointProcessRestore", 3, "CUDA_ERROR_NOT_INITIALIZED", pid=gone))
    resume = checkpoint._SourceResume(cuda, [gone, stuck], tree[0])  # type: ignore[arg-type]
    resume.criu_log = str(dump_log)
    resume.start()
    with pytest.raises(SourceResumeFailed) as err:
        resume.join(checkpoint.Timings())
    reason = str(err.value)
    assert f"cuCheckpointProcessRestore for pid {gone} failed: CUDA_ERROR_NOT_INITIALIZED" in reason, reason
    assert f"pid {gone}: gone" in reason and f"pid {stuck}: checkpointed" in reason, reason
    assert "Will restore 845 with interrupted system call" in reason and "Dumping pstree" not in reason, reason
    assert cuda.released == [stuck]  # the gone one is not asked again
    wait_dead(tree)


class SlowCuda:
    def __init__(self) -> None:
        self.done = False

    def restore_all(self, pids: list[int], gpu_map: object = None) -> None:
        time.sleep(0.3)
        self.done = True


def test_a_source_resume_runs_beside_the_caller_and_join_waits_for_it(tree: list[int]) -> None:
    cuda = SlowCuda()
    resume = checkpoint._SourceResume(cuda, tree[1:], tree[0])  # type: ignore[arg-type]
    resume.join(checkpoint.Timings())  # never started: nothing to wait on
    resume.start()
    assert not cuda.done  # the caller goes on (host files, split) meanwhile
    t = checkpoint.Timings()
    resume.join(t)
    assert cuda.done and t["cuda_resume_source"] >= 0.3
    assert all(alive(p) for p in tree)


class _NoThread:
    ident = None

    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_source_resume_with_no_thread_to_be_had_runs_at_once(tree: list[int]) -> None:
    cuda = SlowCuda()
    resume = checkpoint._SourceResume(cuda, tree[1:], tree[0])  # type: ignore[arg-type]
    resume._thread = _NoThread()  # type: ignore[assignment]
    resume.start()
    assert cuda.done  # resumed before start returned: the source is never left checkpointed
    t = checkpoint.Timings()
    resume.join(t)
    assert t["cuda_resume_source"] >= 0.3
