"""A checkpoint is one instant: memory, the writable layer and /dev/shm are taken together.

A workload appends a counter (held in its memory) to a file in its writable layer and to one in
/dev/shm, as fast as a shell can. The checkpoint captures the files while the process tree is
still stopped; so after a restore into another pod the counter goes on from exactly the last value
in both files: every number appears once, in order. Captured after the tree ran on, a file holds
numbers the memory has not reached yet, and the restored loop writes them a second time.
"""

from __future__ import annotations

import time

from tests.waiting import wait_for

BUSYBOX = "localhost/rekindle/busybox:1"
LOOP = ("i=0; while :; do i=$((i+1)); echo $i >> /counter.log; echo $i >> /dev/shm/log-counter; "
        "done")


def _numbers(sandbox, cid: str, path: str) -> list[int]:
    out = sandbox.cri.exec_sync(cid, ["/bin/cat", path], timeout=20).out
    return [int(x) for x in out.split()]


def _consecutive(values: list[int]) -> str | None:
    for prev, cur in zip(values, values[1:]):
        if cur != prev + 1:
            return f"{prev} then {cur}"
    return None


def test_files_and_memory_come_from_one_instant(sandbox, pod, plugin):
    from runtime.status import Phase, StatusBook
    book = StatusBook(plugin.state_dir)
    a = pod("src-one-instant", annotations={"rekindle.dev/checkpoint": "one-instant"})
    a_cid = sandbox.run_container(a, "loop", BUSYBOX, command=["/bin/sh", "-c", LOOP])
    wait_for(lambda: len(_numbers(sandbox, a_cid, "/counter.log")) >= 2000, 30, "the loop to count", interval=0.2)
    (plugin.control_dir(a.uid, "loop") / "ready-for-checkpoint").write_text("ready\n")
    st = book.wait("default", a.name, "loop", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 90)
    assert st is not None and st.phase is Phase.PUBLISHED, (st, plugin.log()[-3000:])

    b = pod("dst-one-instant", annotations={"rekindle.dev/restore": "one-instant"})
    b_cid = sandbox.run_container(b, "loop", BUSYBOX, command=["/bin/sh", "-c", LOOP])
    st = book.wait("default", b.name, "loop", {Phase.RESTORED, Phase.COLD_START}, 90)
    assert st is not None and st.phase is Phase.RESTORED, (st, plugin.log()[-3000:])
    time.sleep(1)  # let the restored loop write on
    for path in ("/counter.log", "/dev/shm/log-counter"):
        values = _numbers(sandbox, b_cid, path)
        assert values and values[0] == 1 and len(values) > 2000, (path, values[:3], len(values))
        assert _consecutive(values) is None, f"{path}: {_consecutive(values)} (file and memory from different instants)"
