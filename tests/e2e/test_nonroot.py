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
from runtime import rlimits
from tests.e2e.test_checkpoint_restore import _edit_spec, get, wait_status
from tests.e2e.test_stream_restore import _tree_in
from tests.waiting import wait_for

IMAGE = "localhost/rekindle/host-usr:1"
PYTHON = "/usr/bin/python3"  # the node's, readable by any uid (a venv under /root may not be)
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
USER, GROUP, EXTRA_GROUP = 1000, 1000, 3000

SERVER = r"""
import os, secrets, socket
workers = []
for _ in range(2):
    ask_r, ask_w = os.pipe()
    say_r, say_w = os.pipe()
    if os.fork() == 0:
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
    body = f"count={count} tokens={','.join(tokens)} uid={os.getuid()}\n"
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    conn.close()
"""

# /proc/<pid>/status fields that must be the target spec's after a restore
FIELDS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")


def restricted(user: int = USER) -> SecurityContext:
    return SecurityContext(run_as_user=user, run_as_group=GROUP, supplemental_groups=(EXTRA_GROUP,),
                           drop_capabilities=("ALL",), no_new_privs=True, seccomp_runtime_default=True)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return {k: " ".join(fields[k].split()) for k in FIELDS}


def _cap_mask(names: list[str]) -> str:
    assert not names, f"a restricted container holds no capability, the spec gives {names}"
    return "0" * 16


def _expected(spec: dict) -> dict[str, str]:
    """What /proc/<pid>/status must say for a process of this OCI spec."""
    process = spec["process"]
    user, caps = process["user"], process.get("capabilities") or {}
    uid, gid = str(user["uid"]), str(user["gid"])
    groups = " ".join(str(g) for g in sorted(set(user.get("additionalGids") or [])))
    return {"Uid": " ".join([uid] * 4), "Gid": " ".join([gid] * 4), "Groups": groups,
            "CapInh": _cap_mask(caps.get("inheritable") or []), "CapPrm": _cap_mask(caps.get("permitted") or []),
            "CapEff": _cap_mask(caps.get("effective") or []), "CapBnd": _cap_mask(caps.get("bounding") or []),
            "CapAmb": _cap_mask(caps.get("ambient") or []),
            "NoNewPrivs": "1" if process.get("noNewPrivileges") else "0",
            "Seccomp": "2" if (spec.get("linux") or {}).get("seccomp") else "0"}


def _fields(body: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in body.split())


@pytest.mark.parametrize("path", ["bulk", "stream"])
def test_restricted_multiprocess_server_checkpoints_and_restores(sandbox, pod, plugin, path):
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": path}
    plugin.start()
    try:
        name = f"restricted-{path}"
        run = dict(command=[PYTHON, "-c", SERVER], mounts=host_python_mounts(), env=ENV)
        a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
        src = sandbox.run_container(a, "app", IMAGE, security=restricted(), **run)
        st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
        assert st["phase"] == "published", st
        spec = sandbox.containerd().get_spec(src)
        want = _expected(spec)
        assert want["Uid"].split()[0] == str(USER) and str(EXTRA_GROUP) in want["Groups"].split(), want
        assert want["CapEff"] == "0" * 16 and want["NoNewPrivs"] == "1" and want["Seccomp"] == "2", want
        source_tree = _tree_in(sandbox, src)
        assert len(source_tree) == 3, source_tree
        for pid in source_tree:
            assert _status(pid) == want, (pid, _status(pid), want)
        first = _fields(get(sandbox.cri.pod_ip(a.id), "/", 60.0))
        assert first["count"] == "1" and first["uid"] == str(USER), first

        assert all(rlimits.read_proc_limits(p)[resource.RLIMIT_NOFILE][1] > 512 for p in source_tree)

        b = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
        dst = sandbox.cri.create_container(b, "app", IMAGE, security=restricted(), **run)
        # a lower limit in the target: the agent lowers the restored uid-1000 processes' own
        _edit_spec(sandbox, dst, lambda spec: spec["process"].update(
            rlimits=[{"type": "RLIMIT_NOFILE", "hard": 512, "soft": 512}]))
        sandbox.cri.start_container(dst)
        st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
        assert st["phase"] == "restored", st
        got = _fields(wait_for(lambda: get(sandbox.cri.pod_ip(b.id), "/", 60.0), 60,
                               "the restored tree to answer", ignore=(OSError,)))
        # the source's state as it was dumped: its workers' tokens, the count before any request
        assert got == first, (got, first)
        tree = _tree_in(sandbox, dst)
        assert len(tree) == 3, tree
        target = _expected(sandbox.containerd().get_spec(dst))
        assert target == want
        for pid in tree:
            assert _status(pid) == target, (pid, _status(pid), target)
            assert rlimits.read_proc_limits(pid)[resource.RLIMIT_NOFILE] == (512, 512), pid

        if path == "bulk":  # the same artifact into a container of another user: refused, cold
            c = pod(f"other-user-{name}", annotations={"rekindle.dev/restore": name})
            sandbox.run_container(c, "app", IMAGE, security=restricted(user=2000), **run)
            st = wait_status(plugin, "default", c.name, "app", {"restored", "cold-start"}, timeout=120)
            assert st["phase"] == "cold-start", st
            assert f"source runs as uid {USER}, target as uid 2000" in st["reason"], st
            cold = _fields(wait_for(lambda: get(sandbox.cri.pod_ip(c.id), "/", 60.0), 60,
                                    "the cold-started server to answer", ignore=(OSError,)))
            assert cold["uid"] == "2000" and cold["count"] == "1" and cold["tokens"] != first["tokens"], cold
    finally:
        plugin.kill()
        plugin.env = {}
        plugin.start()
