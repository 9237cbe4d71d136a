"""The trust boundary, tried as an attacker would, through real containerd + runc + CRIU + CNI.

- No container binary ever runs with the plugin's privileges: the source tenant replaces
  /bin/sh (and the writable layer carries it into the restored container) with a script that
  records its uid and capabilities; a checkpoint, a restore and the creation of GPU device nodes
  in the restored container must never run it.
- The bytes used are the bytes verified: while a restore is under way (after its artifact was
  opened and staged, right before CRIU), another tenant renames the version directory and puts
  other content in its place, points the name at another signed version, or rewrites a listed
  file through a hard link. The restore either comes back with exactly the version it opened or
  fails with the tampered file named, and then nothing of it ever ran.
- Host files are the checkpoint's: a source maps a "library" and holds a file open from a
  host directory bound in (as the NVIDIA toolkit binds libcuda.so). A restore with the same
  files there runs warm and reads them; after the library was rewritten with other bytes of the
  same size (all CRIU checks), the restore starts cold and says which file differs.
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from devtools.cri import Mount
from tests.waiting import wait_for

COUNTER = "localhost/rekindle/counter:1"
INIT = "/.rekindle/bin/rekindle-init"
RECORDER = ("#!/bin/busybox sh\n"
            "echo \"uid=$(/bin/busybox id -u) $(/bin/busybox grep CapEff /proc/self/status)\" "
            "> /rekindle/sh-ran-$$\n"
            "exec /bin/busybox sh \"$@\"\n")


def get(ip: str, path: str = "/", timeout: float = 3.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=timeout) as r:
        return r.read().decode()


def count(ip: str) -> int:
    return int(get(ip).split("count=")[1].split()[0])


def checkpoint(sandbox, pod, plugin, name: str, pod_name: str, requests: int,  # type: ignore[no-untyped-def]
               shell: str = "", env: dict[str, str] | None = None, mounts: tuple[Mount, ...] = ()):
    """A counter server checkpointed after ``requests`` requests; the test says when it is ready
    (the workload does not), so the checkpoint cannot precede the requests."""
    from runtime.status import Phase, StatusBook
    # overwrite: the race tests publish a second version under the same name on purpose.
    a = pod(pod_name, annotations={"rekindle.dev/checkpoint": name, "rekindle.dev/overwrite": "true"})
    script = f"{shell}unset REKINDLE_CONTROL_DIR; exec /usr/local/bin/counter-server 8080"
    sandbox.run_container(a, "server", COUNTER, command=["/bin/busybox", "sh", "-c", script],
                          env={"WARMUP_MIB": "64", **(env or {})}, mounts=list(mounts))
    ip = sandbox.cri.pod_ip(a.id)
    wait_until_served(lambda: get(ip, "/healthz", 1.0), 30, "the source to serve")
    for _ in range(requests):
        get(ip)
    ctl = plugin.control_dir(a.uid, "server")
    (ctl / "ready-for-checkpoint").write_text("ready\n")
    st = StatusBook(plugin.state_dir).wait("default", a.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 90)
    assert st is not None and st.phase is Phase.PUBLISHED, (st, plugin.log()[-3000:])
    return a, ip, ctl


def test_no_container_binary_runs_with_the_plugins_privileges(sandbox, pod, plugin):
    from runtime.container.containers import resolve_container
    from runtime.container.namespaces import host_pid_of
    from runtime.gpu.target import ensure_device_nodes
    from runtime.status import Phase, StatusBook

    plant = (f"/bin/busybox rm -f /bin/sh && /bin/busybox printf '%s' '{RECORDER}' > /bin/sh && "
             "/bin/busybox chmod 755 /bin/sh && ")
    a, _ip, a_ctl = checkpoint(sandbox, pod, plugin, "planted-sh", "src-planted", 2, shell=plant)
    b = pod("dst-planted", annotations={"rekindle.dev/restore": "planted-sh"})
    b_cid = sandbox.run_container(b, "server", COUNTER, command=["/usr/local/bin/counter-server", "8080"])
    st = StatusBook(plugin.state_dir).wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 90)
    assert st is not None and st.phase is Phase.RESTORED, (st, plugin.log()[-3000:])
    b_ctl = plugin.control_dir(b.uid, "server")
    # The tenant's /bin/sh came along with the writable layer: it is there to be run.
    target = resolve_container(str(sandbox.state_dir), b_cid)
    assert Path(target.rootfs, "bin/sh").read_text().startswith("#!/bin/busybox sh")
    # A restore onto a GPU with another UUID creates the target's device nodes in the restored
    # process's /dev: from the host, by syscalls.
    ns_pid = int((b_ctl / "restore-pid").read_text())
    host_pid = host_pid_of(target.namespaces["pid"].inode, ns_pid)
    spec = dict(target.spec)
    spec["linux"] = {**spec.get("linux", {}), "devices": [
        {"path": "/dev/nvidia7", "type": "c", "major": 195, "minor": 7, "fileMode": 0o666}]}
    ensure_device_nodes(host_pid, spec)
    st_dev = os.stat(f"/proc/{host_pid}/root/dev/nvidia7")
    assert (os.major(st_dev.st_rdev), os.minor(st_dev.st_rdev)) == (195, 7)
    ran = sorted(p.name + ": " + p.read_text().strip() for d in (a_ctl, b_ctl) for p in d.glob("sh-ran-*"))
    assert ran == [], f"a container binary ran during checkpoint/restore: {ran}"
    # The recorder works: the same script run by the container itself leaves a record.
    sandbox.cri.exec_sync(b_cid, ["/bin/sh", "-c", "true"], timeout=10)
    assert list(b_ctl.glob("sh-ran-*")), "the recorder did not record (the test could not fail)"


# --- races on the shared store ---------------------------------------------------------------------

def _attack_rename(store_ns: Path, opened: Path, older: Path) -> None:
    """The opened version's directory renamed away; other (validly signed) content in its place."""
    opened.rename(opened.with_name(opened.name + "-moved"))
    shutil.copytree(older, opened)


