"""Checkpoint a stateful server in pod A by annotation, restore it into pod B, through the real
containerd 1.7.24 + runc + CRIU + CNI sandbox and the real plugin."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.plugin_process import PluginProcess
from tests.waiting import wait_for

COUNTER = "localhost/rekindle/counter:1"
SERVER = ["/usr/local/bin/counter-server", "8080"]


def get(ip: str, path: str = "/", timeout: float = 3.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=timeout) as r:
        return r.read().decode()


def wait_http(ip: str, timeout: float = 20.0) -> None:
    wait_for(lambda: get(ip, "/healthz", 1.0) is not None, timeout, f"{ip} to serve /healthz", interval=0.2,
             ignore=(OSError,))


def wait_status(plugin: PluginProcess, ns: str, pod: str, ctr: str, phases: set[str], timeout: float = 60.0) -> dict:
    from runtime.status import Phase, StatusBook
    st = StatusBook(plugin.state_dir).wait(ns, pod, ctr, {Phase(p) for p in phases}, timeout)
    if st is None or st.phase.value not in phases:
        raise AssertionError(f"status of {ns}/{pod}:{ctr} is {st.phase.value if st else None} "
                             f"({st.reason if st else ''}), wanted {phases}\nplugin log:\n{plugin.log()[-4000:]}")
    return json.loads(st.to_json())


def fields(body: str) -> dict[str, str]:
    """`count=4 pid=9 state=written-at-start 17 deleted=yes` -> dict (values may hold spaces)."""
    return dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", body.strip()))


def warm_up(ip: str, ready_file: Path, timeout: float = 20.0) -> None:
    """The 3 requests a source answers before it says ready (READY): the checkpoint follows them."""
    wait_http(ip, timeout)
    # Not ready by either signal yet, so no checkpoint can have started.
    assert not ready_file.exists(), f"{ready_file} was written before the requests"
    with pytest.raises(urllib.error.HTTPError, match="503"):
        get(ip, "/ready")
    for i in range(1, 4):
        assert fields(get(ip))["count"] == str(i)


# The source says ready only after warm_up's requests, by its ready file or GET /ready.
READY = {"READY_AFTER_REQUESTS": "3"}


def checkpoint_source(sandbox, pod, plugin, name: str, ns: str = "default", after: str | None = None,
                      probe: str | None = None, shm_marker: str | None = None, warmup_mib: int = 0):
    ann = {"rekindle.dev/checkpoint": name}
    if after:
        ann["rekindle.dev/after-checkpoint"] = after
    command = SERVER
    if probe:
        ann["rekindle.dev/ready-probe"] = probe
        # No ready file from the workload: only the probe can say it is ready.
        command = ["/bin/sh", "-c", "unset REKINDLE_CONTROL_DIR; exec " + " ".join(SERVER)]
    if shm_marker:
        # Written before the server listens, so it is in /dev/shm when the checkpoint runs.
        command = ["/bin/sh", "-c", f"printf '{shm_marker}' > /dev/shm/marker; exec " + " ".join(SERVER)]
    a = pod(f"src-{name}", ns, annotations=ann)
    env = {**READY, "WARMUP_MIB": str(warmup_mib)} if warmup_mib else READY
    cid = sandbox.run_container(a, "server", COUNTER, command=command, env=env)
    ip = sandbox.cri.pod_ip(a.id)
    warm_up(ip, plugin.control_dir(a.uid, "server") / "ready-for-checkpoint")
    st = wait_status(plugin, ns, a.name, "server", {"published", "checkpoint-failed"})
    assert st["phase"] == "published", st
    return a, cid, ip


def test_counter_server_continues_in_another_pod(sandbox, pod, plugin):
    a, a_cid, a_ip = checkpoint_source(sandbox, pod, plugin, "counter-a",
                                       shm_marker="shm content survives\n", warmup_mib=64)
    warm = get(a_ip, "/verify")
    assert fields(get(a_ip))["count"] == "4"  # the source keeps running by default

    b = pod("dst-counter-a", annotations={"rekindle.dev/restore": "counter-a"})
    b_cid = sandbox.run_container(b, "server", COUNTER, command=SERVER)
    b_ip = sandbox.cri.pod_ip(b.id)
    assert b_ip != a_ip
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "restored", st
    wait_http(b_ip)
    got = fields(get(b_ip))
    # In-memory counter continued from the checkpoint (3 requests + the probe-free state),
    # the file the server wrote and the image file it deleted are as they were.
    assert got["count"] == "4", got
    assert got["state"].startswith("written-at-start"), got
    assert got["deleted"] == "yes", got
    # The default route fills the 64 MiB of a CPU-only tree before it runs (too few to stream:
    # runtime.route), and says so in the container's timings.json.
    for phase in ("stage", "rootfs_apply", "criu_restore", "fill"):
        assert phase in st["timings"]
    route = json.loads((plugin.control_dir(b.uid, "server") / "timings.json").read_text())["route"]
    assert (route["path"], route["kind"]) == ("bulk", "bulk") and "64 MiB of pages" in route["reason"], route
    assert "default/counter-a: staged ahead" in plugin.log()  # by the prefetch, from RunPodSandbox on
    # The source's cold start (its start to ready, in the manifest) beside the restore's total:
    # a restore no faster says so.
    cold = st["timings"]["source_cold_start"]
    assert cold > 0 and bool(st["note"]) == (st["timings"]["total"] >= cold), st
    # The warm-up memory came back (64 MiB beside CRIU), byte for byte.
    assert get(b_ip, "/verify") == warm and "verify=ok" in warm
    # /dev/shm (the pod's shm, an external mount) came along.
    shm = sandbox.cri.exec_sync(b_cid, ["/bin/cat", "/dev/shm/marker"], timeout=10)
    assert shm.out == "shm content survives\n", shm
    # exec reaches the restored process; its output goes to B's log.
    res = sandbox.cri.exec_sync(b_cid, ["/bin/sh", "-c", "ps -o pid,args"], timeout=10)
    assert "counter-server" in res.out
    time.sleep(0.5)
    assert any("GET /" in line for line in sandbox.cri.logs(b_cid)), sandbox.cri.logs(b_cid)
    # Stopping the pod stops it.
    sandbox.cri.stop_container(b_cid, grace_seconds=5)
    assert sandbox.cri.container_status(b_cid).exit_code == 0


def test_restore_from_a_cold_page_cache(sandbox, pod, plugin):
    """The page cache dropped between checkpoint and restore (a node that rebooted, or memory
    taken by others): the prefetch and the fill read the artifact from disk, and the restored
    memory is byte for byte the source's."""
    a, _cid, a_ip = checkpoint_source(sandbox, pod, plugin, "cold-cache", warmup_mib=64)
    warm = get(a_ip, "/verify")
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    b, _b_cid, b_ip = restore_pod(sandbox, pod, plugin, "cold-cache", "dst-cold-cache")
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "restored", st
    wait_http(b_ip)
    assert fields(get(b_ip))["count"] == "4"
    assert get(b_ip, "/verify") == warm and "verify=ok" in warm
    # The prefetch ran over the bulk pages (it may end after the restore: wait for its line).
    line = re.compile(r"prefetched default/cold-cache: ([0-9.]+) MiB in")
    wait_for(lambda: line.search(plugin.log()), 30, "the prefetch to end")
    assert float(line.findall(plugin.log())[-1]) >= 64, plugin.log()[-3000:]


