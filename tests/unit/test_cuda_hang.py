"""A driver call that never returns: the checkpoint ends within its deadline, the source resumed
or, when even that hangs, ended (a libcuda stand-in built here with cc, loaded by path through
the real ctypes binding)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from runtime import checkpoint
from runtime.container.containers import process_tree
from runtime.errors import CudaError, CudaStuck, CudaUnavailable
from runtime.gpu import cuda
from runtime.gpu.cuda import CudaCheckpointer, CudaTimeout, ProcessState
from tests.waiting import wait_for

T = TypeVar("T")
DEADLINE = 1.0  # seconds per driver call, in these tests
SLACK = 3.0  # what a loaded 2-core machine may add on top

FAKE_LIBCUDA = r"""
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* A driver with the checkpoint API's state machine (any pid is a CUDA process). The first call
   named by fake_reset blocks until fake_release; with after=1 every later call blocks too. */
enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2 };
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int pids[64], states[64], n;
static char hang_on[32];
static int hang_after, hung;
static volatile int released;
static char calls[16384];

void fake_reset(const char *hang, int after) {
    pthread_mutex_lock(&mu);
    n = 0; hung = 0; released = 0; calls[0] = 0; hang_after = after;
    snprintf(hang_on, sizeof hang_on, "%s", hang);
    pthread_mutex_unlock(&mu);
}
void fake_release(void) { released = 1; }
const char *fake_calls(void) { return calls; }

static int slot(int pid) {
    for (int i = 0; i < n; i++) if (pids[i] == pid) return i;
    pids[n] = pid; states[n] = RUNNING;
    return n++;
}

