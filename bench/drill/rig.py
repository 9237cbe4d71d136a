"""The drill's real parts, wired once: sandbox containerd, CRI client, the plugin process, the
store on its small tmpfs, and the workload the pods run.

Contract: ``Rig.up()`` takes the sandbox (reused when it already runs containerd 1.7), mounts the
store's tmpfs, starts ``rekindle plugin`` (tests/e2e/plugin_process.py) and reads its key;
``Rig.down()`` undoes what ``up`` did, and stops containerd only when ``up`` started it.
``Workload`` is the counter server with WARMUP_MIB of live memory, plus a file of ``blob_mib``
in its writable layer and one of ``shm_mib`` in /dev/shm written before it starts, so that the
rootfs and /dev/shm captures and the restore's stage and rootfs_apply take long enough to be
hit on purpose. ``start_pod`` runs one pod of it; ``stop_pod`` removes it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.drill import observe
from bench.drill.faults import StoreDisk
from devtools.cri import CRIClient, Pod
from devtools.sandbox import Runtime, Sandbox, SandboxConfig
from runtime.container.containers import resolve_container
from runtime.status import ContainerStatus, Phase, StatusBook
from runtime.store import ArtifactStore, read_key
from tests.e2e.plugin_process import PluginProcess, build_native

REPO = Path(__file__).resolve().parents[2]

IMAGE = "localhost/rekindle/counter:1"
CONTAINER = "server"
PORT = 8080


LAYER_DIR = "var/drill-layer"  # in the writable layer: files that tell which start made them


@dataclass(frozen=True)
class Workload:
    warmup_mib: int
    blob_mib: int = 0
    shm_mib: int = 0
    layer_files: int = 300

    @property
    def command(self) -> list[str]:
        pre = ""
        if self.layer_files:
            # Written once per rootfs, each holding this start's token: a restored rootfs holds
            # the source's token in every file, a cold one its own; a rootfs the restore left
            # half-applied shows a mix, missing files, or (cold) the source's token.
            pre += (f"if [ ! -e /{LAYER_DIR}/.done ]; then mkdir -p /{LAYER_DIR}; "
                    "t=$(cat /proc/sys/kernel/random/uuid); i=0; "
                    f"while [ $i -lt {self.layer_files} ]; do echo $t > /{LAYER_DIR}/f-$i; i=$((i+1)); done; "
                    f"echo $t > /{LAYER_DIR}/.done; fi; ")
        if self.blob_mib:
            pre += f"dd if=/dev/zero of=/var/drill-blob bs=1M count={self.blob_mib} 2>/dev/null; "
        if self.shm_mib:
            pre += f"dd if=/dev/zero of=/dev/shm/drill-blob bs=1M count={self.shm_mib} 2>/dev/null; "
        return ["/bin/sh", "-c", pre + f"exec /usr/local/bin/counter-server {PORT}"]

    @property
    def env(self) -> dict[str, str]:
        return {"WARMUP_MIB": str(self.warmup_mib), "WARMUP_PASSES": "1"}


@dataclass
class PodRun:
    pod: Pod
    cid: str
    pidns: int

    @property
    def name(self) -> str:
        return self.pod.name


def http(ip: str, path: str = "/", timeout: float = 3.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:{PORT}{path}", timeout=timeout) as r:
        body: bytes = r.read()
    return body.decode()


def count_of(body: str) -> int:
    return int(body.split("count=")[1].split()[0])


def fields(body: str) -> dict[str, str]:
    """``count=4 pid=9 state=written-at-start 17 deleted=yes`` -> dict (values may hold spaces).
    ``state`` (written at start into the writable layer) and ``pid`` say which start a server
    comes from: a restored one has its source's, a cold one its own."""
    return dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", body.strip()))


def same_start(body: str, ref: dict[str, str]) -> bool:
    got = fields(body)
    return bool(ref) and got.get("state") == ref.get("state") and got.get("pid") == ref.get("pid")