def restore_pod(sandbox, pod, plugin, artifact: str, name: str, ns: str = "default", security=None):
    b = pod(name, ns, annotations={"rekindle.dev/restore": artifact})
    kwargs = {"security": security} if security else {}
    cid = sandbox.run_container(b, "server", COUNTER, command=SERVER, **kwargs)
    ip = sandbox.cri.pod_ip(b.id)
    return b, cid, ip


def assert_cold(sandbox, plugin, b, cid, ip, reason_part: str, ns: str = "default") -> dict:
    st = wait_status(plugin, ns, b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "cold-start", st
    assert reason_part in st["reason"], st
    wait_http(ip)
    assert fields(get(ip))["count"] == "1"  # a fresh process, not a broken pod
    log = plugin.log()
    assert f"{ns}/{b.name}:server" in log and reason_part in log
    return st


def test_source_exits_when_annotated(sandbox, pod, plugin):
    a, a_cid, a_ip = checkpoint_source(sandbox, pod, plugin, "exit-after", after="exit")
    from devtools.cri import ContainerState
    st = sandbox.cri.wait_container(a_cid, states=(ContainerState.EXITED,), timeout=20)
    assert st.exit_code == 0  # the server's SIGTERM handler exits 0, the init passes it on
    assert (plugin.control_dir(a.uid, "server") / "snapshot-complete").read_text().strip() == "exit-after"


def test_flipped_byte_in_artifact_gives_cold_start(sandbox, pod, plugin):
    checkpoint_source(sandbox, pod, plugin, "flipped")
    pages = sorted((plugin.store / "default" / "flipped" / "criu").glob("pages-*.img"))[0]
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    b, cid, ip = restore_pod(sandbox, pod, plugin, "flipped", "dst-flipped")
    assert_cold(sandbox, plugin, b, cid, ip, "content changed")
    # The init ran the original command once, and says why.
    assert "content changed" in (plugin.control_dir(b.uid, "server") / "cold-start").read_text()


def test_a_byte_flipped_in_the_writable_layer_gives_a_cold_start(sandbox, pod, plugin):
    """The layer is read from the store while it is applied (neither the prefetch nor the stage
    copies it): a changed chunk is refused before any of it is used, and the pod starts cold."""
    checkpoint_source(sandbox, pod, plugin, "flipped-layer")
    layer = plugin.store / "default" / "flipped-layer" / "rootfs-diff.tar"
    assert (layer.parent / "rootfs-diff.tar.sums").is_file()
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    b, cid, ip = restore_pod(sandbox, pod, plugin, "flipped-layer", "dst-flipped-layer")
    assert_cold(sandbox, plugin, b, cid, ip, "rootfs-diff.tar: chunk 0 does not match its digest")


def test_tampered_manifest_is_refused(sandbox, pod, plugin):
    checkpoint_source(sandbox, pod, plugin, "tampered")
    manifest = plugin.store / "default" / "tampered" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["security"]["uid"] = 0
    doc["security"]["capabilities"] = sorted(set(doc["security"]["capabilities"]) | {"CAP_SYS_ADMIN"})
    manifest.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    b, cid, ip = restore_pod(sandbox, pod, plugin, "tampered", "dst-tampered")
    assert_cold(sandbox, plugin, b, cid, ip, "bad signature")
    # Refused at create: the container was left untouched (no init in front of it).
    out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "tr '\\0' ' ' < /proc/1/cmdline"], timeout=10).out
    assert out.startswith("/usr/local/bin/counter-server")


