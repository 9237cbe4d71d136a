"""bench/workloads/engine_worker.py without a GPU: it imports without torch, sizes the KV pool,
lays out the weights' host buffer, and routes the engine's endpoints (vLLM's meaning) to the
main thread, refusing completions while asleep."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

import pytest

from bench.workloads import engine_worker as ew

REPO = Path(__file__).resolve().parents[2]


def test_it_imports_without_torch():
    """The bench's host side imports it for its client helpers: torch only where it runs."""
    code = ("import sys; import bench.workloads.engine_worker; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_pool_fills_the_fraction_in_whole_pieces():
    gib = 1 << 30
    assert ew.pool_bytes(0.4, 140 * gib, 16 * gib) == 40 * gib
    assert ew.pool_bytes(0.4, 140 * gib, 60 * gib) == 0  # already there
    assert ew.pool_bytes(0.9, 100, 0, align=8) == 88
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            ew.pool_bytes(bad, gib, 0)


def test_host_layout_aligns_each_tensor():
    assert ew.host_layout([3, 64, 65, 1]) == [(0, 3), (64, 64), (128, 65), (256, 1)]
    assert ew.host_layout([]) == []


def test_only_sleep_level_1():
    assert ew.sleep_level("") == ew.sleep_level("level=1") == 1
    for q in ("level=2", "level=1&level=1", "level=x"):
        with pytest.raises(ValueError):
            ew.sleep_level(q)


class FakeEngine:
    def __init__(self) -> None:
        self.rec: dict[str, Any] = {"pid": 1}
        self._asleep = False
        self.threads: set[str] = set()

    @property
    def sleeping(self) -> bool:
        return self._asleep

    def generate(self) -> list[int]:
        self.threads.add(threading.current_thread().name)
        return [1, 2, 3]

    def sleep(self) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        self._asleep = True
        return {"seconds": 0.0}

    def wake_up(self) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        self._asleep = False
        return {"seconds": 0.0}

    def memory(self) -> dict[str, int]:
        return {"kv_pool": 0}


@pytest.fixture
def served():
    engine = FakeEngine()
    jobs: queue.Queue[ew.Job] = queue.Queue()
    server = ThreadingHTTPServer(("127.0.0.1", 0), ew.handler(engine, jobs))
    server.daemon_threads = False  # server_close joins the handlers: no thread outlives the test
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    stop = threading.Event()
    main = threading.Thread(target=ew.run_jobs, args=(jobs, stop), name="gpu-main")
    main.start()
    try:
        yield engine, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        serving.join()
        stop.set()
        jobs.put((lambda: None, threading.Event(), {}))  # wakes the loop, which then ends
        main.join()


def test_sleep_and_wake_up_with_vllms_meaning(served):
    engine, port = served
    assert ew.completion("127.0.0.1", port, timeout=5)["tokens"] == [1, 2, 3]
    assert ew.call("127.0.0.1", "/is_sleeping", port=port, timeout=5) == {"is_sleeping": False}
    ew.sleep("127.0.0.1", port, timeout=5)
    assert ew.call("127.0.0.1", "/is_sleeping", port=port, timeout=5) == {"is_sleeping": True}
    with pytest.raises(HTTPError) as err:
        ew.completion("127.0.0.1", port, timeout=5)
    assert err.value.code == 503
    with pytest.raises(HTTPError) as err:
        ew.call("127.0.0.1", "/sleep?level=2", "POST", port=port, timeout=5)
    assert err.value.code == 400
    ew.wake_up("127.0.0.1", port, timeout=5)
    assert ew.call("127.0.0.1", "/generate", port=port, timeout=5)["tokens"] == [1, 2, 3]
    assert engine.threads == {"gpu-main"}  # GPU work only on the one thread that runs the jobs


class _Bytes:
    """The little of a uint8 tensor staged_copy uses, over a bytearray."""

    def __init__(self, buf: bytearray, at: int = 0, n: int | None = None, pinned: bool = False) -> None:
        self.buf, self.at, self.n, self.pinned = buf, at, len(buf) - at if n is None else n, pinned

    def numel(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> _Bytes:
        start, stop, _ = s.indices(self.n)
        return _Bytes(self.buf, self.at + start, stop - start, self.pinned)

    def copy_(self, src: _Bytes, non_blocking: bool = False) -> None:
        assert src.n == self.n
        self.buf[self.at:self.at + self.n] = src.buf[src.at:src.at + src.n]

    def bytes(self) -> bytes:
        return bytes(self.buf[self.at:self.at + self.n])


class _FakeTorch:
    uint8 = "uint8"

    def __init__(self) -> None:
        self.staging: list[_Bytes] = []
        outer = self

        class Event:
            def record(self) -> None:
                pass

            def synchronize(self) -> None:
                pass

        class Cuda:
            def __init__(self) -> None:
                self.Event = Event

            def synchronize(self) -> None:
                outer.synced = True

        self.cuda = Cuda()
        self.emptied = 0

        class C:
            @staticmethod
            def _host_emptyCache() -> None:  # noqa: N802 - torch's name
                outer.emptied += 1

        self._C = C

    def empty(self, n: int, dtype: str, pin_memory: bool = False) -> _Bytes:
        t = _Bytes(bytearray(n), pinned=pin_memory)
        self.staging.append(t)
        return t


def test_staged_copy_moves_every_byte_through_two_pinned_buffers():
    torch = _FakeTorch()
    src = _Bytes(bytearray(i % 251 for i in range(1000)))
    dst = _Bytes(bytearray(1000))
    ew.staged_copy(torch, dst, src, stage=96)  # ten whole pieces and a last short one
    assert dst.bytes() == src.bytes()
    assert len(torch.staging) == 2 and all(b.pinned and b.n == 96 for b in torch.staging)
    assert torch.synced and torch.emptied == 1  # the staging buffers not kept in torch's pinned cache
    small = _Bytes(bytearray(10))
    ew.staged_copy(torch, small, _Bytes(bytearray(b"0123456789")), stage=96)
    assert small.bytes() == b"0123456789" and torch.staging[-1].n == 10  # no buffer larger than the copy
