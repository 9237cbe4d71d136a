"""Restricted pods (Pod Security "restricted") checkpoint and restore, on nodes without
CAP_SYS_RESOURCE as well.

The container runs as uid 1000 / gid 1000 with a supplementary group, every capability dropped,
no_new_privs and the runtime's default seccomp profile, as kubelet asks for ``runAsNonRoot``,
``runAsUser``/``runAsGroup``, ``allowPrivilegeEscalation: false``, ``capabilities.drop: [ALL]`` and
``seccompProfile: RuntimeDefault``. The workload is a server of three processes: the parent
answers HTTP and counts requests, two forked workers each hold a random token. It is checkpointed by
annotation and restored on each restore path; the restored tree answers with the source's tokens
and its count, and every process has the target spec's credentials, capabilities, no_new_privs and
seccomp, read from /proc/<pid>/status, and the target's lower RLIMIT_NOFILE (the agent lowers the
limits of processes of another uid as their owner where it lacks CAP_SYS_RESOURCE). A target of
another user is refused with the reason.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from devtools.cri import SecurityContext
from devtools.gpu import host_python_mounts
from runtime.proc import rlimits
from tests.e2e.test_checkpoint_restore import _edit_spec, get, wait_status
from tests.e2e.test_stream_restore import _tree_in
from tests.waiting import wait_for

IMAGE = "localhost/rekindle/host-usr:1"
PYTHON = "/usr/bin/python3"  # the node's, readable by any uid (a venv under /root may not be)
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
USER, GROUP, EXTRA_GROUP, NOBODY = 1000, 1000, 3000, 65534

# The parent answers HTTP and counts requests; $WORKERS forked workers each hold a random token
# (after dropping to $WORKER_UID when set: a root parent whose workers run as another user).
SERVER = r"""
import os, secrets, socket
workers = []
for _ in range(int(os.environ["WORKERS"])):
    ask_r, ask_w = os.pipe()
    say_r, say_w = os.pipe()
    if os.fork() == 0:
        if os.environ.get("WORKER_UID"):
            uid = int(os.environ["WORKER_UID"])
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        token = secrets.token_hex(8).encode()
        while os.read(ask_r, 1):
            os.write(say_w, token)
        os._exit(0)
    workers.append((ask_w, say_r))
count = 0
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080))
srv.listen(8)
open(os.environ["REKINDLE_CONTROL_DIR"] + "/ready-for-checkpoint", "w").close()
while True:
    conn, _ = srv.accept()
    conn.recv(4096)
    count += 1
    tokens = []
    for ask_w, say_r in workers:
        os.write(ask_w, b"?")
        tokens.append(os.read(say_r, 16).decode())
    body = f"count={count} tokens={','.join(tokens) or '-'} uid={os.getuid()}\n"
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    conn.close()
"""

# /proc/<pid>/status fields that must be the target spec's after a restore
FIELDS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
# capability numbers (linux/capability.h)
CAPS = {f"CAP_{n}": i for i, n in enumerate((
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
    "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
    "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
    "PERFMON BPF CHECKPOINT_RESTORE").split())}


def restricted(user: int = USER) -> SecurityContext:
    return SecurityContext(run_as_user=user, run_as_group=GROUP, supplemental_groups=(EXTRA_GROUP,),
                           drop_capabilities=("ALL",), no_new_privs=True, seccomp_runtime_default=True)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return {k: " ".join(fields[k].split()) for k in FIELDS}


def _cap_mask(names: list[str]) -> str:
    bits = 0
    for n in names:
        bits |= 1 << CAPS[n]
    return f"{bits:016x}"


def _expected(spec: dict, uid: int | None = None) -> dict[str, str]:
    """What /proc/<pid>/status must say for a process of this OCI spec (one that dropped to ``uid``
    by setresuid: no groups, no permitted, effective or ambient capabilities left)."""
    process = spec["process"]
    user, caps = process["user"], process.get("capabilities") or {}
    if uid is not None:
        user, caps = {"uid": uid, "gid": uid}, {**caps, "permitted": [], "effective": [], "ambient": []}
    ids = (str(user["uid"]), str(user["gid"]))
    groups = " ".join(str(g) for g in sorted(set(user.get("additionalGids") or [])))
    return {"Uid": " ".join([ids[0]] * 4), "Gid": " ".join([ids[1]] * 4), "Groups": groups,
            "CapInh": _cap_mask(caps.get("inheritable") or []), "CapPrm": _cap_mask(caps.get("permitted") or []),
            "CapEff": _cap_mask(caps.get("effective") or []), "CapBnd": _cap_mask(caps.get("bounding") or []),
            "CapAmb": _cap_mask(caps.get("ambient") or []),
            "NoNewPrivs": "1" if process.get("noNewPrivileges") else "0",
            "Seccomp": "2" if (spec.get("linux") or {}).get("seccomp") else "0"}


def _fields(body: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in body.split())


def _answer(sandbox, pod_id: str) -> dict[str, str]:
    return _fields(wait_for(lambda: get(sandbox.cri.pod_ip(pod_id), "/", 60.0), 60, "the server to answer",
                            ignore=(OSError,)))


def _statuses(tree: list[int]) -> dict[str, dict[str, str]]:
    """Status of the tree's processes by role: the parent (the lowest pid of the ns) and its workers."""
    return {("parent" if i == 0 else f"worker{i}"): _status(p) for i, p in enumerate(sorted(tree))}


