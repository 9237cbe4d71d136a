"""CRIU mechanics on real runc containers: dump a workload tree, restore it into another container.

Two runc containers are built by hand (busybox-static rootfs on overlay, own netns joined by a veth
pair with different IPs, the real rekindle-init as PID 1). The source runs a shell counter; the
target's init waits in restore mode. No containerd is involved: this exercises runtime.container.containers,
runtime.criu.command and runtime.criu.executor alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from runtime.container.containers import ContainerInfo, inspect_bundle, ns_pids, process_tree, workload_root
from runtime.criu import command as criu_mod
from runtime.criu.executor import DumpResult, dump_workload, restore_into
from runtime.errors import CriuError
from runtime.layout import MountPlanEntry
from runtime.proc.tasks import signal_all
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUSYBOX = "/bin/busybox"
APPLETS = ["sh", "sleep", "cat", "echo", "ls", "true", "kill", "hostname"]
LOOP = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; echo tick $i; sleep 0.2; done"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("runc", "nsenter", "unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    if not os.path.exists(BUSYBOX):
        return "busybox-static is missing"
    with open(BUSYBOX, "rb") as f:
        if b"PT_INTERP" in f.read(0) or b"/ld-linux" in f.read(4096):
            return f"{BUSYBOX} is not static (install busybox-static)"
    try:
        v = criu_mod.criu_version()
    except CriuError as e:
        return f"criu unusable: {e}"
    if (criu_mod.version_tuple(v) or ()) < criu_mod.MIN_VERSION:
        return f"criu {v} < {'.'.join(map(str, criu_mod.MIN_VERSION))}"
    return None


class Drain:
    """Collects everything written to a pipe whose write end the container holds."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.buf = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            chunk = os.read(self.r, 65536)
            if not chunk:
                return
            with self.lock:
                self.buf += chunk

    def text(self) -> str:
        with self.lock:
            return self.buf.decode(errors="replace")

    def ticks(self) -> list[int]:
        return [int(x) for x in re.findall(r"^tick (\d+)$", self.text(), re.M)]


@dataclass
class Ctr:
    name: str
    bundle: str
    control: str
    data: str
    proc: subprocess.Popen[bytes]
    out: Drain
    info: ContainerInfo | None = None
    extra: dict[str, str] = field(default_factory=dict)


