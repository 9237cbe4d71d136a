"""The streamed restore: bulk pages served through userfaultfd while the restored tree runs.

The bulk path (``runtime.pages.bulk.fill``) writes every bulk page before the tree may run. Here the
tree is resumed right after CRIU, and the bulk ranges arrive while it runs. This module puts
the parts together for one restore (:class:`Session`):

- ``runtime.criu.lazy_pages``: CRIU's images made lazy for the bulk ranges
  (:func:`~runtime.criu.lazy_pages.prepare_images`), and the socket ``criu restore --lazy-pages``
  hands each task's uffd over on (:class:`~runtime.criu.lazy_pages.Listener`).
- ``runtime.pages.serve``: the server, which orders the pieces, answers faults and keeps up
  with the address-space events; its pieces come verified from ``runtime.pages.source`` and go
  into the tree through ``runtime.pages.sink`` (copied, or written into a node cache entry's
  file that the tree maps, and let go).
- Fail closed: when the last holder of a uffd closes it, the kernel unregisters the range and
  the process reads zero pages from then on. A holder process (``runtime.pages.holder``, its
  own session; :class:`Holder` here is its agent side) keeps a copy of every uffd until the
  server says it is done; if the server goes away first, the tasks block on their faults, and
  the holder kills them and tells the init to start cold.

Digests: each 1 MiB chunk of a bulk file has its BLAKE3 digest in ``bulk/pages-<pid>.sums``
(written at checkpoint, signed through the manifest: ``runtime.pages.bulk.read_sums``), as the bulk
fill uses them; the server installs 2 MiB pieces, each chunk checked before any byte of it goes
in (``runtime.pages.chunks``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from runtime.container.containers import ContainerInfo
from runtime.container.namespaces import enter_cgroups_argv
from runtime.control import ControlDir
from runtime.criu import CRIU, lazy_pages
from runtime.criu import image_files as img
from runtime.criu.lazy_pages import LazyPagesError, Listener
from runtime.digests import WORKERS
from runtime.layout import BulkFile
from runtime.pages import holder as holder_mod
from runtime.pages import uffd
from runtime.pages.book import MappedBook
from runtime.pages.serve import Server, StreamStats
from runtime.pages.serve import StreamError as StreamError  # the restore names these here
from runtime.pages.sink import Mapped as Mapped
from runtime.pages.sink import let_go_sink

log = logging.getLogger(__name__)

HOLDER_SEND_TIMEOUT = 10.0  # seconds: the holder always reads; one that does not fails the serve


# --- the holder ----------------------------------------------------------------------------------

class Holder:
    """The second holder of every uffd (``runtime.pages.holder``), in its own session and in
    the target's cgroups, so that it outlives this process and this process's container. :meth:`hold` hands it uffds; :meth:`done` lets it close them."""

    def __init__(self, pidns: int, init_pid: int, control_dir: str | None, cgroups: Sequence[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        argv = [sys.executable, "-m", "runtime.pages.holder", "--fd", str(theirs.fileno()),
                "--pidns", str(pidns), "--init-pid", str(init_pid)]
        if control_dir is not None:
            argv += ["--control", control_dir]
        if cgroups:
            # In the target's cgroups: it lives as long as the pod does, not as the agent's
            # container (a DaemonSet pod deleted mid-serve takes the agent's whole cgroup along).
            argv = enter_cgroups_argv(cgroups, argv)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), start_new_session=True,
                                         stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._lock = threading.Lock()
        self._numbered = 0  # uffds handed over so far: the holder numbers its copies alike
        # Every send is bounded: the holder answers only SYNC, read at once below, so it always
        # reads; one that stops reading fails the serve instead of stalling whoever sends.
        self.sock.settimeout(HOLDER_SEND_TIMEOUT)

    def hold(self, fds: Sequence[int], wait: bool = False) -> list[int]:
        """Hand ``fds`` over (``wait``: until the holder has them); their copy numbers.
        StreamError when the holder does not take them in time."""
        with self._lock:
            try:
                socket.send_fds(self.sock, [holder_mod.HOLD], list(fds))
                numbers = list(range(self._numbered, self._numbered + len(fds)))
                self._numbered += len(fds)
                if wait:
                    self.sock.sendall(holder_mod.SYNC)
                    if self.sock.recv(1) != holder_mod.ACK:
                        raise StreamError("the uffd holder did not take the uffds")
            except OSError as exc:
                raise StreamError(f"the uffd holder did not take the uffds: {exc}") from exc
        return numbers

    def drop(self, number: int) -> None:
        """Let the holder close its copy ``number`` (its task exited)."""
        with self._lock:
            try:
                self.sock.sendall(holder_mod.DROP + number.to_bytes(holder_mod.NUMBER_BYTES, "little"))
            except OSError as exc:
                raise StreamError(f"the uffd holder did not take a drop: {exc}") from exc

    def done(self) -> None:
        with self._lock:
            try:
                self.sock.sendall(holder_mod.DONE)
                while self.sock.recv(4096):  # its copies are closed when it closes its end
                    pass
            except OSError:
                pass
        self.close()

    def abort(self) -> None:
        """The serve failed: the holder kills what is left; the caller tells the init."""
        with self._lock:
            try:
                self.sock.sendall(holder_mod.GIVE_UP)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("uffd holder %d did not exit", self.proc.pid)


@functools.cache
def _criu_lacks(criu: str) -> str | None:
    """Why ``criu`` cannot hand uffds over with the events the server needs (None: it can);
    asked once per process (CRIU and the kernel do not change under a running agent)."""
    try:
        p = subprocess.run([criu, "check", "--feature", "uffd-noncoop"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{criu} check --feature uffd-noncoop: {exc}"
    if p.returncode != 0:
        return f"{criu} lacks non-cooperative userfaultfd: {(p.stdout + p.stderr).strip()[-200:]}"
    return None


def unsupported(criu: str = CRIU) -> str | None:
    """Why this node cannot stream a restore (None: it can): the kernel's userfaultfd with the
    FORK, REMAP, REMOVE and UNMAP events, and CRIU's ``--lazy-pages`` with them."""
    return uffd.probe() or _criu_lacks(criu)


