"""Before a checkpoint: does the tree hold anything its restore could not bring back?

Contract:

- :func:`inspect` reads, for every process of the tree, its fds, mappings, start environment
  and its network namespace's unix sockets under a procfs root (``runtime.proc.procfs``); it never
  locks, signals or ptraces, so a refusal leaves the source exactly as it was. ``cuda_pids``
  are the processes the driver will checkpoint (what they hold of the driver's is released
  before CRIU runs).
- It returns a :class:`Report` of typed :class:`Finding` s; a blocking one means the checkpoint
  must not be taken (the caller raises ``CheckpointRefused`` with :meth:`Report.reasons`).

Blocking findings, and why:

- ``io-uring``: an io_uring instance (an ``anon_inode:[io_uring]`` fd or ring mapping). CRIU 4.2
  cannot dump it (PyTorch's libuv TCPStore holds one: ``USE_LIBUV=0``).
- ``unsupported-fd``: an fd CRIU 4.2 cannot dump (``criu/files.c``): an anon inode other than
  eventfd, eventpoll, inotify, fanotify, signalfd, timerfd and pidfd (bpf maps need a libbpf
  build); a character device other than the memory devices (1:*), tun and autofs (10:200,
  10:235) and ttys; a block device. In a CUDA process only what the driver never creates counts
  (io_uring, userfaultfd, perf events, non-NVIDIA devices).
- ``nvidia-without-cuda``: a process with no CUDA context to checkpoint holds an NVIDIA device
  open (NVML does, until ``nvmlShutdown``): the CUDA checkpoint does not release it and CRIU
  cannot dump it.
- ``nccl-communicator``: a live NCCL communicator, whatever its transport. Live means the
  process holds NCCL's proxy socket (``@tmp/nccl-socket-*``, bound for a communicator's
  lifetime) or maps or holds a ``/dev/shm/nccl-*`` file (SHM transport buffers, proxy op pools).
  Measured on 2x H200, NCCL 2.28: P2P/CUMEM (the default), P2P/IPC (``NCCL_CUMEM_ENABLE=0``) and
  SHM on cuMem host memory (``NCCL_P2P_DISABLE=1`` alone) fail at restore and leave the job
  stuck; SHM with ``NCCL_CUMEM_HOST_ENABLE=0`` and sockets only (``NCCL_SHM_DISABLE=1``) restore.
  Which one a communicator uses is not visible from outside the process: NCCL reads its
  variables once, in the process, where they can be set after start or the start environment
  rewritten in memory (what ``/proc/<pid>/environ`` reads), and the cuMem fds it passes between
  ranks are closed right after import. So a live communicator is refused even when its
  environment names a transport that restores; the environment only names the transport in the
  reason. A communicator destroyed before the checkpoint leaves libnccl mapped and nothing
  else: restorable (a note).

What decides is what the kernel shows of the process: fd links, mappings (``/proc/<pid>/maps``
escapes newlines in paths) and its unix sockets by the inodes of its own socket fds, named by
sock_diag netlink (``runtime.proc.unixdiag``), where no socket's name can pose as another's. A socket
whose name cannot be read for sure (``net/unix`` text with a forged line) counts as NCCL's.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.proc import procfs, unixdiag

# criu/files.c dump_one_file: the anon inodes CRIU 4.2 dumps (link text after "anon_inode:").
CRIU_ANON = frozenset({"[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]"})
# Anon inodes no CUDA driver creates and CRIU cannot dump: they count in CUDA processes too.
NEVER_DRIVER_ANON = {"[io_uring]": "io_uring", "[userfaultfd]": "userfaultfd", "[perf_event]": "perf event"}
MEM_MAJOR, MISC_MAJOR, NVIDIA_MAJOR = 1, 10, 195
MISC_OK = frozenset({200, 235})  # tun, autofs
TTY_MAJORS = frozenset({4, 5, *range(136, 144)})
# NCCL's proxy socket is abstract; /proc/net/unix shows it as "@tmp/nccl-socket-<rank>-<hash>"
# padded with '@' (seen with NCCL 2.28 on 2x H200, and gone after destroy_process_group); older
# builds name it "@/tmp/nccl-socket-...".
NCCL_SOCKET = re.compile(r"@/?tmp/nccl-socket-")
NCCL_SHM = "/dev/shm/nccl-"


class Kind(enum.Enum):
    IO_URING = "io-uring"
    UNSUPPORTED_FD = "unsupported-fd"
    NVIDIA_WITHOUT_CUDA = "nvidia-without-cuda"
    NCCL_COMMUNICATOR = "nccl-communicator"
    NCCL_IDLE = "nccl-idle"  # note: libnccl loaded, no live communicator


class NcclTransport(enum.Enum):
    """What NCCL uses between two ranks on one node with peer-capable GPUs, by environment."""

    P2P_CUMEM = "P2P/CUMEM"
    P2P_IPC = "P2P/IPC"
    SHM_CUMEM_HOST = "SHM on cuMem host memory"
    SHM = "SHM"
    SOCKET = "NET/Socket"

    @classmethod
    def from_env(cls, env: dict[str, str]) -> NcclTransport:
        def flag(name: str) -> str:
            return env.get(name, "").strip()

        if flag("NCCL_P2P_DISABLE") != "1":
            return cls.P2P_IPC if flag("NCCL_CUMEM_ENABLE") == "0" else cls.P2P_CUMEM
        if flag("NCCL_SHM_DISABLE") == "1":
            return cls.SOCKET
        return cls.SHM if flag("NCCL_CUMEM_HOST_ENABLE") == "0" else cls.SHM_CUMEM_HOST

    @property
    def restorable(self) -> bool:
        return self in (NcclTransport.SHM, NcclTransport.SOCKET)


NCCL_ADVICE = "destroy the process group before ready-for-checkpoint and rebuild it after (rekindle_tp.py)"


@dataclass(frozen=True, slots=True)
class Finding:
    kind: Kind
    pid: int
    comm: str
    summary: str  # the same for every process with this problem
    evidence: str  # what was seen in this process
    blocking: bool = True


@dataclass(frozen=True, slots=True)
class Report:
    findings: tuple[Finding, ...]

    @property
    def blocking(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.blocking)

    @property
    def notes(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if not f.blocking)

    def reasons(self) -> list[str]:
        """One line per blocking problem: the processes it was found in, the first one's evidence."""
        groups: dict[tuple[Kind, str], list[Finding]] = {}
        for f in self.blocking:
            groups.setdefault((f.kind, f.summary), []).append(f)
        out = []
        for (_, summary), found in groups.items():
            who = ", ".join(f"{f.pid} ({f.comm})" if f.comm else str(f.pid) for f in found)
            out.append(f"{summary} in pid {who} [{found[0].evidence}]")
        return out