class Lab:
    def __init__(self, base: str, init_bin: str) -> None:
        self.base = base
        self.tag = uuid.uuid4().hex[:6]
        self.runc_root = os.path.join(base, "runc")
        self.init_dir = os.path.join(base, "initbin")
        os.makedirs(self.init_dir)
        shutil.copy2(init_bin, os.path.join(self.init_dir, "rekindle-init"))
        self.lower = os.path.join(base, "lower")
        for d in ("bin", "proc", "sys", "dev", "tmp", "etc", "rekindle", ".rekindle/bin", "data"):
            os.makedirs(os.path.join(self.lower, d), exist_ok=True)
        shutil.copy2(BUSYBOX, os.path.join(self.lower, "bin/busybox"))
        for a in APPLETS:
            os.symlink("busybox", os.path.join(self.lower, "bin", a))
        open(os.path.join(self.lower, "etc/marker"), "w").close()
        os.chmod(os.path.join(self.lower, "tmp"), 0o1777)
        self.netns: list[str] = []
        self.ctrs: list[Ctr] = []
        self.mounts: list[str] = []

    def make_netns_pair(self) -> tuple[str, str]:
        a, b = f"rk{self.tag}a", f"rk{self.tag}b"
        for n in (a, b):
            subprocess.run(["ip", "netns", "add", n], check=True)
            self.netns.append(n)
            subprocess.run(["ip", "-n", n, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "link", "add", f"v{self.tag}a", "netns", a, "type", "veth",
                        "peer", "name", f"v{self.tag}b", "netns", b], check=True)
        for n, side, ip in ((a, "a", "10.213.7.1/24"), (b, "b", "10.213.7.2/24")):
            subprocess.run(["ip", "-n", n, "addr", "add", ip, "dev", f"v{self.tag}{side}"], check=True)
            subprocess.run(["ip", "-n", n, "link", "set", f"v{self.tag}{side}", "up"], check=True)
        return a, b

    def start(self, name: str, netns: str, args: list[str]) -> Ctr:
        bundle = os.path.join(self.base, name)
        for d in ("upper", "work", "rootfs"):
            os.makedirs(os.path.join(bundle, d))
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.lower},upperdir={bundle}/upper,workdir={bundle}/work",
                        f"{bundle}/rootfs"], check=True)
        self.mounts.append(f"{bundle}/rootfs")
        control, data = os.path.join(self.base, f"{name}-control"), os.path.join(self.base, f"{name}-data")
        os.makedirs(control)
        os.makedirs(data)
        subprocess.run(["runc", "spec", "--bundle", bundle], check=True)
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
        spec["process"].update(terminal=False, args=args, cwd="/", env=["PATH=/bin"])
        spec["root"] = {"path": "rootfs", "readonly": False}
        spec["hostname"] = f"host-{name}"
        spec["mounts"] += [
            {"destination": "/.rekindle/bin", "type": "bind", "source": self.init_dir, "options": ["bind", "ro"]},
            {"destination": "/rekindle", "type": "bind", "source": control, "options": ["bind", "rw"]},
            {"destination": "/data", "type": "bind", "source": data, "options": ["rbind", "rw"]},
            {"destination": "/etc/marker", "type": "bind", "source": os.path.join(self.lower, "etc/marker"),
             "options": ["bind", "ro"]},
        ]
        spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
        spec["linux"]["namespaces"].append({"type": "network", "path": f"/var/run/netns/{netns}"})
        spec["linux"]["cgroupsPath"] = f"/rekindle-e2e-{self.tag}/{name}"
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(spec, f)
        out = Drain()
        proc = subprocess.Popen(
            ["runc", "--root", self.runc_root, "run", "--pid-file", f"{bundle}/init.pid", "--bundle", bundle,
             f"{name}-{self.tag}"],
            stdin=subprocess.DEVNULL, stdout=out.w, stderr=out.w)
        os.close(out.w)
        ctr = Ctr(name, bundle, control, data, proc, out)
        self.ctrs.append(ctr)
        wait_for(lambda: os.path.exists(f"{bundle}/init.pid") and os.path.getsize(f"{bundle}/init.pid"), 20,
                 f"{name} to start")
        ctr.info = inspect_bundle(bundle, f"{name}-{self.tag}")
        return ctr

    def close(self) -> None:
        for c in self.ctrs:
            subprocess.run(["runc", "--root", self.runc_root, "kill", f"{c.name}-{self.tag}", "KILL"],
                           capture_output=True, timeout=10)
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.proc.kill()
            subprocess.run(["runc", "--root", self.runc_root, "delete", "-f", f"{c.name}-{self.tag}"],
                           capture_output=True, timeout=10)
        for m in self.mounts:
            subprocess.run(["umount", "-l", m], capture_output=True)
        for n in self.netns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        for d in ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd", "unified"):
            p = f"/sys/fs/cgroup/{d}/rekindle-e2e-{self.tag}"
            if os.path.isdir(p):
                subprocess.run(["rmdir", p], capture_output=True)


@dataclass
class Env:
    lab: Lab
    source: Ctr
    target: Ctr
    images: str
    work: str
    dump: DumpResult
    count_at_dump: int


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    make = subprocess.run(["make", "-C", REPO, "build/rekindle-init"], capture_output=True, text=True, timeout=300)
    init_bin = os.path.join(REPO, "build", "rekindle-init")
    if make.returncode != 0 or not os.path.exists(init_bin):
        pytest.skip(f"build/rekindle-init does not build: {make.stderr[-300:]}")
    base = tempfile.mkdtemp(prefix="rekindle-criu-")
    lab = Lab(base, init_bin)
    try:
        na, nb = lab.make_netns_pair()
        init = "/.rekindle/bin/rekindle-init"
        src = lab.start("src", na, [init, "--mode", "source", "--control", "/rekindle", "--", "/bin/sh", "-c", LOOP])
        dst = lab.start("dst", nb, [init, "--mode", "restore", "--control", "/rekindle", "--timeout", "300",
                                    "--", "/bin/sh", "-c", "echo cold start; sleep 1000"])
        wait_for(lambda: len(src.out.ticks()) >= 5, 20, "source ticks")
        images, work = os.path.join(base, "img", "criu"), os.path.join(base, "work")
        assert src.info is not None
        dump = dump_workload(src.info, images, leave_running=True, work_dir=os.path.join(base, "dumpwork"))
        with open(os.path.join(src.bundle, "rootfs/tmp/count")) as f:
            count = int(f.read())
        yield Env(lab, src, dst, images, work, dump, count)
    finally:
        lab.close()
        shutil.rmtree(base, ignore_errors=True)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _pidns_members(info: ContainerInfo) -> list[int]:
    ino = info.namespaces["pid"].inode
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}/ns/pid").st_ino == ino:
                    out.append(int(p))
            except OSError:
                pass
    return out


