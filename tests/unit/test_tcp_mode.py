"""runtime.proc.tcpmode: keep a tree's TCP connections only when all are loopback and between its own
processes; on stand-in /proc tables and on real sockets."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.criu import command as criu
from runtime.proc import procfs, tcpmode

LISTEN, ESTABLISHED, TIME_WAIT, CLOSE_WAIT = 0x0A, 0x01, 0x06, 0x08


def hexaddr(ip: str, port: int) -> str:
    raw = ipaddress.ip_address(ip).packed
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{raw.hex().upper()}:{port:04X}"


def row(i: int, local: tuple[str, int], remote: tuple[str, int], state: int, inode: int) -> str:
    return (f"{i:4d}: {hexaddr(*local)} {hexaddr(*remote)} {state:02X} 00000000:00000000 00:00000000 "
            f"00000000     0        0 {inode} 1 0000000000000000 20 4 30 10 -1")


def fake_tables(proc: Path, sockets: dict[int, list[tuple[tuple[str, int], tuple[str, int], int, int]]]) -> None:
    """sockets: pid -> [(local, remote, state, inode)]; one netns, the tables list them all."""
    v4, v6 = [], []
    for pid, socks in sockets.items():
        d = proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "ns").mkdir()
        os.symlink("net:[4026532000]", d / "ns" / "net")
        for n, (local, remote, state, inode) in enumerate(socks):
            os.symlink(f"socket:[{inode}]", d / "fd" / str(3 + n))
            (v6 if ":" in local[0] else v4).append(row(len(v4) + len(v6), local, remote, state, inode))
    v4.append(row(99, ("127.0.0.1", 5555), ("127.0.0.1", 40000), TIME_WAIT, 0))  # nobody's: ignored
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
    for pid in sockets:
        (proc / str(pid) / "net").mkdir()
        (proc / str(pid) / "net" / "tcp").write_text("\n".join([head, *v4]) + "\n")
        (proc / str(pid) / "net" / "tcp6").write_text("\n".join([head, *v6]) + "\n")


L = ("127.0.0.1", 29500)


@pytest.mark.parametrize("sockets,pids,established", [
    ({}, [1], False),
    ({1: [(L, ("0.0.0.0", 0), LISTEN, 10)]}, [1], False),
    ({1: [(L, ("0.0.0.0", 0), LISTEN, 10), (L, ("127.0.0.1", 41000), ESTABLISHED, 11)],
      2: [(("127.0.0.1", 41000), L, ESTABLISHED, 12)]}, [1, 2], True),
    ({1: [(L, ("127.0.0.1", 41000), ESTABLISHED, 11)],
      2: [(("127.0.0.1", 41000), L, ESTABLISHED, 12)]}, [1], False),  # other end outside the tree
    ({1: [(("127.0.0.1", 8000), ("127.0.0.2", 8001), CLOSE_WAIT, 11)],
      2: [(("127.0.0.2", 8001), ("127.0.0.1", 8000), 5, 12)]}, [1, 2], True),  # half-closed, 127/8
    ({1: [(("::1", 7000), ("::1", 7001), ESTABLISHED, 21)],
      2: [(("::1", 7001), ("::1", 7000), ESTABLISHED, 22)]}, [1, 2], True),
    ({1: [(("::ffff:127.0.0.1", 7000), ("::ffff:127.0.0.1", 7001), ESTABLISHED, 21)],
      2: [(("::ffff:127.0.0.1", 7001), ("::ffff:127.0.0.1", 7000), ESTABLISHED, 22)]}, [1, 2], True),
    ({1: [(("::ffff:127.0.0.1", 9000), ("::ffff:127.0.0.1", 41000), ESTABLISHED, 21)],
      2: [(("127.0.0.1", 41000), ("127.0.0.1", 9000), ESTABLISHED, 22)]}, [1, 2], True),  # dual-stack server
    ({1: [(L, ("127.0.0.1", 41000), ESTABLISHED, 11), (("10.1.2.3", 8080), ("10.1.9.9", 52000), ESTABLISHED, 13)],
      2: [(("127.0.0.1", 41000), L, ESTABLISHED, 12)]}, [1, 2], False),  # one kubelet probe: close all
    ({1: [(("10.1.2.3", 8080), ("10.1.2.3", 52000), ESTABLISHED, 13)],
      2: [(("10.1.2.3", 52000), ("10.1.2.3", 8080), ESTABLISHED, 14)]}, [1, 2], False),  # pod IP: changes
], ids=["none", "listen-only", "loopback-pair", "peer-outside", "half-closed-127/8", "ipv6", "v4-mapped",
        "dual-stack-server", "one-remote", "pod-ip"])
def test_plan_from_tables(tmp_path: Path, sockets, pids, established: bool) -> None:
    fake_tables(tmp_path, sockets)
    plan = tcpmode.plan(pids, proc=str(tmp_path), reuse=False)
    assert plan.established is established, plan


def test_plan_reason_names_the_connection(tmp_path: Path) -> None:
    fake_tables(tmp_path, {1: [(("10.1.2.3", 8080), ("10.1.9.9", 52000), ESTABLISHED, 13)]})
    assert tcpmode.plan([1], proc=str(tmp_path), reuse=False).reason == "10.1.2.3:8080 -> 10.1.9.9:52000 ESTABLISHED is not on loopback"


def test_argv_follows_the_mode() -> None:
    dump = criu.DumpOptions(images_dir="/i", pid=1, tcp_established=True)
    restore = criu.RestoreOptions(images_dir="/i", root="/r", pidfile="/p", tcp_established=True)
    for opts in (dump, restore):
        argv = criu.criu_argv(opts)
        assert "--tcp-established" in argv and "--tcp-close" not in argv
        opts.tcp_established = False
        argv = criu.criu_argv(opts)
        assert "--tcp-close" in argv and "--tcp-established" not in argv


# ---- real sockets ------------------------------------------------------------------------------

PEER = textwrap.dedent("""
    import socket, sys, time
    role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":  # dual-stack on "::", as busybox nc and many servers listen
        lst = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) if host == "::" \
            else socket.create_server((host, 0))
        print(lst.getsockname()[1], flush=True)
        conn, _ = lst.accept()
    else:
        conn = socket.create_connection(("127.0.0.1" if host == "::" else host, port))
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def pair() -> Iterator:
    procs: list[subprocess.Popen[str]] = []

    def connect(host: str) -> tuple[int, int]:
        server = subprocess.Popen([sys.executable, "-c", PEER, "server", host, "0"], text=True, stdout=subprocess.PIPE)
        procs.append(server)
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        client = subprocess.Popen([sys.executable, "-c", PEER, "client", host, str(port)], text=True,
                                  stdout=subprocess.PIPE)
        procs.append(client)
        for p in (client, server):
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return server.pid, client.pid

    yield connect
    for p in procs:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("listen", ["127.0.0.1", "::"])