def _attack_republish(store_ns: Path, opened: Path, older: Path) -> None:
    """The name switched to another signed version of the same name (and the opened one removed,
    as a publish does on a node that holds no lock)."""
    name = store_ns / "raced"
    if name.is_symlink():
        tmp = store_ns / ".link-attack"
        tmp.symlink_to(older.name)
        tmp.rename(name)
        shutil.rmtree(opened, ignore_errors=True)
    else:  # a layout where the name is the directory: a re-publish renames over it
        name.rename(store_ns / ".trash-attack")
        shutil.copytree(older, name)
        shutil.rmtree(store_ns / ".trash-attack")


def _attack_hardlink(store_ns: Path, opened: Path, older: Path) -> None:
    """The largest listed file (the memory pages) rewritten through a hard link made elsewhere."""
    biggest = max((p for p in opened.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    alias = store_ns.parent / "alias"
    os.link(biggest, alias)
    with open(alias, "r+b") as f:
        f.seek(biggest.stat().st_size // 2 // 4096 * 4096)
        f.write(b"\xa5" * 4096)


@pytest.mark.parametrize("attack", [_attack_rename, _attack_republish, _attack_hardlink],
                         ids=["rename", "republish", "hardlink-rewrite"])
def test_a_restore_uses_only_the_bytes_it_verified(sandbox, pod, plugin, tmp_path, monkeypatch, attack):
    import runtime.restore as restore_flow
    from nri_plugin.outcomes import classify
    from runtime.compat import NodeFacts
    from runtime.container.containers import resolve_container
    from runtime.control import ControlDir
    from runtime.errors import Reason, RekindleError
    from runtime.store.keys import read_key
    from runtime.store.volume import ArtifactStore

    # v1 (count 3) is kept aside, as anyone with the store mounted can; v2 (count 7) is current.
    _a1, _ip1, _ = checkpoint(sandbox, pod, plugin, "raced", f"src-raced-1-{attack.__name__[8:]}", 2)
    ns_dir = Path(plugin.store) / "default"
    older = Path(os.path.realpath(ns_dir / "raced"))
    keep = tmp_path / "older"
    shutil.copytree(older, keep)
    _a2, ip2, _ = checkpoint(sandbox, pod, plugin, "raced", f"src-raced-2-{attack.__name__[8:]}", 6)
    opened = Path(os.path.realpath(ns_dir / "raced"))
    if older == opened:  # a layout without versions: the attacker keeps the copy elsewhere
        older = ns_dir / ".older-copy"
    if not older.exists():
        shutil.copytree(keep, older)  # the older version, put back by the attacker

    ctl = tmp_path / "control"
    ctl.mkdir(mode=0o777)
    b = pod(f"dst-raced-{attack.__name__[8:]}")
    cid = sandbox.run_container(
        b, "server", COUNTER,
        command=[INIT, "--mode", "restore", "--control", "/rekindle", "--timeout", "300", "--",
                 "/usr/local/bin/counter-server", "8080"],
        mounts=[Mount("/.rekindle/bin", str(plugin.state_dir / "bin"), readonly=True),
                Mount("/rekindle", str(ctl)), Mount("/snapshot-control", str(ctl))])  # as the plugin mounts it

    real = restore_flow.restore_into

    def attacked(*args, **kwargs):  # type: ignore[no-untyped-def]
        attack(ns_dir, opened, older)  # after the artifact was opened and checked, before CRIU
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_flow, "restore_into", attacked)
    req = restore_flow.RestoreRequest(
        containerd_state=str(sandbox.state_dir), container_id=cid, namespace="default", name="raced",
        image="", image_ref="", log_dir=str(tmp_path / "logs"))
    key = read_key(plugin.state_dir / "hmac.key")
    target = resolve_container(str(sandbox.state_dir), cid)
    try:
        restore_flow.restore(req, ArtifactStore(str(plugin.store)), key, NodeFacts.detect(),
                             control=ControlDir(ctl), check_image=False)
    except RekindleError as exc:
        # Only a tampered file may stop it; and then nothing of the restore ever ran.
        # Refused as an integrity failure: by the whole file's digest or by a chunk's.
        assert attack is _attack_hardlink and classify(str(exc)) is Reason.INTEGRITY, exc
        # The stopped tree was killed (SIGKILL): gone once the init has reaped it.
        def alone() -> bool:
            members = [p for p in os.listdir("/proc") if p.isdigit() and _in_pidns(p, target.namespaces["pid"].inode)]
            return members == [str(target.init_pid)]
        wait_until_served(alone, 10, "the killed restore to be reaped")
        return
    assert attack is not _attack_hardlink, "a rewritten pages file was restored"
    ip = sandbox.cri.pod_ip(b.id)
    wait_until_served(lambda: get(ip, "/healthz", 1.0), 30, "the restored server")
    # Exactly the version opened (v2): the same next count as v2's source, and its memory intact.
    assert count(ip) == count(ip2)
    assert "verify=ok" in get(ip, "/verify")


def _in_pidns(pid: str, inode: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino == inode
    except OSError:
        return False


# --- host files from bind mounts ------------------------------------------------------------------

LIB = b"version-A of a host library\n" + bytes(range(256)) * 64
HELD = b"a file the workload holds open\n"


def _host_files_source(sandbox, pod, plugin, tmp_path: Path, name: str):  # type: ignore[no-untyped-def]
    """A source that maps /hostlib/libhost.so (then closes it) and holds /hostlib/held.txt open
    on fd 3, both from a host directory bound in read-only; checkpointed."""
    lib = tmp_path / "hostlib"
    lib.mkdir()
    (lib / "libhost.so").write_bytes(LIB)
    (lib / "held.txt").write_bytes(HELD)
    mount = Mount("/hostlib", str(lib), readonly=True)
    a, ip, _ = checkpoint(sandbox, pod, plugin, name, f"src-{name}", 2, shell="exec 3</hostlib/held.txt; ",
                          env={"MAP_FILE": "/hostlib/libhost.so", "WARMUP_MIB": "0"}, mounts=(mount,))
    assert get(ip, "/mapped") == "mapped=version-A of a host library\n"
    return lib, mount


def test_a_restore_with_the_same_host_files_runs_warm_and_reads_them(sandbox, pod, plugin, tmp_path):
    from runtime.digests import new_hash
    from runtime.status import Phase, StatusBook
    from runtime.store.keys import read_key
    from runtime.store.volume import ArtifactStore
    _lib, mount = _host_files_source(sandbox, pod, plugin, tmp_path, "hostlib-same")
    with ArtifactStore(str(plugin.store)).open("default", "hostlib-same",
                                               read_key(plugin.state_dir / "hmac.key")) as art:
        recorded = art.manifest.host_files
    # Both, and nothing of the image (the server's own binary, mapped too, is the image's).
    assert recorded is not None and [(h.mount, h.path, h.size, h.digest) for h in recorded] == [
        ("/hostlib", "held.txt", len(HELD), new_hash(HELD).hexdigest()),
        ("/hostlib", "libhost.so", len(LIB), new_hash(LIB).hexdigest())], recorded
    b = pod("dst-hostlib-same", annotations={"rekindle.dev/restore": "hostlib-same"})
    sandbox.run_container(b, "server", COUNTER, command=["/usr/local/bin/counter-server", "8080"], mounts=[mount])
    st = StatusBook(plugin.state_dir).wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 90)
    assert st is not None and st.phase is Phase.RESTORED, (st, plugin.log()[-3000:])
    ip = sandbox.cri.pod_ip(b.id)
    wait_until_served(lambda: get(ip, "/healthz", 1.0), 30, "the restored server")
    assert count(ip) == 3  # the source's process, continued
    assert get(ip, "/mapped") == "mapped=version-A of a host library\n"


def test_a_restore_whose_host_library_changed_with_the_same_size_starts_cold(sandbox, pod, plugin, tmp_path):
    """CRIU compares only sizes: without the digests this restore ran with other code mapped."""
    from runtime.status import Phase, StatusBook
    lib, mount = _host_files_source(sandbox, pod, plugin, tmp_path, "hostlib-changed")
    changed = LIB.replace(b"version-A", b"version-B")
    assert len(changed) == len(LIB)
    (lib / "libhost.so").write_bytes(changed)  # the host's driver updated in place, say
    b = pod("dst-hostlib-changed", annotations={"rekindle.dev/restore": "hostlib-changed"})
    sandbox.run_container(b, "server", COUNTER, command=["/usr/local/bin/counter-server", "8080"], mounts=[mount])
    st = StatusBook(plugin.state_dir).wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 90)
    ip = sandbox.cri.pod_ip(b.id)
    if st is not None and st.phase is Phase.RESTORED:
        mapped = wait_until_served(lambda: get(ip, "/mapped", 1.0), 30, "the restored server")
        pytest.fail(f"restored with the changed file mapped: GET /mapped -> {mapped!r}")
    assert st is not None and st.phase is Phase.COLD_START, (st, plugin.log()[-3000:])
    assert f"host file /hostlib/libhost.so ({lib}) differs from the checkpoint's" in st.reason, st.reason
    wait_until_served(lambda: get(ip, "/healthz", 1.0), 30, "the cold server")
    assert count(ip) == 1  # a fresh process, not a broken pod


T = TypeVar("T")


def wait_until_served(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``wait_for`` with a server that may not listen yet (OSError: not yet)."""
    return wait_for(fn, timeout, what, interval=0.1, ignore=(OSError,))


# --- the checkpoint side: a store writer racing the staging dir ----------------------------------

_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80
# What a checkpoint writes into its staging dir, and where CRIU writes: each planted as a symlink
# to a host file outside the store.
_PLANTED = ["restore-plan.json", "rootfs-diff.tar", "rootfs-deletions.json", ".owner.json",
            "manifest.json", "manifest.json.sig",
            *(f"criu/{img}" for img in ("inventory.img", "pstree.img", "stats-dump")),
            *(f"criu/{kind}-{pid}.img" for kind in ("pagemap", "pages", "mm", "core") for pid in range(1, 8)),
            *(f"criu/pages-{pid}.img.tmp" for pid in range(1, 8)),
            *(f"bulk/{kind}-{pid}.{ext}" for kind, ext in (("pagemap", "img"), ("pages", "bulk"))
              for pid in range(1, 8))]


class StoreWriter:
    """Another tenant or node writing the store: the moment a staging dir appears in the artifact's
    namespace dir (inotify), it plants symlinks to host files at every name the checkpoint writes,
    points ``criu/`` at a host directory, or swaps the whole staging dir for a symlink to one."""

    def __init__(self, ns_dir: Path, host: Path, mode: str) -> None:
        import ctypes
        import threading
        self.ns_dir, self.host, self.mode = ns_dir, host, mode
        self.planted: list[str] = []
        self._libc = ctypes.CDLL(None, use_errno=True)
        ns_dir.mkdir(parents=True, exist_ok=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self._fd >= 0 and self._libc.inotify_add_watch(
            self._fd, os.fsencode(ns_dir), _IN_CREATE | _IN_MOVED_TO) >= 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def victim(self, rel: str) -> Path:
        return self.host / ("victim-" + rel.replace("/", "_"))

    def _run(self) -> None:
        import select
        seen: set[str] = set()
        while not self._stop.is_set():
            select.select([self._fd], [], [], 0.05)
            try:
                os.read(self._fd, 65536)
            except BlockingIOError:
                pass
            for entry in os.scandir(self.ns_dir):
                if entry.name.startswith(".staging-") and entry.name not in seen:
                    seen.add(entry.name)
                    self._plant(self.ns_dir / entry.name)

    def _plant(self, staging: Path) -> None:
        try:
            if self.mode == "swap":
                os.rename(staging, staging.with_name(staging.name + "-moved"))
                os.symlink(self.host / "swapped", staging)
                self.planted.append("swap")
                return
            if self.mode == "criu-symlink":
                os.symlink(self.host / "criu-out", staging / "criu")
                self.planted.append("criu")
            for rel in _PLANTED:
                if self.mode == "criu-symlink" and rel.startswith("criu/"):
                    continue  # planted through its own link, they would land in the host dir
                path = staging / rel
                try:
                    path.parent.mkdir(exist_ok=True)
                    os.symlink(self.victim(rel), path)
                    self.planted.append(rel)
                except OSError:
                    pass  # the checkpoint made it first, or the dir is gone
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)


@pytest.mark.parametrize("mode", ["symlinks", "criu-symlink", "swap"])
def test_a_store_writer_racing_the_checkpoint_never_gets_a_host_file_written(sandbox, pod, plugin, tmp_path, mode):
    from runtime.status import Phase, StatusBook
    from runtime.store.keys import read_key
    from runtime.store.volume import ArtifactStore

    host = tmp_path / "host"  # host files outside the store, as /root/.ssh/authorized_keys would be
    for sub in ("swapped", "criu-out"):
        (host / sub).mkdir(parents=True)
    ns_dir = Path(plugin.store) / "default"
    writer = StoreWriter(ns_dir, host, mode)
    for rel in _PLANTED:
        writer.victim(rel).write_text("victim\n")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in host.iterdir() if p.is_file()}

    name, pod_name = f"racing-{mode}", f"src-racing-{mode}"
    a = pod(pod_name, annotations={"rekindle.dev/checkpoint": name})
    sandbox.run_container(a, "server", COUNTER, command=["/bin/busybox", "sh", "-c",
                          "unset REKINDLE_CONTROL_DIR; exec /usr/local/bin/counter-server 8080"],
                          env={"WARMUP_MIB": "64"})
    ip = sandbox.cri.pod_ip(a.id)
    wait_until_served(lambda: get(ip, "/healthz", 1.0), 30, "the source to serve")
    get(ip)
    try:
        (plugin.control_dir(a.uid, "server") / "ready-for-checkpoint").write_text("ready\n")
        st = StatusBook(plugin.state_dir).wait("default", a.name, "server",
                                               {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 120)
    finally:
        writer.close()
    assert st is not None, plugin.log()[-3000:]

    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in host.iterdir() if p.is_file()}
    assert after == before, f"host files written through the store ({writer.planted}): " + ", ".join(
        sorted(k for k in after if after.get(k) != before.get(k)))
    for sub in ("swapped", "criu-out"):
        assert os.listdir(host / sub) == [], f"the checkpoint wrote into {sub}: {os.listdir(host / sub)}"
    # Either a correct artifact, or a clean failure with the source still serving.
    assert count(ip) >= 1 and "verify=ok" in get(ip, "/verify")
    if st.phase is Phase.PUBLISHED:
        with ArtifactStore(str(plugin.store)).open("default", name, read_key(plugin.state_dir / "hmac.key")) as art:
            art.verify_files()
    else:
        assert writer.planted, "the checkpoint failed with nothing planted: " + st.reason
