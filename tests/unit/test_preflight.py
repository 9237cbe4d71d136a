"""runtime.checkpointable: what a checkpoint must refuse up front, on stand-in /proc trees and on real
processes (io_uring, NCCL's default set-up as NCCL lays it out, supported and unsupported fds)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import checkpointable as preflight
from runtime.checkpointable import Kind, NcclTransport
from runtime.proc import procfs, unixdiag
from tests.nccl_forge import FORGE_HELPERS, FORGE_PROXY_SOCKET

NCCL_SOCK_INODE = 5001


def fake_process(proc: Path, pid: int, *, fds: dict[int, str] | None = None, maps: list[str] | None = None,
                 env: dict[str, str] | None = None, unix: list[tuple[int, str]] | None = None,
                 comm: str = "python3") -> None:
    """A /proc/<pid> the way the kernel shows it, as far as runtime.proc.procfs reads it."""
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "net").mkdir()
    (d / "ns").mkdir()
    os.symlink("net:[4026531840]", d / "ns" / "net")
    for fd, link in (fds or {}).items():
        os.symlink(link, d / "fd" / str(fd))
    (d / "maps").write_text("".join(
        f"{0x7f0000000000 + i * 0x10000:x}-{0x7f0000000000 + i * 0x10000 + 0x1000:x} rw-s 00000000 00:05 {100 + i}"
        f"                    {path}\n" for i, path in enumerate(maps or [])))
    (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
    (d / "comm").write_text(comm + "\n")
    lines = ["Num       RefCount Protocol Flags    Type St Inode Path"]
    lines += [f"0000000000000000: 00000002 00000000 00000000 0002 01 {ino} {path}" for ino, path in unix or []]
    (d / "net" / "unix").write_text("\n".join(lines) + "\n")


def nccl_rank(proc: Path, pid: int, env: dict[str, str]) -> None:
    """A rank with a live communicator, as NCCL 2.28 lays it out: libnccl mapped, the proxy's
    abstract unix socket, a proxy op pool in /dev/shm (unlinked once mapped)."""
    fake_process(proc, pid, env={"PATH": "/usr/bin", **env},
                 fds={0: "/dev/null", 7: f"socket:[{NCCL_SOCK_INODE + pid}]", 9: "/dev/nvidia0",
                      10: "/dev/nvidiactl"},
                 maps=["/usr/lib/python3/site-packages/nvidia/nccl/lib/libnccl.so.2",
                       "/dev/shm/nccl-Xa81Qz (deleted)"],
                 unix=[(NCCL_SOCK_INODE + pid, f"@tmp/nccl-socket-{pid % 2}-9f3e2a1b4c5d6e7f" + "@" * 40),
                       (4000, "@cuda-uvmfd-4026531840-1234@")])


@pytest.mark.parametrize("env,transport", [
    ({}, NcclTransport.P2P_CUMEM),
    ({"NCCL_CUMEM_ENABLE": "0"}, NcclTransport.P2P_IPC),
    ({"NCCL_P2P_DISABLE": "1"}, NcclTransport.SHM_CUMEM_HOST),
    ({"NCCL_P2P_DISABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0"}, NcclTransport.P2P_CUMEM),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}, NcclTransport.SHM),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, NcclTransport.SOCKET),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}, NcclTransport.SOCKET),
], ids=["default", "legacy-ipc", "shm-cumem-host", "p2p-off-is-0", "shm", "sockets", "sockets-no-cumem-host"])
def test_live_communicator_refused_whatever_its_environment_names(tmp_path: Path, env: dict[str, str],
                                                                  transport: NcclTransport) -> None:
    """The environment names the transport in the reason; it never lets a live communicator
    through (a process can change it after start, or rewrite what /proc/<pid>/environ reads)."""
    assert NcclTransport.from_env(env) is transport
    for pid in (101, 102):
        nccl_rank(tmp_path, pid, env)
    report = preflight.inspect([101, 102], cuda_pids=[101, 102], proc=str(tmp_path))
    nccl = [f for f in report.findings if f.kind is Kind.NCCL_COMMUNICATOR]
    assert [f.pid for f in nccl] == [101, 102]
    assert all(transport.value in f.summary for f in nccl)
    assert [f.pid for f in report.blocking] == [101, 102], report
    (reason,) = report.reasons()  # one line for both ranks
    assert "101 (python3), 102 (python3)" in reason
    assert "@tmp/nccl-socket-1-9f3e2a1b4c5d6e7f" in reason and "/dev/shm/nccl-Xa81Qz" in reason
    assert "rekindle_tp.py" in reason
    assert ("cannot be seen from outside the process" in reason) is transport.restorable


def test_each_kind_of_evidence_alone_means_a_live_communicator(tmp_path: Path) -> None:
    fake_process(tmp_path, 1, fds={3: "socket:[77]"}, unix=[(77, "@/tmp/nccl-socket-3-ab12")])
    fake_process(tmp_path, 2, maps=["/dev/shm/nccl-QwErTy"])
    fake_process(tmp_path, 3, fds={5: "/dev/shm/nccl-PoIuYt"})
    report = preflight.inspect([1, 2, 3], proc=str(tmp_path))
    assert [(f.kind, f.pid) for f in report.blocking] == [(Kind.NCCL_COMMUNICATOR, p) for p in (1, 2, 3)]


def test_destroyed_process_group_is_only_a_note(tmp_path: Path) -> None:
    """Case (a): the ranks destroyed their communicators; libnccl stays mapped, nothing else."""
    fake_process(tmp_path, 11, fds={3: "socket:[91]", 4: "/dev/nvidia0"},
                 maps=["/opt/venv/lib/nvidia/nccl/lib/libnccl.so.2"],
                 unix=[(91, "@cuda-uvmfd-4026531840-11@"), (92, "@/tmp/nccl-socket-0-dead")])
    report = preflight.inspect([11], cuda_pids=[11], proc=str(tmp_path))
    assert not report.blocking
    assert [f.kind for f in report.notes] == [Kind.NCCL_IDLE]


def test_a_socket_of_another_process_is_not_evidence(tmp_path: Path) -> None:
    """net/unix lists the whole namespace: only sockets this process holds count."""
    fake_process(tmp_path, 12, fds={3: "socket:[93]"}, unix=[(92, "@/tmp/nccl-socket-0-beef"), (93, "")])
    assert not preflight.inspect([12], proc=str(tmp_path)).findings


def test_io_uring_fd_or_ring_mapping_is_refused(tmp_path: Path) -> None:
    fake_process(tmp_path, 21, fds={6: "anon_inode:[io_uring]"}, maps=["anon_inode:[io_uring]"])
    fake_process(tmp_path, 22, maps=["anon_inode:[io_uring]"])  # fd closed, ring still mapped
    fake_process(tmp_path, 23, fds={4: "anon_inode:[io_uring]"})  # no ring mapped (yet)
    report = preflight.inspect([21, 22, 23], cuda_pids=[21], proc=str(tmp_path))
    assert [(f.kind, f.pid) for f in report.blocking] == [(Kind.IO_URING, p) for p in (21, 22, 23)]
    assert [f.evidence for f in report.blocking][2] == "fd 4"
    assert "USE_LIBUV=0" in report.reasons()[0]


def test_nvidia_device_counts_only_in_a_process_without_cuda(tmp_path: Path) -> None:
    """The vLLM shape: the engine's device files go with the CUDA checkpoint, the API process's
    NVML handle does not."""
    fake_process(tmp_path, 31, comm="api", fds={3: "/dev/nvidiactl", 4: "/dev/nvidia0"})
    fake_process(tmp_path, 32, comm="engine", fds={3: "/dev/nvidiactl", 4: "/dev/nvidia0", 5: "/dev/nvidia-uvm"})
    report = preflight.inspect([31, 32], cuda_pids=[32], proc=str(tmp_path))
    assert [(f.kind, f.pid) for f in report.blocking] == [(Kind.NVIDIA_WITHOUT_CUDA, 31)] * 2
    assert report.reasons() == [report.reasons()[0]] and "nvmlShutdown" in report.reasons()[0]


@pytest.mark.parametrize("link,cuda,blocking", [
    ("anon_inode:[eventfd]", False, False),
    ("anon_inode:[eventpoll]", False, False),
    ("anon_inode:inotify", False, False),
    ("anon_inode:[timerfd]", False, False),
    ("anon_inode:[signalfd]", False, False),
    ("anon_inode:[pidfd]", False, False),
    ("anon_inode:[userfaultfd]", False, True),
    ("anon_inode:[userfaultfd]", True, True),
    ("anon_inode:[perf_event]", True, True),
    ("anon_inode:bpf-prog", False, True),
    ("anon_inode:some-driver-object", False, True),
    ("anon_inode:some-driver-object", True, False),
    ("pipe:[123]", False, False),
    ("/tmp/log.txt", False, False),
], ids=lambda v: str(v))
def test_anon_inodes_criu_cannot_dump(tmp_path: Path, link: str, cuda: bool, blocking: bool) -> None:
    fake_process(tmp_path, 41, fds={8: link})
    report = preflight.inspect([41], cuda_pids=[41] if cuda else [], proc=str(tmp_path))
    assert bool(report.blocking) is blocking, report


def test_nvidia_majors_come_from_proc_devices(tmp_path: Path) -> None:
    (tmp_path / "devices").write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n"
                                      "\nBlock devices:\n  8 sd\n")
    from runtime.proc import procfs
    assert procfs.char_majors("nvidia", str(tmp_path)) == {195, 508}


# ---- real processes -------------------------------------------------------------------------

CHILD_PRELUDE = textwrap.dedent("""
    import ctypes, mmap, os, socket, sys, tempfile, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def ready():
        print("ready", flush=True)
        time.sleep(600)