static int step(const char *call, int pid, int need, int to, int *state) {
    pthread_mutex_lock(&mu);
    int block = (!hung && strcmp(call, hang_on) == 0) || (hung && hang_after && !released);
    if (block) hung = 1;
    size_t used = strlen(calls);
    snprintf(calls + used, sizeof calls - used, "%s %d%s\n", call, pid, block ? " hangs" : "");
    pthread_mutex_unlock(&mu);
    if (block) {
        while (!released) usleep(1000);
        return 999;  /* the late answer: nobody waits for it */
    }
    pthread_mutex_lock(&mu);
    int i = slot(pid), rc = 0;
    if (need >= 0 && states[i] != need) rc = 401;
    else if (to >= 0) states[i] = to;
    if (state) *state = states[i];
    pthread_mutex_unlock(&mu);
    return rc;
}

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *c) { *c = 1; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDeviceGetName(char *buf, int len, int dev) { (void)dev; snprintf(buf, len, "Fake GPU"); return 0; }
int cuGetErrorName(int e, const char **s) {
    *s = e == 401 ? "CUDA_ERROR_ILLEGAL_STATE" : "CUDA_ERROR_UNKNOWN"; return 0;
}
int cuCheckpointProcessLock(int pid, void *a) { (void)a; return step("lock", pid, RUNNING, LOCKED, 0); }
int cuCheckpointProcessCheckpoint(int pid, void *a) { (void)a; return step("checkpoint", pid, LOCKED, CHECKPOINTED, 0); }
int cuCheckpointProcessRestore(int pid, void *a) { (void)a; return step("restore", pid, CHECKPOINTED, LOCKED, 0); }
int cuCheckpointProcessUnlock(int pid, void *a) { (void)a; return step("unlock", pid, LOCKED, RUNNING, 0); }
int cuCheckpointProcessGetState(int pid, int *s) { return step("state", pid, -1, -1, s); }
int cuCheckpointProcessGetRestoreThreadId(int pid, int *t) { *t = pid; return step("tid", pid, -1, -1, 0); }
"""


class Fake:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.lib = ctypes.CDLL(self.path)  # the same handle CudaCheckpointer gets: one state
        self.lib.fake_calls.restype = ctypes.c_char_p

    def reset(self, hang: str, after: bool = False) -> None:
        self.lib.fake_reset(hang.encode(), int(after))

    def release(self) -> None:
        self.lib.fake_release()

    def calls(self) -> list[str]:
        return (self.lib.fake_calls() or b"").decode().splitlines()


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"C compiler {cc!r} not found (install build-essential)")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake_libcuda.c").write_text(FAKE_LIBCUDA)
    out = d / "libcuda.so.1"
    build = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(d / "fake_libcuda.c")],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    return out


@pytest.fixture
def fake(libcuda: Path) -> Iterator[Fake]:
    f = Fake(libcuda)
    f.reset("none")
    yield f
    f.release()  # let a hung call return, so no thread stays in the stand-in


def finishes(fn: Callable[[], T], within: float) -> tuple[T | BaseException, float]:
    """Run ``fn`` on a thread: (its result or exception, seconds taken); fails if it is still
    running after ``within`` seconds (the old behaviour: a driver call waited on forever)."""
    out: list[T | BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - examined by the test
            out.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"still waiting on the driver after {within:g} s"
    return out[0], time.monotonic() - t0


def test_checkpoint_hung_in_the_driver_ends_within_its_deadline_with_the_source_resumed(fake: Fake) -> None:
    fake.reset("checkpoint")
    ck = CudaCheckpointer(fake.path, call_timeout=DEADLINE)
    result, took = finishes(lambda: ck.checkpoint_all([101, 102], lock_timeout_ms=500), 2 * DEADLINE + SLACK)
    assert isinstance(result, CudaTimeout) and result.pid == 101, result
    assert result.call == "cuCheckpointProcessCheckpoint" and "no answer within 1 s" in str(result)
    assert took < DEADLINE + SLACK
    # Undone newest first; the hung one by the state the driver gives for it.
    assert fake.calls() == ["lock 101", "lock 102", "checkpoint 101 hangs", "unlock 102", "state 101", "unlock 101"]
    assert ck.state(101) is ProcessState.RUNNING and ck.state(102) is ProcessState.RUNNING
    # The hung call's late answer goes nowhere: nothing more is asked of the driver.
    before = fake.calls()
    fake.release()
    wait_for(lambda: not any(w.thread.is_alive() for w in ck._hung), 10, "the hung call to return")
    assert fake.calls() == before
    ck.close()


def test_checkpoint_whose_undo_hangs_too_ends_the_source(fake: Fake) -> None:
    """Nothing answers after the hung call: the processes are stuck, and the checkpoint flow's
    _ends_source_on ends the source tree instead of leaving it locked for good."""
    fake.reset("checkpoint", after=True)
    root = subprocess.Popen(["/bin/sh", "-c", "sleep 600 & sleep 600 & wait"])
    try:
        wait_for(lambda: len(process_tree(root.pid)) >= 3, 10, "the root's two children")
        tree = process_tree(root.pid)
        ck = CudaCheckpointer(fake.path, call_timeout=DEADLINE)

        def flow() -> list[int]:
            with checkpoint._ends_source_on(CudaStuck, root.pid):
                return ck.checkpoint_all(tree[1:], lock_timeout_ms=500)

        result, took = finishes(flow, 3 * DEADLINE + SLACK)
        assert isinstance(result, CudaStuck), result
        assert isinstance(result.cause, CudaTimeout) and result.cause.pid == tree[1]
        assert set(result.stuck) == set(tree[1:])
        assert took < 2 * DEADLINE + SLACK
        assert fake.calls() == [f"lock {tree[1]}", f"lock {tree[2]}", f"checkpoint {tree[1]} hangs",
                                f"unlock {tree[2]} hangs"]  # the undo stops at its first hung call
        assert root.wait(10) is not None  # the source was ended
    finally:
        root.kill()
        root.wait(10)


def test_lock_that_hangs_past_its_timeout_is_not_taken_for_unlocked(fake: Fake,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver still says running, but the lock may land later: the process is stuck."""
    monkeypatch.setattr(cuda, "LOCK_GRACE", 0.4)
    fake.reset("lock")
    ck = CudaCheckpointer(fake.path, call_timeout=30)
    result, took = finishes(lambda: ck.checkpoint_all([7], lock_timeout_ms=100), 0.5 + SLACK)
    assert isinstance(result, CudaStuck) and set(result.stuck) == {7}, result
    assert isinstance(result.cause, CudaTimeout) and "no answer within 0.5 s" in str(result.cause)
    assert fake.calls() == ["lock 7 hangs", "state 7"]
    ck.close()


def test_restore_that_hangs_raises_within_its_deadline(fake: Fake) -> None:
    fake.reset("restore")
    ck = CudaCheckpointer(fake.path, call_timeout=DEADLINE)
    ck.lock([9])
    result, took = finishes(lambda: ck.restore_all([9]), DEADLINE + SLACK)
    assert isinstance(result, CudaTimeout) and result.pid == 9 and took < DEADLINE + SLACK, result


def test_calls_after_a_hang_run_on_a_fresh_worker_until_too_many_hang() -> None:
    gate = threading.Event()

    class Driver:
        def init(self) -> None: ...
        def version(self) -> int: return 13000

        def get_state(self, pid: int) -> int:
            if pid < 0:
                gate.wait(30)
            return 0

    ck = CudaCheckpointer(driver_factory=lambda: Driver(), call_timeout=1.0)  # type: ignore[arg-type, return-value]
    try:
        for i in range(cuda.MAX_HUNG):
            if i:
                assert ck.state(1) is ProcessState.RUNNING  # on a fresh worker
            with pytest.raises(CudaTimeout):
                ck.state(-1 - i)
        with pytest.raises(CudaUnavailable, match="never returned"):
            ck.state(1)
        gate.set()
        wait_for(lambda: not any(w.thread.is_alive() for w in ck._hung), 10, "the hung calls to return")
        assert ck.state(1) is ProcessState.RUNNING  # they returned: the driver is usable again
    finally:
        gate.set()
        ck.close()


def test_an_error_from_the_driver_is_not_a_timeout(fake: Fake) -> None:
    ck = CudaCheckpointer(fake.path, call_timeout=DEADLINE)
    with pytest.raises(CudaError) as ei:
        ck.restore_all([3])  # running, not checkpointed
    assert ei.value.code == 401 and not isinstance(ei.value, CudaTimeout)
    ck.close()
