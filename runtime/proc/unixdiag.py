"""Unix sockets of a process's network namespace, by inode, in a form their names cannot forge.

Contract:

- :func:`unix_sockets` returns a :class:`UnixTable` for the network namespace of ``pid``: each
  socket's inode and name (``@name`` for an abstract one, as ``/proc/net/unix`` writes it; ``""``
  when unbound), and the inodes whose name could not be read reliably (``unsure``).
- On the real ``/proc`` the table comes from the kernel's sock_diag netlink interface
  (``UNIX_DIAG_NAME``): one message per socket, the name as raw bytes, so no name can stand in
  for another socket. A process in another network namespace is asked from a short-lived thread
  that joins that namespace (``setns`` moves only the calling thread); the rest of the agent
  stays where it is. The caller names its own socket inodes: one the dump did not list (a dump
  resumes by position, so sockets closed elsewhere in the namespace meanwhile can make it skip a
  live one) is asked for by inode.
- Where netlink cannot answer (a stand-in procfs tree in tests, no permission to join the
  namespace), ``net/unix`` is parsed instead. The kernel prints a name there as it is, newlines
  included, so a socket named ``"x\\n<a line>"`` adds a line of its choosing. What counts is the
  lines of the caller's own inodes (from its fd links, which nothing forges): an inode that
  appears on more than one line is ``unsure``, and so is every inode when some line does not read
  as a socket's (a name holds a newline). Callers treat an ``unsure`` socket as the worst thing
  it could be.
- Nothing here signals, ptraces or writes; a process that is gone gives an empty table.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from runtime import libc
from runtime.proc import procfs

log = logging.getLogger(__name__)

PROC = procfs.PROC
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME = 0x1
UNIX_DIAG_NAME = 0
CLONE_NEWNET = 0x40000000
NLMSG_HDR = struct.Struct("=IHHII")
UNIX_DIAG_REQ = struct.Struct("=BBHIII2I")
UNIX_DIAG_MSG = struct.Struct("=BBBBI2I")
RTATTR = struct.Struct("=HH")
NETNS_JOIN_TIMEOUT = 5.0  # seconds for the whole dump from another namespace

# One socket's line in /proc/net/unix (net/unix/af_unix.c unix_seq_show): "%pK: %08X %08X %08X
# %04X %02X %5lu" then " name" when bound.
_LINE = re.compile(r"^[0-9a-f]+: [0-9A-F]{8} [0-9A-F]{8} [0-9A-F]{8} [0-9A-F]{4} [0-9A-F]{2} +(\d+)(?: (.*))?$")


@dataclass(frozen=True, slots=True)
class UnixTable:
    sockets: dict[int, procfs.UnixSocket] = field(default_factory=dict)
    unsure: frozenset[int] | None = frozenset()  # None: every inode is unsure
    source: str = "sock_diag"  # or "net/unix"

    def get(self, inode: int) -> procfs.UnixSocket | None:
        return self.sockets.get(inode)

    def is_unsure(self, inode: int) -> bool:
        return self.unsure is None or inode in self.unsure


def display_name(raw: bytes) -> str:
    """A sun_path as /proc/net/unix prints it: abstract names start with '@', NULs become '@'."""
    if not raw:
        return ""
    if raw[0] == 0:
        return "@" + raw[1:].replace(b"\0", b"@").decode(errors="replace")
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def parse_net_unix(text: str) -> UnixTable:
    """``net/unix`` as text, with every ambiguity reported (see the module's contract)."""
    sockets: dict[int, procfs.UnixSocket] = {}
    seen: dict[int, int] = {}
    continuation = False
    for line in text.split("\n")[1:]:
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            continuation = True  # the rest of a name that holds a newline
            continue
        inode = int(m.group(1))
        seen[inode] = seen.get(inode, 0) + 1
        sockets.setdefault(inode, procfs.UnixSocket(inode, (m.group(2) or "").strip()))
    unsure = None if continuation else frozenset(i for i, n in seen.items() if n > 1)
    return UnixTable(sockets, unsure, "net/unix")


def _ask(sock: socket.socket, inode: int, seq: int) -> None:
    """One request: every unix socket of the namespace (``inode`` 0, a dump) or exactly one."""
    req = UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, inode, UDIAG_SHOW_NAME, 0xFFFFFFFF, 0xFFFFFFFF)
    flags = NLM_F_REQUEST | (NLM_F_DUMP if inode == 0 else 0)
    sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(req), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + req)