def test_artifact_of_another_namespace_is_invisible(sandbox, pod, plugin):
    checkpoint_source(sandbox, pod, plugin, "team-x-model", ns="team-x")
    b, cid, ip = restore_pod(sandbox, pod, plugin, "team-x-model", "dst-other-ns", ns="team-y")
    assert_cold(sandbox, plugin, b, cid, ip, "team-y/team-x-model", ns="team-y")


def test_restore_into_less_privileged_container_is_refused(sandbox, pod, plugin):
    from devtools.cri import SecurityContext
    checkpoint_source(sandbox, pod, plugin, "root-source")  # runs as root with default caps
    b, cid, ip = restore_pod(sandbox, pod, plugin, "root-source", "dst-unprivileged",
                             security=SecurityContext(run_as_user=1000, run_as_group=1000,
                                                      drop_capabilities=["ALL"]))
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "cold-start" and "less privileged" in st["reason"], st
    assert "uid" in st["reason"]


def _only_child(sandbox, cid: str) -> int:
    from runtime.container.containers import children
    init = sandbox.cri.container_status(cid, verbose=True).pid
    kids = children(init)
    assert len(kids) == 1, (init, kids)
    return kids[0]


def _edit_spec(sandbox, cid: str, edit) -> None:
    """Change a created container's stored spec before it starts (as the plugin's swap does)."""
    containerd = sandbox.containerd()
    spec = containerd.get_spec(cid)
    edit(spec)
    containerd.update_spec(cid, spec)