def test_dump_result(env: Env) -> None:
    d = env.dump
    assert d.root_ns_pid >= 2 and not d.shell_job  # rekindle-init gives the workload its own session
    dests = {e.destination: e for e in d.mount_plan}
    for dest in ("/.rekindle/bin", "/rekindle", "/data", "/etc/marker"):
        assert dests[dest].type == "bind"
    assert any(e.type in ("cgroup", "cgroup2") for e in d.mount_plan)
    assert [e.key for e in d.mount_plan] == [f"m{i}" for i in range(len(d.mount_plan))]
    assert d.stdio[1].startswith("pipe:[")
    assert os.path.exists(os.path.join(env.images, "pstree.img"))
    # leave_running: the source goes on counting
    n = len(env.source.out.ticks())
    wait_for(lambda: len(env.source.out.ticks()) > n, 5, "source to keep ticking")


def test_restore_fails_cleanly(env: Env) -> None:
    target = env.target.info
    assert target is not None
    bogus = env.dump.mount_plan + [MountPlanEntry("m99", "/nowhere", "bind")]
    with pytest.raises(CriuError, match=r"m99 \(/nowhere"):
        restore_into(target, env.images, bogus, env.dump.stdio, work_dir=os.path.join(env.work, "bad1"))
    # an image mount without a mapping: CRIU itself fails, with its log
    partial = [e for e in env.dump.mount_plan if e.destination != "/data"]
    with pytest.raises(CriuError) as ei:
        restore_into(target, env.images, partial, env.dump.stdio, work_dir=os.path.join(env.work, "bad2"))
    assert ei.value.log_path and os.path.getsize(ei.value.log_path) > 0
    # the target is untouched: only its init lives in its pid namespace, still waiting
    wait_for(lambda: _pidns_members(target) == [target.init_pid], 5, "leftovers of the failed restore to go")
    assert env.target.proc.poll() is None
    assert not os.path.exists(os.path.join(env.target.control, "cold-start"))


def test_restore_into_target(env: Env) -> None:
    target = env.target.info
    assert target is not None
    res = restore_into(target, env.images, env.dump.mount_plan, env.dump.stdio, work_dir=os.path.join(env.work, "ok"))
    h = res.host_pid
    assert h in res.tree and _state(h) == "T"  # left stopped: the caller resumes it
    signal_all(res.tree, signal.SIGCONT)
    wait_for(lambda: _state(h) in ("S", "R"), 5, "the restored tree to run")
    # namespaces: pid (numbered inside the target's), net, ipc, uts
    assert ns_pids(h) == [h, res.ns_pid] and res.ns_pid == env.dump.root_ns_pid
    for kind in ("pid", "net", "ipc", "uts"):
        assert os.stat(f"/proc/{h}/ns/{kind}").st_ino == target.namespaces[kind].inode, kind
    assert os.stat(f"/proc/{h}/ns/net").st_ino != env.source.info.namespaces["net"].inode  # type: ignore[union-attr]
    # cgroups: every hierarchy the target init is in
    with open(f"/proc/{h}/cgroup") as a, open(f"/proc/{target.init_pid}/cgroup") as b:
        assert a.read() == b.read()
    # root is the target rootfs; hostname is the target's again
    st_root, st_fs = os.stat(f"/proc/{h}/root/"), os.stat(target.rootfs)
    assert (st_root.st_dev, st_root.st_ino) == (st_fs.st_dev, st_fs.st_ino)
    host = subprocess.run(["nsenter", "-t", str(h), "-u", "--", "cat", "/proc/sys/kernel/hostname"],
                          capture_output=True, text=True, timeout=10).stdout.strip()
    assert host == "host-dst"
    # parent is the target init; stdout is the target's log pipe
    assert workload_root(target).host == h
    assert os.readlink(f"/proc/{h}/fd/1") == os.readlink(f"/proc/{target.init_pid}/fd/1")
    assert len(process_tree(h)) >= 1
    # the counter continued in memory from where it was dumped, into the target's log and rootfs
    ticks = wait_for(lambda: env.target.out.ticks() if len(env.target.out.ticks()) >= 3 else None, 10,
                     "ticks in the target's log")
    assert isinstance(ticks, list) and ticks[0] > 1 and ticks[0] >= env.count_at_dump
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))
    with open(os.path.join(target.upperdir, "tmp/count")) as f:
        assert int(f.read()) >= ticks[0]
    # the agent's part of the protocol: the init adopts the restored root
    for fname, content in (("restore-pid", str(res.ns_pid)), ("restore-complete", "")):
        tmp = os.path.join(env.target.control, f".{fname}.tmp")
        with open(tmp, "w") as f:
            f.write(content)
        os.rename(tmp, os.path.join(env.target.control, fname))
    time.sleep(0.5)  # the init polls every 50 ms
    assert env.target.proc.poll() is None
    assert not os.path.exists(os.path.join(env.target.control, "cold-start"))
    os.kill(h, signal.SIGKILL)
    rc = env.target.proc.wait(timeout=10)
    assert rc == 128 + signal.SIGKILL, env.target.out.text()[-500:]