def _round_trip(sandbox, pod, plugin, name: str, security: SecurityContext | None, env: dict[str, str],
                workers: int, worker_uid: int | None = None, nofile: int | None = None) -> tuple[dict, str]:
    """Checkpoint a server, restore it into another pod (RLIMIT_NOFILE ``nofile`` there); check the
    restored tree's state, its processes' /proc status against the target spec and the limit.
    Returns the source's first answer and the target's container id."""
    run = dict(command=[PYTHON, "-c", SERVER], mounts=host_python_mounts(),
               env={**ENV, **env, "WORKERS": str(workers)})
    kw = {"security": security} if security else {}
    a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
    src = sandbox.run_container(a, "app", IMAGE, **kw, **run)
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st
    spec = sandbox.containerd().get_spec(src)
    want = {"parent": _expected(spec), **{f"worker{i + 1}": _expected(spec, worker_uid) for i in range(workers)}}
    source_tree = _tree_in(sandbox, src)
    assert _statuses(source_tree) == want
    first = _answer(sandbox, a.id)
    assert first["count"] == "1" and len(first["tokens"].split(",")) == max(workers, 1), first

    b = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
    dst = sandbox.cri.create_container(b, "app", IMAGE, **kw, **run)
    if nofile is not None:  # a lower limit in the target: the agent lowers the restored processes'
        assert all(rlimits.read_proc_limits(p)[resource.RLIMIT_NOFILE][1] > nofile for p in source_tree)
        _edit_spec(sandbox, dst, lambda spec: spec["process"].update(
            rlimits=[{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}]))
    sandbox.cri.start_container(dst)
    st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "restored", st
    # the source's state as it was dumped: its workers' tokens, the count before any request
    assert _answer(sandbox, b.id) == first
    target = sandbox.containerd().get_spec(dst)
    assert _expected(target) == want["parent"]
    tree = _tree_in(sandbox, dst)
    assert _statuses(tree) == want
    if nofile is not None:
        for pid in tree:
            assert rlimits.read_proc_limits(pid)[resource.RLIMIT_NOFILE] == (nofile, nofile), pid
    return first, dst


@pytest.mark.parametrize("path", ["bulk", "stream"])
def test_restricted_multiprocess_server_checkpoints_and_restores(sandbox, pod, plugin, path):
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": path}
    plugin.start()
    try:
        name = f"restricted-{path}"
        first, _ = _round_trip(sandbox, pod, plugin, name, restricted(), {}, workers=2, nofile=512)
        assert first["uid"] == str(USER)
        if path == "bulk":  # the same artifact into a container of another user: refused, cold
            c = pod(f"other-user-{name}", annotations={"rekindle.dev/restore": name})
            sandbox.run_container(c, "app", IMAGE, security=restricted(user=2000), command=[PYTHON, "-c", SERVER],
                                  mounts=host_python_mounts(), env={**ENV, "WORKERS": "2"})
            st = wait_status(plugin, "default", c.name, "app", {"restored", "cold-start"}, timeout=120)
            assert st["phase"] == "cold-start", st
            assert f"source runs as uid {USER}, target as uid 2000" in st["reason"], st
            cold = _answer(sandbox, c.id)
            assert cold["uid"] == "2000" and cold["count"] == "1" and cold["tokens"] != first["tokens"], cold
    finally:
        plugin.kill()
        plugin.env = {}
        plugin.start()


def test_restricted_single_process_server_checkpoints_and_restores(sandbox, pod, plugin):
    first, _ = _round_trip(sandbox, pod, plugin, "restricted-single", restricted(), {}, workers=0, nofile=512)
    assert first["uid"] == str(USER)


def test_root_parent_with_workers_of_another_user_checkpoints_and_restores(sandbox, pod, plugin):
    """A web server's shape: the parent stays root (the runtime's default capabilities), its workers
    drop to nobody; each process comes back with its own credentials."""
    first, _ = _round_trip(sandbox, pod, plugin, "root-and-nobody", None, {"WORKER_UID": str(NOBODY)}, workers=2,
                           worker_uid=NOBODY)
    assert first["uid"] == "0"