# --- one streamed restore, as runtime.restore drives it -------------------------------------------

# Measured on 16 cores beside the driver's CUDA restore (bench/results/h200): 8 and 12 threads
# serve 5.9-6.4 GB/s, 4 serve 4.5-5.0, and 16 fewer than 8 (they take the driver's cores).
DEFAULT_THREADS = min(12, WORKERS)


def threads(asked: int | None, serve: int | None = None) -> int:
    """Install threads: ``serve`` when given (the restore's serve threads), else ``asked`` (its
    fill threads), else :data:`DEFAULT_THREADS`. 0 serves faults only (a measurement setting:
    the restore completes only once every piece was touched)."""
    if serve is not None:
        return serve
    return asked if asked else DEFAULT_THREADS


def driver_spans(images: str, cuda_pids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(pid, start, end) of the CUDA driver's host copy in CRIU's images: the VMAs the
    checkpoint marked MADV_HUGEPAGE in the CUDA processes (``runtime.pages.bulk``'s split). An order
    only: which pieces the serve installs first."""
    spans = []
    for pid in cuda_pids:
        try:
            vmas = img.read_mm(images, pid).entry.vmas
        except (OSError, ValueError):
            continue
        spans += [(pid, v.start, v.end) for v in vmas
                  if v.madv & (1 << img.MADV_HUGEPAGE) and img.is_private_anon_writable(v)]
    return spans


def prepare(files: Sequence[BulkFile], images: str) -> str | None:
    """Make CRIU's images lazy for ``files``, or say why this restore cannot stream (then
    nothing was changed: the bulk path can run)."""
    why = unsupported()
    if why is not None:
        return why
    try:
        lazy_pages.prepare_images(images, files)
    except LazyPagesError as exc:
        return str(exc)
    return None


class Session:
    """One streamed restore: :meth:`begin` before CRIU (the holder starts, the socket listens,
    faults are served as the uffds arrive), :meth:`start` after CRIU returned (the tree still
    stopped: installs begin), :meth:`wait` once it runs; :meth:`abort` (idempotent, a no-op
    once served) on any failure kills the tree."""

    def __init__(self, listener: Listener, server: Server) -> None:
        self.listener: Listener | None = listener
        self.server: Server | None = server
        self.served = False
        self.handed: threading.Event = threading.Event()
        self.error: BaseException | None = None
        self._receiver = threading.Thread(target=self._receive, name="rekindle-lazy-pages", daemon=True)
        self._receiver.start()

    @classmethod
    def begin(cls, work_dir: str, target: ContainerInfo, control: ControlDir | None, label: str,
              files: Sequence[BulkFile], fds: Sequence[int], sums: Sequence[bytes],
              threads: int, progress: Callable[[int], None] | None = None,
              first: Sequence[tuple[int, int, int]] = (), mapped: Sequence[Mapped] = (),
              book: MappedBook | None = None) -> Session:
        from runtime.pages.holder import kill_namespace, now_ticks
        pidns, init_pid = target.namespaces["pid"].inode, target.init_pid
        holder = Holder(pidns, init_pid, str(control.path) if control is not None else None,
                        cgroups=list(target.cgroups.values()))
        try:
            listener = Listener(work_dir)
        except OSError:
            holder.close()
            raise
        try:
            # whatever the tree forked since is in its pid namespace: kill all of it, but the init
            server = Server(label, files, fds, sums, lambda: kill_namespace(pidns, init_pid, now_ticks()),
                            threads=threads, holder=holder, progress=progress, first=first, mapped=mapped,
                            book=book, let_go=let_go_sink(os.environ))
        except BaseException:
            listener.close()
            holder.close()
            raise
        return cls(listener, server)

    def _receive(self) -> None:
        assert self.listener is not None and self.server is not None
        try:
            self.listener.receive(self.server.add)
        except BaseException as exc:
            self.error = exc
        self.handed.set()

    def start(self, timeout: float = 60.0, check: Callable[[], object] | None = None) -> None:
        """CRIU returned: every uffd was handed over; register the mapped ranges, run ``check``
        (nothing touched them before: they were registered while the tree was stopped, so
        nothing can touch them from now on), then begin the installs."""
        assert self.server is not None
        if not self.handed.wait(timeout):
            raise StreamError(f"CRIU did not finish its lazy-pages hand-off within {timeout}s")
        if self.error is not None:
            raise StreamError(str(self.error))
        self._close_listener()
        self.server.register_mapped()
        if check is not None:
            check()
        self.server.start()

    def wait(self, timeout: float = 3600.0) -> StreamStats:
        assert self.server is not None
        stats = self.server.wait(timeout)
        self.served = True
        return stats

    def _close_listener(self) -> None:
        if self.listener is not None:
            self.listener.interrupt()
            self._receiver.join(5)
            self.listener.close()
            self.listener = None

    def abort(self) -> None:
        if self.server is not None and not self.served:
            self.server._fail("the restore failed")
            self.server.close()
        self.server = None
        self._close_listener()