# ---- the same through containerd + CRI: two pods, per-container pid namespaces, CNI ----

def test_restore_into_other_pod_via_containerd(sandbox, pod) -> None:  # type: ignore[no-untyped-def]
    from devtools.cri import ContainerState, Mount
    from runtime.container.containers import resolve_container

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    init_bin = os.path.join(REPO, "build", "rekindle-init")
    if subprocess.run(["make", "-C", REPO, "build/rekindle-init"], capture_output=True, timeout=300).returncode:
        pytest.skip("build/rekindle-init does not build")
    base = tempfile.mkdtemp(prefix="rekindle-criu-cri-")
    try:
        bindir = os.path.join(base, "bin")
        os.makedirs(bindir)
        shutil.copy2(init_bin, os.path.join(bindir, "rekindle-init"))
        init = "/.rekindle/bin/rekindle-init"
        ids, ctl = {}, {}
        for side, mode, cmd in (("src", "source", LOOP), ("dst", "restore", "echo cold start; sleep 1000")):
            ctl[side] = os.path.join(base, f"{side}-control")
            os.makedirs(ctl[side])
            os.makedirs(os.path.join(base, f"{side}-data"))
            p = pod(f"criu-{side}")
            ids[side] = sandbox.run_container(
                p, "main", "localhost/rekindle/busybox:1",
                command=[init, "--mode", mode, "--control", "/rekindle", "--timeout", "300", "--",
                         "/bin/sh", "-c", cmd],
                mounts=[Mount("/.rekindle/bin", bindir, readonly=True), Mount("/rekindle", ctl[side]),
                        Mount("/data", os.path.join(base, f"{side}-data"))])
        state = str(sandbox.state_dir)
        src = resolve_container(state, ids["src"])
        dst = resolve_container(state, ids["dst"])
        assert src.namespaces["net"].inode != dst.namespaces["net"].inode
        wait_for(lambda: len(_log_ticks(sandbox, ids["src"])) >= 5, 30, "source ticks")
        dump = dump_workload(src, os.path.join(base, "img"), work_dir=os.path.join(base, "dumpwork"))
        dests = {e.destination for e in dump.mount_plan}
        assert {"/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/dev/shm", "/rekindle", "/data"} <= dests
        assert dump.shm_source and os.path.isdir(dump.shm_source)
        at_dump = max(_log_ticks(sandbox, ids["src"]))
        res = restore_into(dst, os.path.join(base, "img"), dump.mount_plan, dump.stdio,
                           work_dir=os.path.join(base, "restorework"))
        signal_all(res.tree, signal.SIGCONT)
        for kind in ("pid", "net", "ipc", "uts"):
            assert os.stat(f"/proc/{res.host_pid}/ns/{kind}").st_ino == dst.namespaces[kind].inode, kind
        with open(f"/proc/{res.host_pid}/cgroup") as a, open(f"/proc/{dst.init_pid}/cgroup") as b:
            assert a.read() == b.read()
        for name, content in (("restore-pid", str(res.ns_pid)), ("restore-complete", "")):
            with open(os.path.join(ctl["dst"], f".{name}"), "w") as f:
                f.write(content)
            os.rename(os.path.join(ctl["dst"], f".{name}"), os.path.join(ctl["dst"], name))
        # the restored counter writes into the target container's CRI log, continuing
        ticks = wait_for(lambda: _log_ticks(sandbox, ids["dst"]) if len(_log_ticks(sandbox, ids["dst"])) >= 3
                         else None, 15, "ticks in the target's log")
        assert isinstance(ticks, list) and ticks[0] > 1 and ticks[0] <= at_dump + 1
        # exec reaches it (same pid namespace), and the hostname is the target pod's
        r = sandbox.cri.exec_sync(ids["dst"], ["/bin/sh", "-c", f"kill -0 {res.ns_pid} && hostname"])
        assert r.exit_code == 0 and r.out.strip() == "criu-dst", r
        assert not os.path.exists(os.path.join(ctl["dst"], "cold-start"))
        # stopping the container reaches the restored process through the init
        sandbox.cri.stop_container(ids["dst"], grace_seconds=10)
        st = sandbox.cri.wait_container(ids["dst"], timeout=20)
        assert st.state is ContainerState.EXITED and st.exit_code == 128 + signal.SIGTERM, st
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _log_ticks(sandbox, cid: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(m.group(1)) for ln in sandbox.cri.logs(cid) if (m := re.fullmatch(r"tick (\d+)", ln.strip()))]
