"""The project's CRIU patches (hack/criu-patches), on the CRIU in PATH.

0001: a tree with a process of another uid dumps where CRIU lacks CAP_SYS_RESOURCE (prlimit(2) on
another uid's task is refused; the patch reads /proc/<pid>/limits instead). The tree: a root parent
and a worker that drops to nobody with a supplementary group, no_new_privs, a seccomp filter and
its own rlimits, as a web server's workers do. CRIU runs with CAP_SYS_RESOURCE taken out of its
bounding set (so the test means the same on a node that has it), dumps the tree and restores it;
every process comes back with the credentials, capabilities, no_new_privs, seccomp mode and limits
it had, read from /proc. The unpatched 4.2.1 fails the dump: "Can't get rlimit 0: Operation not
permitted".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

NOBODY = 65534
# The fields of /proc/<pid>/status a restore must carry over unchanged.
STATUS_FIELDS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                 "NoNewPrivs", "Seccomp", "Seccomp_filters")

# Parent stays root; the worker drops to nobody (groups [100]), sets no_new_privs, an allow-all
# seccomp filter and limits of its own, then both wait. Each says "ready" on stdout when set up.
TREE = r"""
import ctypes, os, resource, struct, sys, time
if os.fork() == 0:
    os.setgroups([100])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    assert libc.prctl(38, 1, None, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    insn = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000))  # ret ALLOW
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(1, ctypes.addressof(insn))
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
    resource.setrlimit(resource.RLIMIT_NOFILE, (321, 654))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.write(1, b"ready %d\n" % os.getpid())
    while True:
        time.sleep(3600)
resource.setrlimit(resource.RLIMIT_NOFILE, (777, 888))
os.write(1, b"ready %d\n" % os.getpid())
while True:
    time.sleep(3600)
"""


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("criu", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    return None


def _criu(*args: str, log: Path) -> subprocess.CompletedProcess[str]:
    """CRIU without CAP_SYS_RESOURCE, whatever the node allows."""
    return subprocess.run(["setpriv", "--bounding-set", "-sys_resource", "--", "criu", *args,
                           "-o", str(log), "-v4"], capture_output=True, text=True, timeout=120)


def _snapshot(pid: int) -> dict[str, str]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    got = {k: status[k].strip() for k in STATUS_FIELDS}
    got["limits"] = Path(f"/proc/{pid}/limits").read_text()
    return got


def _tree(root: int) -> list[int]:
    kids = Path(f"/proc/{root}/task/{root}/children").read_text().split()
    return [root, *map(int, kids)]


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_a_tree_with_a_process_of_another_uid_dumps_and_restores_without_cap_sys_resource(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True, text=True)
    root = proc.pid
    restored: int | None = None
    try:
        assert proc.stdout is not None
        readies = [proc.stdout.readline().split() for _ in range(2)]
        assert all(r and r[0] == "ready" for r in readies), readies
        proc.stdout.close()
        tree = _tree(root)
        assert len(tree) == 2, tree
        before = [_snapshot(p) for p in tree]
        assert before[1]["Uid"].split() == [str(NOBODY)] * 4 and before[1]["Groups"] == "100"
        assert before[1]["NoNewPrivs"] == "1" and before[1]["Seccomp"] == "2"

        dump = _criu("dump", "-t", str(root), "-D", str(images), log=images / "dump.log")
        log = (images / "dump.log").read_text()
        assert dump.returncode == 0, f"criu dump failed:\n{log[-3000:]}"
        proc.wait(timeout=10)  # dumped without --leave-running: the tree is gone
        # CRIU restores the same pids: wait until the worker has been reaped by whoever adopted it
        wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in tree), 20, "the dumped tree to be reaped")

        pidfile = tmp_path / "restored.pid"
        rst = _criu("restore", "-D", str(images), "-d", "--pidfile", str(pidfile), log=images / "restore.log")
        assert rst.returncode == 0, f"criu restore failed:\n{(images / 'restore.log').read_text()[-3000:]}"
        restored = int(pidfile.read_text())
        assert restored == root  # CRIU restores the pids it dumped
        after_tree = _tree(restored)  # -d returns once the tree runs
        assert after_tree == tree
        after = [_snapshot(p) for p in after_tree]
        for pid, b, a in zip(tree, before, after):
            assert a == b, f"pid {pid}: {b} before, {a} restored"
    finally:
        for pid in (restored, root):
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _doctor_without_cap_sys_resource(criu: str) -> tuple[bool, str]:
    code = ("import json, sys; from runtime.doctor import check_nonroot; "
            "c = check_nonroot(sys.argv[1]); print(json.dumps([c.ok, c.detail]))")
    out = subprocess.run(["setpriv", "--bounding-set", "-sys_resource", "--", sys.executable, "-c", code, criu],
                         capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    ok, detail = json.loads(out)
    return ok, detail


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_doctor_says_what_a_node_without_cap_sys_resource_can_do():
    ok, detail = _doctor_without_cap_sys_resource(shutil.which("criu") or "criu")
    assert ok and detail.startswith("no CAP_SYS_RESOURCE: this CRIU dumps processes of another uid"), detail
    # a CRIU that cannot dump the probe (here: one that does nothing) is reported with what fails
    ok, detail = _doctor_without_cap_sys_resource("/bin/false")
    assert not ok and "checkpoints of pods with a process of a non-root uid" in detail, detail
    assert "hack/build-criu.sh" in detail