def _write_error(path: str) -> int | None:
    """errno of creating ``path`` (None when it could be created, and is removed again)."""
    import os
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as e:
        return e.errno
    os.unlink(path)
    return None


def test_restored_process_gets_the_targets_read_only_mounts_oom_score_and_rlimits(sandbox, pod, plugin, tmp_path):
    """CRIU restores the source's mount flags, oom_score_adj and rlimits. A source with a writable
    rootfs and volume, oom_score_adj 0 and the runtime's RLIMIT_NOFILE is restored into a target
    with a read-only rootfs and volume, oom_score_adj 1000 (kubelet's BestEffort value) and
    RLIMIT_NOFILE 512: the restored process must have the target's, checked through its own root
    and /proc. (A source below 0, kubelet's -997, needs CAP_SYS_RESOURCE, which the machines these
    tests run on may lack.)"""
    import errno
    import resource

    from devtools.cri import Mount, SecurityContext
    src_vol, dst_vol = tmp_path / "src-vol", tmp_path / "dst-vol"
    src_vol.mkdir()
    dst_vol.mkdir()
    a = pod("src-confined", annotations={"rekindle.dev/checkpoint": "confined"})
    a_cid = sandbox.run_container(a, "server", COUNTER, command=SERVER, env=READY,
                                  mounts=[Mount("/data", str(src_vol))])
    a_ip = sandbox.cri.pod_ip(a.id)
    warm_up(a_ip, plugin.control_dir(a.uid, "server") / "ready-for-checkpoint")
    assert wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed"})["phase"] == "published"
    before = fields(get(a_ip))
    src = _only_child(sandbox, a_cid)  # the source really had more than the target will
    assert open(f"/proc/{src}/oom_score_adj").read().strip() == "0"
    assert resource.prlimit(src, resource.RLIMIT_NOFILE)[1] > 512
    assert _write_error(f"/proc/{src}/root/data/probe") is None
    assert _write_error(f"/proc/{src}/root/probe") is None

    b = pod("dst-confined", annotations={"rekindle.dev/restore": "confined"})
    cid = sandbox.cri.create_container(b, "server", COUNTER, command=SERVER, oom_score_adj=1000,
                                       mounts=[Mount("/data", str(dst_vol), readonly=True)],
                                       security=SecurityContext(readonly_rootfs=True))
    # Kubernetes has no rlimit field; a runtime's base spec or an NRI plugin sets them.
    _edit_spec(sandbox, cid, lambda spec: spec["process"].update(
        rlimits=[{"type": "RLIMIT_NOFILE", "hard": 512, "soft": 512}]))
    sandbox.cri.start_container(cid)
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "restored", st
    b_ip = sandbox.cri.pod_ip(b.id)
    wait_http(b_ip)
    got = fields(get(b_ip))  # the source's process, continued: its pid, its state file
    assert (got["pid"], got["state"]) == (before["pid"], before["state"]), (got, before)

    pid = _only_child(sandbox, cid)
    assert open(f"/proc/{pid}/oom_score_adj").read().strip() == "1000"
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (512, 512)
    # /proc/<pid>/root is the restored process's own root: its mounts, its flags.
    assert _write_error(f"/proc/{pid}/root/probe") == errno.EROFS
    assert _write_error(f"/proc/{pid}/root/data/probe") == errno.EROFS
    assert _write_error(f"/proc/{pid}/root/etc/hosts.probe") == errno.EROFS
    assert not any(dst_vol.iterdir())


def test_restore_into_a_target_that_masks_more_is_refused(sandbox, pod, plugin):
    """CRIU restores the source's mount tree: a path the target masks and the source did not
    would be open to the restored process, so the restore is refused (cold start)."""
    checkpoint_source(sandbox, pod, plugin, "unmasked")  # no masked paths
    b = pod("dst-masked", annotations={"rekindle.dev/restore": "unmasked"})
    cid = sandbox.cri.create_container(b, "server", COUNTER, command=SERVER)
    _edit_spec(sandbox, cid, lambda spec: spec["linux"].update(maskedPaths=["/proc/kcore", "/proc/keys"]))
    sandbox.cri.start_container(cid)
    assert_cold(sandbox, plugin, b, cid, sandbox.cri.pod_ip(b.id),
                "target masks paths the source did not: /proc/kcore, /proc/keys")