class Rig:
    def __init__(self, work: Path, store_mib: int, restore_path: str = "stream") -> None:
        self.work = work
        self.restore_path = restore_path
        self.sandbox = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
        self.started_sandbox = False
        self.cri: CRIClient | None = None
        handle = _Handle(self.sandbox)
        self.plugin = PluginProcess(handle, work / "plugin")
        self.plugin.env = {"REKINDLE_RESTORE_PATH": restore_path}
        self.disk = StoreDisk(self.plugin.store, store_mib)
        # The node-local work dir: a checkpoint's private dump, a restore's private copies.
        self.node_disk = StoreDisk(self.plugin.state_dir / "logs", store_mib, label="node")
        self.disks = (self.disk, self.node_disk)
        self.store = ArtifactStore(str(self.plugin.store))
        self.status = StatusBook(self.plugin.state_dir)
        self.tail = observe.LogTail(self.plugin.log_path)
        self.key = b""
        self.pods: list[Pod] = []
        self.layer_files = Workload(0).layer_files
        self.artifact_bytes = 0  # the largest artifact seen (what a checkpoint needs on the store)

    # ------------------------------------------------------------------ set-up
    def up(self) -> None:
        build_native()
        self.started_sandbox = not self.sandbox.is_running()
        self.sandbox.up()
        self.cri = self.sandbox.cri(timeout=120.0)
        if self.work.exists():
            for m in reversed(observe.mounts_under(self.work)):
                umount(m)  # a drill that was killed left its store mounted
            shutil.rmtree(self.work)
        for d in self.disks:
            d.mount()
        self.plugin.start(wait=False)
        self.plugin.wait_log("synchronized:", timeout=90)
        self.key = read_key(self.plugin.state_dir / "hmac.key")
        self.tail.mark()

    def down(self) -> None:
        for p in list(self.pods):
            self.stop_pod(p)
        self.plugin.stop()
        for d in self.disks:
            d.umount()
        if self.cri is not None:
            self.cri.close()
        if self.started_sandbox:
            self.sandbox.down()

    def restart_plugin(self) -> None:
        synced = self.plugin.log().count("synchronized:")
        self.plugin.start(wait=False)
        self.plugin.wait_log("synchronized:", count=synced + 1, timeout=90)

    # ------------------------------------------------------------------ pods
    def start_pod(self, name: str, workload: Workload, annotations: dict[str, str] | None = None) -> PodRun:
        assert self.cri is not None
        pod = self.cri.run_pod_sandbox(name, annotations=annotations or {})
        self.pods.append(pod)
        cid = self.cri.create_container(pod, CONTAINER, IMAGE, command=workload.command, env=workload.env)
        self.cri.start_container(cid)
        info = resolve_container(str(self.sandbox.paths.state), cid)
        return PodRun(pod, cid, info.namespaces["pid"].inode)

    def stop_pod(self, pod: Pod) -> None:
        assert self.cri is not None
        try:
            self.cri.stop_pod(pod.id)
            self.cri.remove_pod(pod.id)
        except Exception:  # noqa: BLE001 - clean-up goes on; leaks are checked separately
            pass
        if pod in self.pods:
            self.pods.remove(pod)

    def ip(self, run: PodRun) -> str:
        assert self.cri is not None
        return self.cri.pod_ip(run.pod.id)

    def wait_serving(self, run: PodRun, timeout: float = 60.0) -> str | None:
        """The first answer to GET / (None if the pod never answered)."""
        ip = self.ip(run)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return http(ip, "/", 1.0)
            except OSError:
                time.sleep(0.05)
        return None

    def wait_status(self, run: PodRun, phases: set[Phase], timeout: float) -> ContainerStatus | None:
        return self.status.wait(run.pod.namespace, run.name, CONTAINER, phases, timeout, poll=0.05)

    def layer(self, run: PodRun) -> tuple[dict[str, int], list[str]]:
        """What the pod's rootfs holds of the drill's layer: {token: files holding it}, and the
        names at the rootfs's top that only a restore's journal would leave (``.rekindle-*``)."""
        rootfs = Path(resolve_container(str(self.sandbox.paths.state), run.cid).rootfs)
        tokens: Counter[str] = Counter()
        for f in sorted((rootfs / LAYER_DIR).glob("f-*")):
            tokens[f.read_text().strip()] += 1
        journal = sorted(p.name for p in rootfs.iterdir() if p.name.startswith(".rekindle-"))
        return dict(tokens), journal

    def rootfs_changed(self, run: PodRun) -> bool:
        """The restore's apply has begun to change the pod's rootfs (files of the layer appear)."""
        rootfs = Path(resolve_container(str(self.sandbox.paths.state), run.cid).rootfs)
        return (rootfs / LAYER_DIR).exists() or (rootfs / "var/drill-blob").exists()

    def control(self, run: PodRun) -> Path:
        return self.plugin.control_dir(run.pod.uid, CONTAINER)

    def store_bytes(self) -> int:
        return self.disk.used()

    def artifact_ok(self, name: str, namespace: str = "default") -> tuple[bool, str]:
        """(True, version) when ``name`` is a complete signed version whose every digest matches."""
        with self.store.open(namespace, name, self.key) as art:
            art.verify_files()
            return True, art.version


class _Handle:
    """What PluginProcess needs of a sandbox."""

    def __init__(self, sb: Sandbox) -> None:
        self.nri_socket = sb.paths.nri_socket
        self.containerd_socket = sb.address
        self.state_dir = sb.paths.state


def umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], check=False, capture_output=True)


def dump_json(path: Path, doc: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