""")


@pytest.fixture
def child() -> Iterator:
    procs: list[subprocess.Popen[str]] = []

    def start(code: str, env: dict[str, str] | None = None) -> int:
        p = subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        procs.append(p)
        line = p.stdout.readline() if p.stdout else ""
        if line.strip() != "ready":
            p.kill()
            err = p.stderr.read() if p.stderr else ""
            if "SKIP:" in line + err:
                pytest.skip((line + err).split("SKIP:", 1)[1].strip())
            raise AssertionError(f"child failed: {line!r} {err}")
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


IO_URING = """
    params = (ctypes.c_uint32 * 30)()  # struct io_uring_params is 120 bytes
    fd = libc.syscall(425, 4, params)  # io_uring_setup
    if fd < 0:
        print("SKIP: io_uring_setup failed:", os.strerror(ctypes.get_errno()), flush=True); sys.exit(0)
    sq_array_off, sq_entries = params[10 + 6], params[0]  # sq_off.array, sq_entries
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    # IORING_OFF_SQ_RING; libc's mmap, as Python's mmap keeps a dup of the fd
    if not os.environ.get("NO_RING"):
        ring = libc.mmap(None, sq_array_off + sq_entries * 4, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if os.environ.get("CLOSE_FD"):
        os.close(fd)
    ready()
"""


def test_real_io_uring_fd_is_refused(child) -> None:
    pid = child(IO_URING)
    report = preflight.inspect([pid])
    (f,) = report.blocking
    assert f.kind is Kind.IO_URING and "fd " in f.evidence and "ring mapping" in f.evidence, f


def test_real_io_uring_fd_without_ring_is_refused(child) -> None:
    pid = child(IO_URING, env={**os.environ, "NO_RING": "1"})
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.IO_URING and f.evidence.startswith("fd ") and "ring" not in f.evidence, f


def test_real_io_uring_ring_without_fd_is_refused(child) -> None:
    pid = child(IO_URING, env={**os.environ, "CLOSE_FD": "1"})
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.IO_URING and f.evidence.startswith("ring mapping"), f


NCCL_LIKE = """
    # What ncclIpcSocketInit and ncclShmOpen leave in a rank, and libnccl mapped.
    sk = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sk.bind(b"\\0/tmp/nccl-socket-0-%x" % os.getpid())
    fd, path = tempfile.mkstemp(prefix="nccl-", dir="/dev/shm")
    os.ftruncate(fd, 4096)
    pool = mmap.mmap(fd, 4096, mmap.MAP_SHARED)
    os.unlink(path)
    os.close(fd)
    lib = os.path.join(tempfile.mkdtemp(), "libnccl.so.2")
    with open(lib, "wb") as f:
        f.write(b"\\0" * 4096)
    with open(lib, "rb") as f:
        code = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
    ready()
"""


def _nccl_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    return {**env, **extra}


def test_real_nccl_default_layout_is_refused(child) -> None:
    pid = child(NCCL_LIKE, env=_nccl_env())
    report = preflight.inspect([pid])
    (f,) = report.blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and "P2P/CUMEM" in f.summary
    assert f"@/tmp/nccl-socket-0-{pid:x}" in f.evidence and "/dev/shm/nccl-" in f.evidence


def test_real_nccl_layout_is_refused_though_its_start_environment_names_shm(child) -> None:
    pid = child(NCCL_LIKE, env=_nccl_env(NCCL_P2P_DISABLE="1", NCCL_CUMEM_HOST_ENABLE="0"))
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and "names SHM" in f.summary, f


def test_real_nccl_variables_changed_after_start_do_not_pass(child) -> None:
    """Trust boundary (a): started with sockets only, then P2P back on inside the process
    (setenv: /proc/<pid>/environ keeps the start environment)."""
    pid = child("""
    del os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_SHM_DISABLE"]  # unsetenv
    libc.setenv(b"NCCL_P2P_DISABLE", b"0", 1)
    libc.getenv.restype = ctypes.c_char_p
    assert libc.getenv(b"NCCL_P2P_DISABLE") == b"0" and libc.getenv(b"NCCL_SHM_DISABLE") is None
    """ + NCCL_LIKE, env=_nccl_env(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1"))
    assert NcclTransport.from_env(procfs.environ(pid)) is NcclTransport.SOCKET  # what /proc still says
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and f"@/tmp/nccl-socket-0-{pid:x}" in f.evidence, f


def test_real_environ_rewritten_in_memory_does_not_pass(child) -> None:
    """Trust boundary (b): the start environment's memory (env_start..env_end, what
    /proc/<pid>/environ reads) overwritten to claim sockets only."""
    pid = child("""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
    claim = b"NCCL_P2P_DISABLE=1\\0NCCL_SHM_DISABLE=1\\0"
    ctypes.memmove(start, claim + b"\\0" * (end - start - len(claim)), end - start)
    """ + NCCL_LIKE, env={"PATH": os.environ.get("PATH", ""), "PAD": "x" * 200})
    assert procfs.environ(pid) == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}  # the forged claim
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and "names NET/Socket" in f.summary, f


def test_real_supported_fds_pass(child) -> None:
    pid = child("""
        import select, signal
        efd = os.eventfd(0)
        ep = select.epoll()
        ep.register(efd, select.EPOLLIN)
        pfd = os.pidfd_open(os.getppid())
        ino = libc.inotify_init1(0)
        tun = open("/dev/null", "rb")
        r, w = os.pipe()
        lst = socket.create_server(("127.0.0.1", 0))
        ready()
    """)
    assert not preflight.inspect([pid]).findings


def test_real_userfaultfd_and_character_device_are_refused(child) -> None:
    pid = child("""
        uffd = libc.syscall(323, os.O_CLOEXEC)  # userfaultfd
        if uffd < 0:
            print("SKIP: userfaultfd failed:", os.strerror(ctypes.get_errno()), flush=True); sys.exit(0)
        try:
            fuse = os.open("/dev/fuse", os.O_RDWR)
        except OSError as e:
            print("SKIP: /dev/fuse:", e, flush=True); sys.exit(0)
        ready()
    """)
    report = preflight.inspect([pid])
    kinds = sorted((f.kind.value, f.evidence.split(" -> ")[1]) for f in report.blocking)
    assert kinds == [("unsupported-fd", "/dev/fuse (10:229)"), ("unsupported-fd", "anon_inode:[userfaultfd]")], report


# ---- unix socket names that pose as other sockets --------------------------------------------

# A rank whose only live mark is NCCL's proxy socket, hidden behind forged /proc/net/unix lines.
FORGED = FORGE_PROXY_SOCKET + """
if not keep:
    print("no forged line came after the real one", flush=True); sys.exit(1)