def test_two_restores_of_one_artifact_at_once(sandbox, pod, plugin):
    a, _, a_ip = checkpoint_source(sandbox, pod, plugin, "shared")
    pods = [pod(f"dst-shared-{i}", annotations={"rekindle.dev/restore": "shared"}) for i in range(2)]
    cids = [sandbox.cri.create_container(p, "server", COUNTER, command=SERVER) for p in pods]
    for cid in cids:
        sandbox.cri.start_container(cid)
    for p in pods:
        st = wait_status(plugin, "default", p.name, "server", {"restored", "cold-start"})
        assert st["phase"] == "restored", st
        ip = sandbox.cri.pod_ip(p.id)
        wait_http(ip)
        assert fields(get(ip))["count"] == "4"


def _resign(plugin: PluginProcess, artifact_dir, replace: dict[str, bytes]) -> None:
    """Swap files in an artifact and re-sign it with the node's key: an artifact that passes the
    signature and digest checks but carries a hostile payload (defence in depth)."""
    from runtime.digests import hash_fd
    from runtime.manifest import Manifest, sign
    manifest = Manifest.from_json((artifact_dir / "manifest.json").read_bytes())
    from runtime import layout
    from runtime.overlay.verified import write_sums
    for rel, data in replace.items():
        (artifact_dir / rel).write_bytes(data)
        sums = artifact_dir / layout.layer_sums(rel)
        if sums.exists():  # a layer's chunk digests, made again as the signer would
            sums.unlink()
            write_sums(str(artifact_dir / rel), str(sums))
    files = []
    for f in manifest.files:
        fd = os.open(artifact_dir / f.path, os.O_RDONLY)
        try:
            size, digest = hash_fd(fd)
        finally:
            os.close(fd)
        files.append(type(f)(f.path, size, digest))
    import dataclasses
    raw = dataclasses.replace(manifest, files=tuple(files)).to_json()
    (artifact_dir / "manifest.json").write_bytes(raw)
    key = (plugin.state_dir / "hmac.key").read_bytes()
    (artifact_dir / "manifest.json.sig").write_text(sign(raw, key))


def _evil_tar(escape_name: str) -> bytes:
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes = b"pwned\n", **kw) -> None:
            info = tarfile.TarInfo(name)
            for k, v in kw.items():
                setattr(info, k, v)
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
        add("var/lib/counter/ok.txt")
        add(f"../../../../../../../../tmp/{escape_name}")
        add("escape-link", type=tarfile.SYMTYPE, linkname="/tmp")
        add(f"escape-link/{escape_name}")
    return buf.getvalue()


def test_crafted_diff_with_traversal_entries_is_rejected(sandbox, pod, plugin, tmp_path):
    import secrets
    checkpoint_source(sandbox, pod, plugin, "crafted")
    escape = f"rekindle-escape-{secrets.token_hex(4)}"
    _resign(plugin, plugin.store / "default" / "crafted", {"rootfs-diff.tar": _evil_tar(escape)})
    b, cid, ip = restore_pod(sandbox, pod, plugin, "crafted", "dst-crafted")
    st = assert_cold(sandbox, plugin, b, cid, ip, "not a normalised relative path inside the rootfs")
    assert not Path("/tmp", escape).exists(), "an archive entry escaped the container rootfs"
    rootfs_ls = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ls /var/lib/counter; ls -d /escape-link 2>&1"],
                                      timeout=10).out
    assert "ok.txt" not in rootfs_ls and "No such file" in rootfs_ls  # validated before anything was written
    assert "rootfs" in st["reason"] or ".." in st["reason"], st


