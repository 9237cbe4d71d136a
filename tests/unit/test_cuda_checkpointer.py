"""CudaCheckpointer's sequencing and error handling against a fake driver (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from nri_plugin import cuda_checkpoint
from runtime.errors import CudaError, CudaStuck, CudaUnavailable
from runtime.gpu.cuda import CudaCheckpointer, ProcessState

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"


class FakeDriver:
    """Models the driver's state machine for a set of CUDA pids."""

    def __init__(self, cuda_pids: list[int], fail: dict[tuple[str, int], int] | None = None,
                 no_cuda: set[int] | None = None) -> None:
        self.states = {p: 0 for p in cuda_pids}
        self.fail = fail or {}
        self.no_cuda = no_cuda or set()  # live processes without CUDA: NOT_INITIALIZED at once
        self.calls: list[tuple[str, int]] = []
        self.thread_of: list[str] = []  # the thread of each call
        self.threads: set[str] = set()
        self.pairs: list[list[tuple[str, str]]] = []

    def _do(self, call: str, pid: int, need: int | None, to: int | None) -> None:
        self.threads.add(threading.current_thread().name)
        self.calls.append((call, pid))
        self.thread_of.append(threading.current_thread().name)
        if pid in self.no_cuda:
            raise CudaError(f"cuCheckpointProcess{call.title()}", 3, "CUDA_ERROR_NOT_INITIALIZED")
        if pid not in self.states:
            raise CudaError(f"cuCheckpointProcess{call.title()}", 1, "CUDA_ERROR_INVALID_VALUE")
        if (call, pid) in self.fail:
            raise CudaError(f"cuCheckpointProcess{call.title()}", self.fail[(call, pid)], "CUDA_ERROR_X")
        if need is not None and self.states[pid] != need:
            raise CudaError(f"cuCheckpointProcess{call.title()}", 401, "CUDA_ERROR_ILLEGAL_STATE")
        if to is not None:
            self.states[pid] = to

    def init(self) -> None:
        self.threads.add(threading.current_thread().name)

    def version(self) -> int:
        return 13000

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        self._do("lock", pid, 0, 1)

    def checkpoint(self, pid: int) -> None:
        self._do("checkpoint", pid, 1, 2)

    def restore(self, pid: int, pairs: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        self.pairs.append(list(pairs))
        self._do("restore", pid, 2, 1)

    def unlock(self, pid: int) -> None:
        self._do("unlock", pid, 1, 0)

    def get_state(self, pid: int) -> int:
        self._do("state", pid, None, None)
        return self.states[pid]

    def restore_tid(self, pid: int) -> int:
        self._do("tid", pid, None, None)
        return pid + 1

    def device_count(self) -> int:
        return 2

    def device(self, i: int) -> int:
        return i

    def device_name(self, dev: int) -> str:
        return "NVIDIA H200"

    def device_uuid(self, dev: int) -> str:
        return (U0, U1)[dev]


def make(fake: FakeDriver) -> CudaCheckpointer:
    return CudaCheckpointer(driver_factory=lambda: fake)  # type: ignore[arg-type, return-value]


def test_roundtrip_on_one_worker_thread() -> None:
    fake = FakeDriver([101, 102])
    with make(fake) as ck:
        ck.checkpoint_all([101, 102], 1000)
        assert ck.state(101) == ProcessState.CHECKPOINTED
        ck.restore_all([101, 102], {U0: U1, U1: U0})
        assert ck.state(102) == ProcessState.RUNNING
        assert [g.uuid for g in ck.gpus()] == [U0, U1]
    assert len(fake.threads) == 1 and next(iter(fake.threads)).startswith("rekindle-cuda")
    assert fake.threads != {threading.current_thread().name}
    assert [c for c, _ in fake.calls if c != "state"] == \
        ["lock", "lock", "checkpoint", "checkpoint", "restore", "restore", "unlock", "unlock"]
    assert fake.pairs[0] == [(U0, U1), (U1, U0)]


def test_checkpoint_all_rolls_back_on_failure() -> None:
    fake = FakeDriver([1, 2, 3], fail={("checkpoint", 2): 999})
    with make(fake) as ck:
        with pytest.raises(CudaError) as ei:
            ck.checkpoint_all([1, 2, 3])
        assert ei.value.code == 999
    assert fake.states == {1: 0, 2: 0, 3: 0}  # 1 restored+unlocked, 2 and 3 unlocked


def test_checkpoint_all_lock_failure_unlocks_locked() -> None:
    fake = FakeDriver([1, 2])
    with make(fake) as ck:
        with pytest.raises(CudaError):
            ck.checkpoint_all([1, 5, 2])
    assert fake.states == {1: 0, 2: 0}
    assert ("lock", 2) not in fake.calls


def test_checkpoint_all_locks_every_process_before_checkpointing_any() -> None:
    fake = FakeDriver([5, 3, 9])
    with make(fake) as ck:
        assert ck.checkpoint_all([5, 3, 9, 3]) == [5, 3, 9]
    assert fake.calls == [("lock", 5), ("lock", 3), ("lock", 9),
                          ("checkpoint", 5), ("checkpoint", 3), ("checkpoint", 9)]


def test_checkpoint_all_skips_processes_without_cuda() -> None:
    """The API process of a vLLM-shaped pod: the driver answers NOT_INITIALIZED, nothing else."""
    fake = FakeDriver([1, 2], no_cuda={7})
    with make(fake) as ck:
        assert ck.checkpoint_all([1, 7, 2]) == [1, 2]
        assert fake.states == {1: 2, 2: 2}
        ck.restore_all([1, 2])
    assert fake.states == {1: 0, 2: 0}
    assert [c for c in fake.calls if c[1] == 7] == [("lock", 7)]


def test_restore_all_restores_every_process_before_unlocking_any() -> None:
    fake = FakeDriver([4, 6])
    with make(fake) as ck:
        ck.checkpoint_all([4, 6])
        fake.calls.clear()
        ck.restore_all([4, 6])
    assert fake.calls == [("restore", 4), ("restore", 6), ("unlock", 4), ("unlock", 6)]


def test_restore_failure_names_the_process_and_unlocks_none() -> None:
    fake = FakeDriver([1, 2, 3], fail={("restore", 2): 801})
    with make(fake) as ck:
        ck.checkpoint_all([1, 2, 3])
        with pytest.raises(CudaError) as ei:
            ck.restore_all([1, 2, 3])
    assert (ei.value.pid, ei.value.code) == (2, 801) and "pid 2" in str(ei.value)
    # 1 is back on the GPU but still locked, 2 and 3 are on the host: none may run on.
    assert fake.states == {1: 1, 2: 2, 3: 2}
    assert not [c for c in fake.calls if c[0] == "unlock"]


def test_unlock_in_illegal_state_fails_the_restore() -> None:
    """After a failed restore the driver answers ILLEGAL_STATE to unlock: never a silent hang."""
    fake = FakeDriver([1, 2], fail={("unlock", 2): 401})
    with make(fake) as ck:
        ck.checkpoint_all([1, 2])
        with pytest.raises(CudaError) as ei:
            ck.restore_all([1, 2])
    assert (ei.value.pid, ei.value.code) == (2, 401)


def test_checkpoint_rollback_that_fails_names_the_stuck_processes() -> None:
    fake = FakeDriver([1, 2, 3], fail={("checkpoint", 3): 999, ("restore", 1): 801})
    with make(fake) as ck:
        with pytest.raises(CudaStuck) as ei:
            ck.checkpoint_all([1, 2, 3])
    assert ei.value.cause.pid == 3 and ei.value.cause.code == 999
    assert set(ei.value.stuck) == {1}
    assert fake.states == {1: 2, 2: 0, 3: 0}  # 2 restored + unlocked, 3 unlocked, 1 stuck


def test_find_cuda_pids_skips_errors_and_threads() -> None:
    me = os.getpid()
    # a process of our own, not a fixed number: pid 77 is a thread of another process on some hosts
    other = subprocess.Popen(["sleep", "30"])
    thread = threading.Thread(target=time.sleep, args=(0.5,))
    thread.start()
    try:
        tid = thread.native_id
        assert tid is not None and tid != me
        fake = FakeDriver([me, other.pid, tid])
        with make(fake) as ck:
            assert ck.find_cuda_pids([other.pid, 5, me, tid, other.pid]) == [other.pid, me]
    finally:
        thread.join()
        other.kill()
        other.wait()


def test_unavailable_when_init_fails() -> None:
    class NoGpu(FakeDriver):
        def init(self) -> None:
            raise CudaError("cuInit", 100, "CUDA_ERROR_NO_DEVICE")

    with make(NoGpu([])) as ck, pytest.raises(CudaUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        ck.state(1)


def test_missing_library_is_unavailable() -> None:
    with CudaCheckpointer("libcuda-does-not-exist.so.1") as ck, pytest.raises(CudaUnavailable):
        ck.state(1)


def test_cli_run_toggle_and_state() -> None:
    fake = FakeDriver([42])
    with make(fake) as ck:
        assert cuda_checkpoint.run(cuda_checkpoint.parse_args(["--get-state", "--pid", "42"]), ck) == "running"
        assert cuda_checkpoint.run(cuda_checkpoint.parse_args(["--toggle", "--pid", "42"]), ck) is None
        assert cuda_checkpoint.run(cuda_checkpoint.parse_args(["--get-state", "--pid", "42"]), ck) == "checkpointed"
        cuda_checkpoint.run(cuda_checkpoint.parse_args(["--toggle", "--pid", "42", "--device-map", f"{U0}={U0}"]), ck)
        assert fake.states[42] == 0 and fake.pairs[-1] == [(U0, U0)]
        assert cuda_checkpoint.run(cuda_checkpoint.parse_args(["--get-restore-tid", "--pid", "42"]), ck) == "43"
        with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
            cuda_checkpoint.run(cuda_checkpoint.parse_args(["--action", "lock", "--pid", "9"]), ck)


def test_release_resumes_locked_and_checkpointed_processes_and_leaves_the_rest() -> None:
    fake = FakeDriver([1, 2, 3, 4])
    fake.states.update({2: 1, 3: 2, 4: 3})  # locked, checkpointed, failed
    with make(fake) as ck:
        assert ck.release([1, 2, 3, 4]) == [2, 3]
    assert fake.states == {1: 0, 2: 0, 3: 0, 4: 3}
    assert [c for c in fake.calls if c[0] != "state"] == [("unlock", 2), ("restore", 3), ("unlock", 3)]


@pytest.mark.parametrize("argv, message", [
    (["--action", "unlock", "--pid", str(2**32 + 1)], "--pid 4294967297 is out of range"),  # ctypes: pid 1
    (["--get-state", "--pid", str(2**31)], "out of range"),                                # ctypes: negative
    (["--get-state", "--pid", "0"], "out of range"),
    (["--get-state", "--pid", "-1"], "whole number"),
    (["--get-state", "--pid", " 42"], "whole number"),
    (["--get-state", "--pid", "4_2"], "whole number"),
    (["--action", "lock", "--pid", "42", "--timeout", str(2**32)], "--timeout 4294967296 is out of range"),
    (["--action", "lock", "--pid", "42", "--timeout", "-1"], "whole number"),
])
def test_cli_refuses_numbers_the_driver_types_cannot_hold(argv: list[str], message: str) -> None:
    with pytest.raises(cuda_checkpoint.UsageError, match=message):
        cuda_checkpoint.parse_args(argv)


def test_cli_range_edges_pass_through_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_checkpoint, "pid_max", lambda: 4194304)
    cmd = cuda_checkpoint.parse_args(["--action", "lock", "--pid", "4194303", "--timeout", str(2**32 - 1)])
    assert (cmd.pid, cmd.timeout_ms) == (4194303, 2**32 - 1)
    with pytest.raises(cuda_checkpoint.UsageError, match="out of range"):
        cuda_checkpoint.parse_args(["--get-state", "--pid", "4194304"])


def test_cli_out_of_range_pid_never_reaches_the_driver(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise AssertionError("the driver was opened for an unusable pid")
    monkeypatch.setattr(cuda_checkpoint, "CudaCheckpointer", no_driver)
    assert cuda_checkpoint.main(["--action", "unlock", "--pid", str(2**32 + 1)]) == 1
    assert "out of range" in capsys.readouterr().err


class BlockingRestore(FakeDriver):
    """A restore that waits until ``want`` restores are in the driver at once (or 2 s)."""

    def __init__(self, cuda_pids: list[int], want: int) -> None:
        super().__init__(cuda_pids)
        self.inside = 0
        self.most = 0
        self.cv = threading.Condition()
        self.want = want

    def restore(self, pid: int, pairs: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        with self.cv:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.inside >= self.want, timeout=2.0)
        super().restore(pid, pairs)
        with self.cv:
            self.inside -= 1


@pytest.mark.parametrize("parallel", [1, 2])
def test_restores_of_two_pods_run_at_once_only_when_parallel(parallel: int) -> None:
    fake = BlockingRestore([101, 102], want=2)
    fake.states = {101: 2, 102: 2}  # both checkpointed (restored into new pods)
    with CudaCheckpointer(driver_factory=lambda: fake, parallel=parallel) as ck:  # type: ignore[arg-type, return-value]
        threads = [threading.Thread(target=ck.restore_all, args=([p],)) for p in (101, 102)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert fake.most == parallel
    assert fake.states == {101: 0, 102: 0}
    # every call of one sequence on one thread; with parallel 2 the two sequences on two
    names = {pid: {n for (c, p), n in zip(fake.calls, fake.thread_of) if p == pid} for pid in (101, 102)}
    assert all(len(v) == 1 for v in names.values())
    assert (names[101] != names[102]) == (parallel == 2)
