"""A restored tree must not wedge or steer its serve: a process that forks in a storm or moves
its memory with mremap in a loop, against the real server, holder and userfaultfd (the child
of tests/unit/test_stream_server.py). Each fork's uffd is held without an answer piling up,
a child that exits is forgotten with its fds, more live children than the limit fail the serve
closed, a move re-reads nothing, and the work past the artifact's own fails the serve closed."""

from __future__ import annotations

import os
import threading

import blake3
import pytest

from runtime.pages import serve, stream, uffd
from runtime.pages.source import PIECE
from tests.unit.test_stream_server import Child, _bulk
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(uffd.probe() is not None, reason=f"no userfaultfd: {uffd.probe()}")


def _fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def storm(tmp_path):
    """A served child (a Server with a real holder process) made by ``make(length, threads, limits)``."""
    made = []

    def make(length: int, threads: int, limits: serve.Limits = serve.Limits()):
        child = Child(length)
        child.sock.settimeout(120)  # a wedged serve fails the test instead of hanging it
        f, fd, sums, data = _bulk(tmp_path, length, child.addr)
        killed: list[object] = []
        # pid namespace 0 is nobody's: a holder that fails kills nothing of this machine
        holder = stream.Holder(0, 0, None)
        server = serve.Server("test", [f], [fd], [sums], lambda: killed.append(child.proc.kill()),
                               threads=threads, holder=holder, limits=limits)
        os.close(fd)
        server.add(f.pid, child.fd)
        made.append((child, server))
        return child, server, data, killed, holder

    yield make
    for child, server in made:
        server.close()
        child.proc.kill()
        child.close()


def test_a_fork_storm_neither_wedges_the_serve_nor_keeps_the_exited_childrens_fds(storm) -> None:
    """600 forks while every piece is still owed (faults only): each child's uffd goes to the
    holder and no answer is left unread (before: the holder blocked in its answers after ~280,
    then the agent in its send, inside the event thread: the forks hung in the kernel). Once the
    parent's faults install its pieces the exited children are found gone and their uffds closed,
    here and in the holder."""
    length = 4 * PIECE
    child, server, data, killed, holder = storm(length, threads=0, limits=serve.Limits(fork_targets=10_000))
    server.start()
    ours, its = _fds(), _fds(holder.proc.pid)
    assert child.ask("forks 600") == "ok"
    wait_for(lambda: server.counters.forks == 600, 10, "the last FORK event to be handled")
    assert not killed
    assert child.ask("hash") == blake3.blake3(data).hexdigest()  # every piece's install finds them gone
    assert server.finished.wait(30)
    wait_for(lambda: len(server.targets) == 1, 10, "the exited children to be forgotten")
    wait_for(lambda: _fds() <= ours, 10, "their uffds closed here")
    wait_for(lambda: _fds(holder.proc.pid) <= its, 10, "their uffds closed in the holder")
    stats = server.wait(10)
    assert stats.forks == 600 and stats.bytes_verified == length  # one read of each piece for all


def test_more_live_fork_children_than_the_limit_fail_the_serve_closed(storm) -> None:
    length = 4 * PIECE
    child, server, _data, killed, _holder = storm(length, threads=0, limits=serve.Limits(fork_targets=16))
    server.start()
    child.ask("forks 40 keep")  # the children live on while their pages are owed
    with pytest.raises(serve.StreamError, match="forked more than 16 processes"):
        server.wait(30)
    assert killed


def test_forks_after_every_piece_is_in_cost_no_fd(storm) -> None:
    length = 2 * PIECE
    child, server, data, killed, holder = storm(length, threads=1, limits=serve.Limits(fork_targets=4))
    server.start()
    assert child.ask("hash") == blake3.blake3(data).hexdigest()
    assert server.finished.wait(30)
    ours, its = _fds(), _fds(holder.proc.pid)
    assert child.ask("forks 50 keep") == "ok"  # nothing owed there: the limit is not theirs
    wait_for(lambda: server.counters.forks == 50 and _fds() <= ours, 10, "every FORK event handled, its uffd closed")
    assert len(server.targets) == 1 and _fds(holder.proc.pid) <= its
    assert child.ask("release") == "ok"
    server.wait(10)
    assert not killed


def test_an_mremap_storm_re_reads_nothing_and_queues_nothing(storm) -> None:
    """300 round trips of the whole region after it was served: the moved pages carry their
    bytes along (before: every move pended every moved piece again, read, hashed and installed
    again, and the queue grew by every piece per move)."""
    length = 4 * PIECE
    child, server, data, killed, _holder = storm(length, threads=2)
    server.start()
    assert server.finished.wait(30)
    assert child.ask("pingpong 300") == blake3.blake3(data).hexdigest()
    assert len(server._again) <= len(server.pieces)
    stats = server.wait(10)
    assert stats.bytes_verified == length and stats.bytes_installed == length, stats
    assert not killed


def test_an_mremap_storm_while_owed_pieces_leaves_one_entry_per_piece_queued(storm) -> None:
    length = 4 * PIECE
    child, server, data, killed, _holder = storm(length, threads=0)
    server.start()
    assert child.ask("pingpong 300") == blake3.blake3(data).hexdigest()  # faults bring it in
    assert len(server._again) <= len(server.pieces)
    stats = server.wait(10)
    assert stats.bytes_verified == length, stats
    assert not killed


def test_work_past_the_artifacts_own_fails_the_serve_closed(storm) -> None:
    """The read-and-hash limit: here below one pass, so the serve fails at its first pieces."""
    length = 4 * PIECE
    child, server, _data, killed, _holder = storm(length, threads=1, limits=serve.Limits(passes=0.25, slack=0))
    server.start()
    with pytest.raises(serve.StreamError, match="read and hashed to serve"):
        server.wait(30)
    assert killed


def test_a_serve_past_its_wall_clock_bound_fails_closed(storm) -> None:
    """Installs held back (here: faults only after the bound, an install thread that never gets
    its turn) end at the bound the artifact's work sets, not at the caller's hour."""
    length = 4 * PIECE
    child, server, _data, killed, _holder = storm(length, threads=1, limits=serve.Limits(seconds=0.0, rate=1e30))
    for lock in server.locks:  # every piece is being installed by someone else...
        lock.acquire()
    later = threading.Timer(1.0, lambda: [lock.release() for lock in server.locks])  # ... until after the bound
    later.start()
    try:
        server.start()
        with pytest.raises(serve.StreamError, match="not served within 0s"):
            server.wait(3600)
        assert killed
    finally:
        later.join()