def test_operator_cli_lists_inspects_verifies_and_deletes(sandbox, pod, plugin):
    import subprocess
    import sys
    checkpoint_source(sandbox, pod, plugin, "cli-demo", ns="ops")
    base = [sys.executable, "-m", "nri_plugin"]
    paths = ["--store", str(plugin.store), "--state-dir", str(plugin.state_dir)]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args, *paths], capture_output=True, text=True, timeout=60)

    listed = cli("artifacts", "list", "--namespace", "ops")
    assert listed.returncode == 0 and "cli-demo" in listed.stdout, listed
    shown = cli("artifacts", "inspect", "--namespace", "ops", "cli-demo", "--verify")
    assert shown.returncode == 0 and "all file digests match" in shown.stdout, shown
    doc = json.loads(cli("artifacts", "inspect", "--namespace", "ops", "cli-demo", "--json").stdout)
    assert doc["source"]["container"] == "server" and doc["criu"]["version"]
    status = cli("status")
    assert "ops/src-cli-demo:server  checkpoint cli-demo  published" in status.stdout, status.stdout
    assert cli("artifacts", "delete", "--namespace", "ops", "cli-demo").returncode == 0
    gone = cli("artifacts", "inspect", "--namespace", "ops", "cli-demo")
    assert gone.returncode == 1 and gone.stderr.startswith("rekindle: error:"), gone


