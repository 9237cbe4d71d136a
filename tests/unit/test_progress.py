"""Live progress: phase changes written at once, byte counts at most every interval, the rate
since the phase started, the artifact's size from "complete"; never raises into the engine."""

from __future__ import annotations

import threading

from nri_plugin.progress import ProgressRecorder


def test_phase_changes_and_throttled_byte_counts():
    now = [0.0]
    written = []
    rec = ProgressRecorder(written.append, interval=0.5, clock=lambda: now[0], wall=lambda: 1000.0 + now[0])
    rec("stage", 0, 0)
    now[0] = 1.0
    rec("fill", 0, 0)
    now[0] = 1.1
    rec("fill", 100, 1000)      # within 0.5 s of the last write: dropped
    now[0] = 2.0
    rec("fill", 500, 1000)      # written: 500 bytes in 1 s
    now[0] = 2.1
    rec("fill", 1000, 1000)     # the last piece of the phase is always written
    rec("complete", 4096, 4096)
    assert [(p.phase, p.bytes_done, p.bytes_total) for p in written] == [
        ("stage", 0, 0), ("fill", 0, 0), ("fill", 500, 1000), ("fill", 1000, 1000)]
    assert written[2].rate == 500.0
    assert written[2].phase_started_at == 1001.0
    assert rec.total_bytes == 4096


def test_concurrent_fill_threads_and_a_failing_writer():
    calls = []

    def write(p):
        calls.append(p)
        raise OSError("disk full")
    rec = ProgressRecorder(write, interval=0.0)
    threads = [threading.Thread(target=lambda i=i: [rec("fill", i * 10 + k, 1000) for k in range(10)])
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls  # it tried, and nothing escaped into the fill threads