def _dump(sock: socket.socket, wanted: Iterable[int] = ()) -> dict[int, procfs.UnixSocket]:
    """The dump, then each of ``wanted`` it did not list asked for by inode: the kernel resumes a
    dump by position in its hash chains, so a socket closed elsewhere in the namespace between two
    parts of the answer can make it skip one that lives (a tenant could churn sockets to hide
    one). An inode it does not know is no unix socket of this namespace (or is gone)."""
    _ask(sock, 0, 1)
    out = _read(sock, dump=True)
    for seq, inode in enumerate(sorted(set(wanted) - out.keys()), start=2):
        if 0 < inode <= 0xFFFFFFFF:
            _ask(sock, inode, seq)
            out.update(_read(sock, dump=False))
    return out


def _read(sock: socket.socket, *, dump: bool) -> dict[int, procfs.UnixSocket]:
    """The sockets of one answer: a dump's, up to NLMSG_DONE; an exact request's one message
    (ENOENT: there is none)."""
    out: dict[int, procfs.UnixSocket] = {}
    while True:
        data = sock.recv(1 << 20)
        if not data:
            raise OSError("sock_diag: connection closed mid-dump")
        off = 0
        while off + NLMSG_HDR.size <= len(data):
            length, kind, _flags, _seq, _pid = NLMSG_HDR.unpack_from(data, off)
            if length < NLMSG_HDR.size or off + length > len(data):
                raise OSError("sock_diag: malformed message")
            body = data[off + NLMSG_HDR.size:off + length]
            off += (length + 3) & ~3
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", body)
                if not dump and err in (0, -errno.ENOENT):
                    return out
                raise OSError(-err, f"sock_diag: {os.strerror(-err)}")
            if kind != SOCK_DIAG_BY_FAMILY or len(body) < UNIX_DIAG_MSG.size:
                continue
            inode = UNIX_DIAG_MSG.unpack_from(body)[4]
            name = b""
            at = UNIX_DIAG_MSG.size
            while at + RTATTR.size <= len(body):
                alen, atype = RTATTR.unpack_from(body, at)
                if alen < RTATTR.size:
                    break
                if atype == UNIX_DIAG_NAME:
                    name = body[at + RTATTR.size:at + alen]
                at += (alen + 3) & ~3
            out[inode] = procfs.UnixSocket(inode, display_name(name))
            if not dump:
                return out


def _dump_here(wanted: Iterable[int] = ()) -> dict[int, procfs.UnixSocket]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(NETNS_JOIN_TIMEOUT)
        return _dump(sock, wanted)


def _dump_in(ns_path: str, wanted: Iterable[int] = ()) -> dict[int, procfs.UnixSocket]:
    """The dump from inside the network namespace at ``ns_path``, on a thread of its own."""
    result: list[dict[int, procfs.UnixSocket]] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc.call("setns", fd, CLONE_NEWNET, what=f"setns {ns_path}")
            finally:
                os.close(fd)
            result.append(_dump_here(wanted))  # this thread ends here, still in that namespace
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    t = threading.Thread(target=run, name="rekindle-unixdiag", daemon=True)
    t.start()
    t.join(NETNS_JOIN_TIMEOUT)
    if result:
        return result[0]
    raise error[0] if error else OSError(f"sock_diag in {ns_path}: no answer")


def _netlink(pid: int, wanted: Iterable[int]) -> dict[int, procfs.UnixSocket]:
    ns = f"{PROC}/{pid}/ns/net"
    theirs = os.stat(ns)
    ours = os.stat(f"{PROC}/thread-self/ns/net")
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return _dump_here(wanted)
    return _dump_in(ns, wanted)


def unix_sockets(pid: int, proc: str = PROC, inodes: Iterable[int] = ()) -> UnixTable:
    """The unix sockets of ``pid``'s network namespace (see the module's contract); ``inodes``:
    the caller's own socket inodes (from fd links), each of which the table then holds if it is
    a unix socket of that namespace, however the namespace's sockets come and go meanwhile."""
    if os.path.realpath(proc) == PROC:
        try:
            return UnixTable(_netlink(pid, list(inodes)))
        except OSError as exc:  # fall back to the text, read with care
            log.debug("sock_diag for pid %d: %s; reading net/unix", pid, exc)
    try:
        with open(f"{proc}/{pid}/net/unix", "rb") as f:
            raw = f.read(64 << 20)
    except OSError:
        raw = b""
    return parse_net_unix(raw.decode(errors="replace"))