def _anon(link: str) -> str | None:
    return link[len("anon_inode:"):] if link.startswith("anon_inode:") else None


def _chr_supported(major: int, minor: int) -> bool:
    return major == MEM_MAJOR or (major == MISC_MAJOR and minor in MISC_OK) or major in TTY_MAJORS


def _fd_findings(pid: int, name: str, fds: Sequence[procfs.Fd], mapped: Sequence[procfs.Mapping],
                 is_cuda: bool, nvidia_majors: set[int]) -> list[Finding]:
    out = []
    rings = [m for m in mapped if m.path == "anon_inode:[io_uring]"]
    uring = [f"fd {e.fd}" for e in fds if e.link == "anon_inode:[io_uring]"]
    if uring or rings:
        seen = uring + ([f"ring mapping at {rings[0].start:#x}"] if rings else [])
        out.append(Finding(Kind.IO_URING, pid, name,
                           "an io_uring instance, which CRIU cannot dump (PyTorch's TCPStore: set USE_LIBUV=0)",
                           ", ".join(seen)))
    for e in fds:
        anon = _anon(e.link)
        if anon is not None:
            if anon == "[io_uring]":
                continue
            if anon in NEVER_DRIVER_ANON or (not is_cuda and anon not in CRIU_ANON):
                what = NEVER_DRIVER_ANON.get(anon, e.link)
                out.append(Finding(Kind.UNSUPPORTED_FD, pid, name, f"an open {what}, which CRIU cannot dump",
                                   f"fd {e.fd} -> {e.link}"))
            continue
        if e.is_blk:
            out.append(Finding(Kind.UNSUPPORTED_FD, pid, name, "an open block device, which CRIU cannot dump",
                               f"fd {e.fd} -> {e.link}"))
            continue
        if e.is_chr:
            major, minor = os.major(e.rdev or 0), os.minor(e.rdev or 0)
            if _chr_supported(major, minor):
                continue
            nvidia = major in nvidia_majors
        elif e.mode is None and e.link.startswith("/dev/nvidia"):
            major = minor = -1  # a stand-in tree: only the link text is known
            nvidia = True
        else:
            continue  # a file, socket or pipe
        if nvidia:
            if not is_cuda:
                out.append(Finding(
                    Kind.NVIDIA_WITHOUT_CUDA, pid, name,
                    "an NVIDIA device held open without a CUDA context to checkpoint (NVML keeps it open "
                    "until nvmlShutdown); CRIU cannot dump it", f"fd {e.fd} -> {e.link}"))
            continue
        out.append(Finding(Kind.UNSUPPORTED_FD, pid, name, "an open character device CRIU cannot dump",
                           f"fd {e.fd} -> {e.link} ({major}:{minor})"))
    return out