def test_a_cli_checkpoint_names_the_image_and_restores_into_a_pod(sandbox, pod, plugin):
    """``rekindle checkpoint`` of a running source reads its image (and pod) from the spec CRI wrote,
    as the plugin takes them from NRI: a restore checks the image, so without it the artifact
    could never be restored."""
    import subprocess
    import sys
    _a, a_cid, _ip = checkpoint_source(sandbox, pod, plugin, "cli-first")
    paths = ["--store", str(plugin.store), "--state-dir", str(plugin.state_dir),
             "--containerd-state", str(sandbox.state_dir), "--containerd-socket", sandbox.containerd_socket]
    made = subprocess.run([sys.executable, "-m", "nri_plugin", "checkpoint", "--container-id", a_cid,
                           "--namespace", "default", "--name", "cli-again", *paths],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made
    key = (plugin.state_dir / "hmac.key").read_bytes()
    from runtime.store.volume import ArtifactStore
    store = ArtifactStore(str(plugin.store))
    with store.open("default", "cli-first", key) as first, store.open("default", "cli-again", key) as again:
        want, got = first.manifest.source, again.manifest.source
    assert got.image and (got.image, got.image_ref, got.pod, got.container) == \
        (want.image, want.image_ref, want.pod, want.container), (got, want)
    b = pod("dst-cli-again", annotations={"rekindle.dev/restore": "cli-again"})
    sandbox.run_container(b, "server", COUNTER, command=SERVER)
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "restored", st


def test_http_ready_probe_in_the_pod_network_namespace(sandbox, pod, plugin):
    a, _, _ = checkpoint_source(sandbox, pod, plugin, "probed", probe="http://:8080/ready")
    log = plugin.log()
    assert "ready (http://127.0.0.1:8080/ready)" in log
    assert not (plugin.control_dir(a.uid, "server") / "ready-for-checkpoint").exists()


def _criu_restores(artifact: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"criu") and b"restore" in argv and any(
                f"/restore-default-{artifact}-".encode() in a and a.endswith(b"/private/criu") for a in argv):
            found.append(int(pid))
    return found


def _wait_criu_restore(artifact: str, timeout: float) -> None:
    wait_for(lambda: _criu_restores(artifact), timeout, f"criu restore of {artifact} to start")


def _stopped_in(cid_pidns: int) -> bool:
    """Whether a process of that pid namespace is stopped (a restore left stopped for the fill)."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if os.stat(f"/proc/{p}/ns/pid").st_ino != cid_pidns:
                continue
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return True
        except OSError:
            continue
    return False


@pytest.mark.parametrize("path", ["stock", "bulk"])
def test_plugin_killed_during_a_restore_leaves_a_cold_start_not_a_stuck_pod(sandbox, pod, plugin, path):
    """The agent dies mid-restore: in CRIU (stock path; CRIU dies with it) or while it fills the
    stopped tree's bulk pages (bulk path). When it comes back it fails that restore, once, and the
    init kills whatever was left and starts the original command."""
    from runtime.container.containers import resolve_container
    name = f"interrupted-{path}"
    warm = {"WARMUP_MIB": "2048" if path == "bulk" else "1024", "WARMUP_PASSES": "1"}
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": path}
    plugin.start()
    try:
        a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
        # No request of ours may reach the source while it is checkpointed (CRIU refuses a dump
        # with a connection waiting in the listen queue): it says ready once it has answered them.
        sandbox.run_container(a, "server", COUNTER, command=SERVER, env={**warm, **READY})
        warm_up(sandbox.cri.pod_ip(a.id), plugin.control_dir(a.uid, "server") / "ready-for-checkpoint", timeout=60)
        assert wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed"},
                           timeout=120)["phase"] == "published"
        b = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
        cid = sandbox.run_container(b, "server", COUNTER, command=SERVER, env=warm)
        wait_status(plugin, "default", b.name, "server", {"restoring"}, timeout=20)
        if path == "stock":
            _wait_criu_restore(name, timeout=30)
        else:
            pidns = resolve_container(str(sandbox.state_dir), cid).namespaces["pid"].inode
            wait_for(lambda: _stopped_in(pidns), 60, "the restored tree stopped for its fill", interval=0.01)
        plugin.kill()  # mid-CRIU or mid-fill
        # No CRIU of this restore outlives the agent. A killed process may take its time to exit on
        # a busy node, so wait for it rather than time it; on the stock path its log then proves it
        # died with the agent instead of finishing the restore (CRIU needs seconds for this one).
        wait_for(lambda: not _criu_restores(name), 30, "criu to end with the agent")
        works = list((plugin.state_dir / "logs").glob(f"restore-default-{name}-*"))
        assert len(works) == 1, works
        log_file = works[0] / "restore.log"  # none yet when CRIU died before it opened it
        if path == "stock" and log_file.exists():  # (bulk: CRIU had left the tree stopped, may be done)
            assert "Restore finished successfully" not in log_file.read_text(errors="replace"), log_file
        private = list((plugin.state_dir / "logs").glob(f"restore-default-{name}-*/private"))
        plugin.start()
        st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
        assert st["phase"] == "cold-start" and "agent restarted during the restore" in st["reason"], st
        # The copies the killed restore staged are the restarted plugin's to remove, at once.
        deadline = time.monotonic() + 10
        while any(p.exists() for p in private) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert private and not any(p.exists() for p in private), private
        ip = sandbox.cri.pod_ip(b.id)
        wait_http(ip, timeout=60)
        assert fields(get(ip))["count"] == "1"
        time.sleep(2)  # anything left of the restore would show up by now
        out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o comm | grep -cx counter-server"], timeout=10)
        assert out.out.strip() == "1", out  # exactly one server process (the init's argv names it too)
    finally:
        plugin.kill()
        plugin.env = {}
        plugin.start()


def test_checkpoint_and_restore_on_containerd_2_1(sandbox_factory, pod, tmp_path):
    """The same flow on containerd 2.1.9 (NRI 0.8: the entrypoint swap is the spec update too)."""
    sb21 = sandbox_factory("2.1")
    plugin21 = PluginProcess(sb21, tmp_path / "plugin21")
    plugin21.start()
    try:
        a = pod("src-on-21", annotations={"rekindle.dev/checkpoint": "on-21"}, on=sb21)
        sb21.run_container(a, "server", COUNTER, command=SERVER, env=READY)
        a_ip = sb21.cri.pod_ip(a.id)
        warm_up(a_ip, plugin21.control_dir(a.uid, "server") / "ready-for-checkpoint")
        assert wait_status(plugin21, "default", a.name, "server", {"published", "checkpoint-failed"})["phase"] == "published"
        b = pod("dst-on-21", annotations={"rekindle.dev/restore": "on-21"}, on=sb21)
        sb21.run_container(b, "server", COUNTER, command=SERVER)
        st = wait_status(plugin21, "default", b.name, "server", {"restored", "cold-start"})
        assert st["phase"] == "restored", st
        b_ip = sb21.cri.pod_ip(b.id)
        wait_http(b_ip)
        assert fields(get(b_ip))["count"] == "4"
    finally:
        plugin21.stop()