def test_real_loopback_connection_between_two_processes_is_kept(pair, listen: str) -> None:
    server, client = pair(listen)
    plan = tcpmode.plan([server, client])
    assert plan.established, plan
    assert len(plan.connections) == 2
    # Seen from one side only, the other end is outside the tree.
    assert not tcpmode.plan([server]).established


def test_a_connection_a_read_of_net_tcp_skips_is_found_again(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """net/tcp comes a page per read, each resumed by position: churn elsewhere in the namespace
    can make one read skip a live socket. Here the first read skips the client's; the plan still
    holds both ends (without the reread it would call the server's end one with its peer outside
    the tree)."""
    server, client = pair("127.0.0.1")
    client_inos = procfs.socket_inodes(procfs.fds(client))
    real, reads = procfs.tcp_sockets, []

    def skipping(pid: int, proc: str = procfs.PROC) -> dict[int, procfs.TcpSocket]:
        table = real(pid, proc)
        reads.append(pid)
        return {i: s for i, s in table.items() if i not in client_inos} if len(reads) == 1 else table

    monkeypatch.setattr(procfs, "tcp_sockets", skipping)
    plan = tcpmode.plan([server, client])
    assert plan.established and len(plan.connections) == 2, plan
    assert len(reads) == 2
    monkeypatch.setattr(tcpmode, "REREADS", 0)
    reads.clear()
    assert not tcpmode.plan([server, client]).established  # what one skipping read alone decides


def test_repair_off_lets_a_kept_connection_carry_data_again(pair) -> None:
    """What CRIU's dump with --leave-stopped leaves behind (repair mode on both ends), undone."""
    server, client = pair("127.0.0.1")
    plan = tcpmode.plan([server, client])
    assert len(plan.holders) == 2
    for h in plan.holders:  # as the dump leaves them
        with tcpmode._socket_of(h.pid, h.fd) as sk:
            sk.setsockopt(socket.SOL_TCP, tcpmode.TCP_REPAIR, 1)
    assert tcpmode.repair_off(plan.holders) == []
    a, b = (tcpmode._socket_of(h.pid, h.fd) for h in plan.holders)
    with a, b:
        for sk, h in ((a, plan.holders[0]), (b, plan.holders[1])):
            assert sk.getsockopt(socket.SOL_TCP, tcpmode.TCP_REPAIR) == 0
            assert sk.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == h.reuseaddr
        a.sendall(b"still connected")
        b.settimeout(5)
        assert b.recv(64) == b"still connected"


def _global_ipv4() -> str | None:
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    return None


def test_real_connection_over_a_pod_address_is_closed(pair) -> None:
    addr = _global_ipv4()
    if addr is None:
        pytest.skip("no global IPv4 address on this machine")
    server, client = pair(addr)
    plan = tcpmode.plan([server, client])
    assert not plan.established and "is not on loopback" in plan.reason, plan
    assert {s.local[0] for s in plan.connections} == {addr}


def test_procfs_reads_own_socket_inodes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as lst:
        inodes = procfs.socket_inodes(procfs.fds(os.getpid()))
        assert os.fstat(lst.fileno()).st_ino in inodes
        table = procfs.tcp_sockets(os.getpid())
        assert table[os.fstat(lst.fileno()).st_ino].local == lst.getsockname()