def _nccl_findings(pid: int, name: str, fds: Sequence[procfs.Fd], mapped: Sequence[procfs.Mapping],
                   unix: unixdiag.UnixTable, env: dict[str, str]) -> list[Finding]:
    evidence = []
    for inode in sorted(procfs.socket_inodes(list(fds))):
        sk = unix.get(inode)
        if unix.is_unsure(inode):
            evidence.append(f"socket:[{inode}] (its name cannot be read for sure: a unix socket name in "
                            f"{unix.source} holds a newline)")
        elif sk is not None and NCCL_SOCKET.match(sk.path):
            evidence.append(f"socket {sk.path!r}" if "\n" in sk.path else f"socket {sk.path}")
    evidence += sorted({f"mapping {m.path}" for m in mapped if m.path.startswith(NCCL_SHM)})
    evidence += sorted({f"fd {e.fd} -> {e.link}" for e in fds if e.link.startswith(NCCL_SHM)})
    loaded = any(os.path.basename(m.path).startswith("libnccl") for m in mapped)
    if not evidence:
        if loaded:
            return [Finding(Kind.NCCL_IDLE, pid, name, "libnccl loaded, no live communicator",
                            "libnccl mapped", blocking=False)]
        return []
    # The environment only names the transport; it never lets a live communicator through.
    transport = NcclTransport.from_env(env)
    if transport.restorable:
        summary = (f"a live NCCL communicator; its start environment names {transport.value}, but the transport "
                   "NCCL chose cannot be seen from outside the process (its variables can change after start) "
                   "and the driver cannot restore P2P/CUMEM, P2P/IPC or SHM on cuMem host memory: ")
    else:
        summary = f"a live NCCL communicator on {transport.value}, which the driver cannot restore: "
    return [Finding(Kind.NCCL_COMMUNICATOR, pid, name, summary + NCCL_ADVICE, ", ".join(evidence[:3]))]


def inspect(pids: Iterable[int], cuda_pids: Iterable[int] = (), proc: str = procfs.PROC) -> Report:
    """Every finding in the tree ``pids`` (host pids, as ``proc`` numbers them)."""
    cuda = set(cuda_pids)
    nvidia_majors = {NVIDIA_MAJOR, *procfs.char_majors("nvidia", proc)}
    seen = []
    inodes_by_ns: dict[str, tuple[int, set[int]]] = {}  # a pid of the namespace, its tree's socket inodes
    for pid in dict.fromkeys(pids):
        fds = procfs.fds(pid, proc)
        ns = procfs.netns_key(pid, proc)
        inodes_by_ns.setdefault(ns, (pid, set()))[1].update(procfs.socket_inodes(list(fds)))
        seen.append((pid, fds, ns))
    unix_by_ns = {ns: unixdiag.unix_sockets(pid, proc, inodes) for ns, (pid, inodes) in inodes_by_ns.items()}
    findings: list[Finding] = []
    for pid, fds, ns in seen:
        mapped = procfs.maps(pid, proc)
        name = procfs.comm(pid, proc)
        findings += _fd_findings(pid, name, fds, mapped, pid in cuda, nvidia_majors)
        findings += _nccl_findings(pid, name, fds, mapped, unix_by_ns[ns], procfs.environ(pid, proc))
    return Report(tuple(findings))