ready()
"""


def _last_line_of(pid: int, ino: int) -> str | None:
    """The name on the last line of /proc/net/unix for ``ino`` (what the line-by-line reading
    before believed), read as the forging child reads it."""
    scope: dict[str, object] = {"os": os, "socket": socket}
    exec(FORGE_HELPERS, scope)
    names = scope["names_of"](ino, f"/proc/{pid}/net/unix")  # type: ignore[operator]
    return names[-1] if names else None


def _ino_of_nccl_socket(pid: int) -> int:
    links = {e.link for e in procfs.fds(pid)}
    (ino,) = [i for i, sk in unixdiag.unix_sockets(pid).sockets.items()
              if f"socket:[{i}]" in links and sk.path.startswith("@/tmp/nccl-socket-")]
    return ino


def test_real_forged_net_unix_line_does_not_hide_the_proxy_socket(child) -> None:
    """Trust boundary (c): the proxy socket's real line, then a forged one for the same inode."""
    pid = child(FORGED)
    ino = _ino_of_nccl_socket(pid)
    assert _last_line_of(pid, ino) == "@harmless"  # what the line-by-line reading before believed
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and f"socket @/tmp/nccl-socket-0-{pid:x}" in f.evidence, f


def test_real_forged_net_unix_line_is_caught_without_netlink(child, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where sock_diag cannot answer, the text is read with care: the forged inode is unsure."""
    pid = child(FORGED)
    ino = _ino_of_nccl_socket(pid)

    def no_netlink(pid: int, wanted: object) -> dict[int, procfs.UnixSocket]:
        raise PermissionError("no sock_diag here")

    monkeypatch.setattr(unixdiag, "_netlink", no_netlink)
    table = unixdiag.unix_sockets(pid)
    assert table.source == "net/unix" and table.is_unsure(ino)
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and f"socket:[{ino}]" in f.evidence and "newline" in f.evidence, f


def test_a_socket_the_dump_skips_is_asked_for_by_inode(child, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump resumes by position in the kernel's hash chains: sockets closed elsewhere in the
    namespace between two parts of it can make it skip a live one (seen here under a busy test
    run). The dump is made to skip the proxy socket; the caller's own inodes are then asked for
    one by one, so the preflight still finds it, and an inode that is no unix socket (a TCP
    socket's) just is not in the table."""
    pid = child(FORGED)
    ino = _ino_of_nccl_socket(pid)
    real = unixdiag._read

    def skipping(sock, *, dump):  # type: ignore[no-untyped-def]
        got = real(sock, dump=dump)
        if dump:
            got.pop(ino, None)
        return got

    monkeypatch.setattr(unixdiag, "_read", skipping)
    assert unixdiag.unix_sockets(pid).get(ino) is None  # what a skipping dump alone leaves
    with socket.socket() as tcp:
        tcp_ino = os.fstat(tcp.fileno()).st_ino
        table = unixdiag.unix_sockets(pid, inodes=[ino, tcp_ino])
    assert table.get(ino).path.startswith("@/tmp/nccl-socket-0-") and table.get(tcp_ino) is None
    (f,) = preflight.inspect([pid]).blocking
    assert f.kind is Kind.NCCL_COMMUNICATOR and f"socket @/tmp/nccl-socket-0-{pid:x}" in f.evidence, f


def test_net_unix_text_reports_every_ambiguity() -> None:
    head = "Num       RefCount Protocol Flags    Type St Inode Path\n"
    line = "000000005bb13ed8: 00000002 00000000 00010000 0001 01 {:5d}{}\n"
    clean = unixdiag.parse_net_unix(head + line.format(11, " @a") + line.format(12, "") + line.format(13, " /run/x"))
    assert {i: s.path for i, s in clean.sockets.items()} == {11: "@a", 12: "", 13: "/run/x"}
    assert not any(clean.is_unsure(i) for i in (11, 12, 13))
    # a name holding a newline then a well-formed line for inode 11: 11 is unsure, 12 is not
    dup = unixdiag.parse_net_unix(head + line.format(11, " @nccl") + line.format(12, " @x") + line.format(11, " @ok"))
    assert dup.get(11).path == "@nccl" and dup.is_unsure(11) and not dup.is_unsure(12)
    # a newline followed by text that is no socket's line: nothing in the table is sure
    junk = unixdiag.parse_net_unix(head + line.format(11, " @x") + "hello\n" + line.format(12, " @y"))
    assert junk.is_unsure(11) and junk.is_unsure(12)


def test_sock_diag_names_are_bytes_as_bound() -> None:
    assert unixdiag.display_name(b"\0/tmp/nccl-socket-0-ab\nx\0y") == "@/tmp/nccl-socket-0-ab\nx@y"
    assert unixdiag.display_name(b"/run/a.sock\0") == "/run/a.sock"
    assert unixdiag.display_name(b"") == ""


def test_sock_diag_reads_a_process_in_another_network_namespace() -> None:
    """The agent asks from a thread that joins the process's namespace; it stays in its own."""
    if os.geteuid() != 0:
        pytest.skip("joining another network namespace needs root")
    code = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(b'\\0/tmp/nccl-socket-1-beef\\nfake'); s.listen()\n"
            "print('ready', flush=True); sys.stdin.read()\n")
    try:
        p = subprocess.Popen(["unshare", "--net", sys.executable, "-c", code], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    try:
        if (p.stdout.readline() if p.stdout else "").strip() != "ready":
            pytest.skip(f"unshare --net failed: {p.stderr.read() if p.stderr else ''}")
        ours = os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{p.pid}/ns/net") != ours
        table = unixdiag.unix_sockets(p.pid)
        assert table.source == "sock_diag"
        assert [s.path for s in table.sockets.values()] == ["@/tmp/nccl-socket-1-beef\nfake"]
        assert os.readlink("/proc/self/ns/net") == ours and os.readlink("/proc/thread-self/ns/net") == ours
    finally:
        p.kill()
        p.wait(10)
