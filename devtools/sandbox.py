"""A private single-node containerd sandbox: CRI + NRI + CNI bridge, for demos and e2e tests.

Contract:
- Everything lives under one directory (default ``$REKINDLE_SANDBOX`` or
  ``/var/lib/rekindle-sandbox``): containerd root ``root/``, state ``state/`` (task bundles are
  ``state/io.containerd.runtime.v2.task/k8s.io/<id>/``), gRPC socket ``containerd.sock``, NRI
  socket ``nri.sock``, config ``config.toml``, log ``containerd.log``, CNI config ``cni/net.d``,
  images ``images/``, and ``sandbox.json`` (what is running: runtime, pid, network).
- Four runtimes: ``1.7`` (the packaged containerd, config v2; NRI 0.6), ``2.1`` (the extracted
  one under ``/opt/rekindle/containerd-2.1``; NRI 0.8), ``2.2`` and ``2.4`` (built from their Go
  module by hack/build-containerd.sh under ``/opt/rekindle/containerd-2.2`` and ``-2.4``; NRI
  0.11 and 0.12, so the ``args`` adjustment). 2.1 and 2.2 run config v3, 2.4 config v4 (as
  each one's ``containerd config default`` writes), each with its own shim first in PATH.
- :meth:`Sandbox.up` renders the config, starts containerd in its own session, waits until CRI
  answers and the NRI socket exists, then imports the images (devtools.images). Idempotent.
- :meth:`Sandbox.down` removes every pod through CRI, stops containerd (TERM, then KILL),
  force-deletes leftover runc containers, kills leftover shims, unmounts what is left under the
  directory, removes the pods' network namespaces and the bridge, so ``up`` can run again.
  ``purge`` also deletes the directory.
- :meth:`Sandbox.restart` restarts containerd only, as a node's service manager does: shims,
  containers, network namespaces and the bridge stay, and containerd reloads its pods.

Run ``python -m devtools.sandbox up|down|status|env`` (hack/sandbox.sh wraps it).
"""

from __future__ import annotations

import argparse
import enum
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Callable, Sequence

from runtime.errors import RekindleError

log = logging.getLogger(__name__)

DEFAULT_DIR = Path(os.environ.get("REKINDLE_SANDBOX", "/var/lib/rekindle-sandbox"))
CONTAINERD21_PREFIX = Path(os.environ.get("REKINDLE_CONTAINERD21_PREFIX", "/opt/rekindle/containerd-2.1"))
CONTAINERD22_PREFIX = Path(os.environ.get("REKINDLE_CONTAINERD22_PREFIX", "/opt/rekindle/containerd-2.2"))
CONTAINERD24_PREFIX = Path(os.environ.get("REKINDLE_CONTAINERD24_PREFIX", "/opt/rekindle/containerd-2.4"))
CNI_BIN_DIR = Path(os.environ.get("REKINDLE_CNI_BIN_DIR", "/usr/lib/cni"))
# Where containerd 1.7, its runc shim and ctr live; a node without the package (a GPU node set up
# by hack/gpu-node-setup.sh) points this at an unpacked bundle, which then goes first in PATH so
# the shim and the runc it starts are the bundle's too.
CONTAINERD17_BIN_DIR = Path(os.environ.get("REKINDLE_CONTAINERD_BIN_DIR", "/usr/bin"))
PAUSE_IMAGE = "localhost/rekindle/pause:1"
# runc's state root as the runc v2 shim uses it for the k8s.io namespace (containerd's default).
RUNC_ROOT = Path("/run/containerd/runc/k8s.io")
# Which sandbox dir owns which bridge: two sandboxes on one bridge would hand out the same IPs.
BRIDGE_REGISTRY = Path("/run/rekindle-sandbox/bridges")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Held by whatever drives the default sandbox (an e2e session, the fault drill, a bench), so two
# of them on one machine wait for each other instead of sharing one containerd and bridge.
E2E_LOCK = Path("/run/lock/rekindle-e2e.lock")


class SandboxError(RekindleError):
    """The sandbox could not be started, stopped or inspected."""


class Runtime(enum.Enum):
    V1_7 = "1.7"
    V2_1 = "2.1"
    V2_2 = "2.2"
    V2_4 = "2.4"

    @property
    def bin_dir(self) -> Path:
        if self is Runtime.V1_7:
            return CONTAINERD17_BIN_DIR
        prefix = {Runtime.V2_1: CONTAINERD21_PREFIX, Runtime.V2_2: CONTAINERD22_PREFIX,
                  Runtime.V2_4: CONTAINERD24_PREFIX}[self]
        return prefix / "usr/bin"

    @property
    def containerd(self) -> Path:
        return self.bin_dir / "containerd"

    @property
    def ctr(self) -> Path:
        return self.bin_dir / "ctr"

    @property
    def config_version(self) -> int:
        """The version its `containerd config default` writes (4 from 2.3 on)."""
        return {Runtime.V1_7: 2, Runtime.V2_4: 4}.get(self, 3)


@dataclass(frozen=True)
class SandboxConfig:
    dir: Path = DEFAULT_DIR
    runtime: Runtime = Runtime.V1_7
    bridge: str = "rkbr0"
    subnet: str = "10.77.0.0/24"
    cni_bin_dir: Path = CNI_BIN_DIR
    pause_image: str = PAUSE_IMAGE
    request_timeout: str = "2s"  # NRI plugin_request_timeout
    log_level: str = "info"


@dataclass(frozen=True)
class SandboxPaths:
    dir: Path

    @property
    def root(self) -> Path: return self.dir / "root"
    @property
    def state(self) -> Path: return self.dir / "state"
    @property
    def socket(self) -> Path: return self.dir / "containerd.sock"
    @property
    def nri_socket(self) -> Path: return self.dir / "nri.sock"
    @property
    def config(self) -> Path: return self.dir / "config.toml"
    @property
    def log(self) -> Path: return self.dir / "containerd.log"
    @property
    def meta(self) -> Path: return self.dir / "sandbox.json"
    @property
    def cni_conf_dir(self) -> Path: return self.dir / "cni/net.d"
    @property
    def cni_ipam_dir(self) -> Path: return self.dir / "cni/ipam"
    @property
    def nri_plugin_dir(self) -> Path: return self.dir / "nri/plugins"
    @property
    def nri_conf_dir(self) -> Path: return self.dir / "nri/conf.d"
    @property
    def images(self) -> Path: return self.dir / "images"
    @property
    def pod_logs(self) -> Path: return self.dir / "pod-logs"
    @property
    def bundles(self) -> Path: return self.state / "io.containerd.runtime.v2.task/k8s.io"


# --- rendering (pure) ----------------------------------------------------------------------

def _q(v: str | Path) -> str:
    return json.dumps(str(v))  # a TOML basic string is JSON-compatible for these values


def render_containerd_config(cfg: SandboxConfig) -> str:
    """The containerd config for the sandbox, of the version the runtime writes itself: v2 for
    1.7, v3 for 2.1 and 2.2, v4 for 2.4."""
    p = SandboxPaths(cfg.dir)
    head = f"""version = {cfg.runtime.config_version}
root = {_q(p.root)}
state = {_q(p.state)}

[debug]
  level = {_q(cfg.log_level)}
"""
    # Version 4 moved the servers into plugins.
    servers = f"""
[plugins."io.containerd.server.v1.grpc"]
  address = {_q(p.socket)}

[plugins."io.containerd.server.v1.ttrpc"]
  address = {_q(str(p.socket) + ".ttrpc")}
""" if cfg.runtime.config_version >= 4 else ""
    if not servers:
        head += f"""
[grpc]
  address = {_q(p.socket)}

[ttrpc]
  address = {_q(str(p.socket) + ".ttrpc")}
"""
    nri = f"""
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = {_q(p.nri_socket)}
  plugin_path = {_q(p.nri_plugin_dir)}
  plugin_config_path = {_q(p.nri_conf_dir)}
  plugin_registration_timeout = "5s"
  plugin_request_timeout = {_q(cfg.request_timeout)}

[plugins."io.containerd.internal.v1.opt"]
  path = {_q(cfg.dir / "opt")}
"""
    if cfg.runtime is Runtime.V1_7:
        cri = f"""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {_q(cfg.pause_image)}
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {_q(cfg.cni_bin_dir)}
    conf_dir = {_q(p.cni_conf_dir)}
    max_conf_num = 1
"""
    else:
        # CDI off where it can be (annotations name made-up devices in the tests); from 2.3 on
        # the switch is gone and CDI is always on.
        cdi = "\n  enable_cdi = false" if cfg.runtime in (Runtime.V2_1, Runtime.V2_2) else ""
        cri = f"""
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = {_q(cfg.pause_image)}

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true{cdi}
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [{_q(cfg.cni_bin_dir)}]
    conf_dir = {_q(p.cni_conf_dir)}
    max_conf_num = 1

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""
    return head + "\n[plugins]" + servers + nri + cri


def render_cni_conflist(cfg: SandboxConfig, portmap: bool | None = None) -> str:
    """A bridge network with host-local IPAM (leases under the sandbox) and portmap.

    portmap needs iptables; without it or the plugin on the node (None: look on PATH and in the
    CNI bin dir) the chain is the bridge alone (no masquerading either way), so pods still get
    their addresses.
    """
    if portmap is None:
        portmap = (shutil.which("iptables", path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}") is not None
                   and (Path(cfg.cni_bin_dir) / "portmap").exists())
    conf = {
        "cniVersion": "1.0.0",
        "name": f"rekindle-{cfg.bridge}",
        "plugins": [
            {"type": "bridge", "bridge": cfg.bridge, "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": cfg.subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(SandboxPaths(cfg.dir).cni_ipam_dir)}},
        ],
    }
    if portmap:
        conf["plugins"].append({"type": "portmap", "capabilities": {"portMappings": True}})
    return json.dumps(conf, indent=2) + "\n"


def hold_e2e_lock() -> IO[str]:
    """Take :data:`E2E_LOCK` (waiting, with a line on stderr, while another holds it); closing
    the returned file gives it back."""
    E2E_LOCK.parent.mkdir(parents=True, exist_ok=True)
    f = open(E2E_LOCK, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for the e2e tests' sandbox ({E2E_LOCK})", file=sys.stderr, flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


# --- process helpers ---------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _mounts_under(base: Path) -> list[str]:
    """Mount points at or below base, deepest first (from /proc/self/mountinfo)."""
    out = []
    prefix = str(base).rstrip("/") + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].encode().decode("unicode_escape")  # octal escapes like \040
        if mp == str(base) or mp.startswith(prefix):
            out.append(mp)
    return sorted(set(out), key=lambda m: m.count("/"), reverse=True)


def _umount(path: str) -> None:
    if subprocess.run(["umount", path], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", path], capture_output=True)


@dataclass
class SandboxStatus:
    dir: str
    running: bool
    pid: int | None
    runtime: str | None
    cri_ready: bool
    nri_socket: bool
    pods: int | None = None


@dataclass
class _Meta:
    runtime: str
    pid: int
    bridge: str
    subnet: str
    netns: list[str] = field(default_factory=list)


class Sandbox:
    """One private containerd instance and its network; see the module docstring."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.paths = SandboxPaths(self.config.dir)
        self._proc: subprocess.Popen | None = None  # set when this object started containerd

    # -- public API --

    @property
    def address(self) -> str:
        return str(self.paths.socket)

    def env(self) -> dict[str, str]:
        """Variables that point tools at this sandbox."""
        return {
            "REKINDLE_SANDBOX": str(self.paths.dir),
            "CONTAINERD_ADDRESS": self.address,
            "CONTAINERD_NAMESPACE": "k8s.io",
            "REKINDLE_NRI_SOCKET": str(self.paths.nri_socket),
            "REKINDLE_CONTAINERD_STATE": str(self.paths.state),
            "REKINDLE_CONTAINERD_RUNTIME": self.config.runtime.value,
            "REKINDLE_CTR": str(self.config.runtime.ctr),
        }

    def cri(self, timeout: float = 30.0):
        """A CRIClient bound to this sandbox's socket (pod logs under the sandbox)."""
        from devtools.cri import CRIClient  # local: keeps rendering import-light
        return CRIClient(self.address, timeout=timeout, log_root=self.paths.pod_logs)

    def pid(self) -> int | None:
        meta = self._read_meta()
        if meta and _pid_alive(meta.pid) and any("containerd" in a for a in _cmdline(meta.pid)[:1]):
            return meta.pid
        return None

    def is_running(self) -> bool:
        return self.pid() is not None

    def cri_ready(self) -> bool:
        if not self.paths.socket.exists():
            return False
        try:
            with self.cri(timeout=2.0) as c:
                c.version()
            return True
        except Exception:  # any failure means "not answering yet"
            return False

    def status(self) -> SandboxStatus:
        meta = self._read_meta()
        pid = self.pid()
        st = SandboxStatus(dir=str(self.paths.dir), running=pid is not None, pid=pid,
                           runtime=meta.runtime if meta else None,
                           cri_ready=pid is not None and self.cri_ready(),
                           nri_socket=self.paths.nri_socket.exists())
        if st.cri_ready:
            with self.cri(timeout=5.0) as c:
                st.pods = len(c.list_pods())
        return st

    def up(self, timeout: float = 60.0, import_images: bool = True) -> None:
        """Start containerd (unless this sandbox already runs) and import the images."""
        running = self._read_meta()
        if self.is_running():
            if running and running.runtime != self.config.runtime.value:
                raise SandboxError(f"sandbox {self.paths.dir} already runs containerd {running.runtime}; run down first")
            log.info("sandbox %s already up (pid %s)", self.paths.dir, self.pid())
        else:
            if running:  # stale: a previous instance died without down
                self._cleanup_leftovers(running)
            self._start()
        self.wait_ready(timeout)
        if import_images:
            from devtools import images
            names = images.build_and_import(self.paths.images, self.address, str(self.config.runtime.ctr))
            log.info("images: %s", ", ".join(names))

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gone = self._proc.poll() is not None if self._proc else self.pid() is None
            if gone:
                raise SandboxError(f"containerd exited during start-up; log tail:\n{self.log_tail()}")
            if self.paths.nri_socket.exists() and self.cri_ready():
                return
            time.sleep(0.2)
        raise SandboxError(f"containerd did not become ready in {timeout:.0f}s "
                           f"(CRI at {self.paths.socket}, NRI at {self.paths.nri_socket}); log tail:\n{self.log_tail()}")

    def down(self, purge: bool = False) -> None:
        """Remove pods, stop containerd, clean up what it left; purge also deletes the dir."""
        meta = self._read_meta()
        if meta and self.is_running() and self.cri_ready():
            self._remove_all_pods()
        if meta:
            meta.netns = sorted(set(meta.netns) | set(self._bundle_netns()))
            self._stop(meta.pid)
            self._cleanup_leftovers(meta)
        else:
            self._cleanup_leftovers(_Meta(self.config.runtime.value, 0, self.config.bridge, self.config.subnet))
        if purge and self.paths.dir.exists():
            left = _mounts_under(self.paths.dir)
            if left:
                raise SandboxError(f"not purging {self.paths.dir}: still mounted: {left}")
            shutil.rmtree(self.paths.dir)
        log.info("sandbox %s down%s", self.paths.dir, " (purged)" if purge else "")

    def restart(self, timeout: float = 60.0, while_down: Callable[[], object] | None = None) -> None:
        """Stop containerd (TERM, then KILL) and start it again on the same root and state,
        leaving running pods alone (unlike ``down`` + ``up``, which clean up after it).
        ``while_down`` runs between the two (what must happen while containerd is away)."""
        meta = self._read_meta()
        pid = self.pid()
        if meta is None or pid is None:
            raise SandboxError(f"sandbox {self.paths.dir} is not running")
        self._stop(pid)
        try:
            if while_down is not None:
                while_down()
        finally:  # containerd comes back whatever happened meanwhile
            self._start()
        new = self._read_meta()
        if new is not None:  # keep the pods' netns for a later down
            new.netns = sorted(set(meta.netns) | set(new.netns))
            self._write_meta(new)
        self.wait_ready(timeout)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.paths.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- internals --

    def _read_meta(self) -> _Meta | None:
        try:
            return _Meta(**json.loads(self.paths.meta.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _write_meta(self, meta: _Meta) -> None:
        tmp = self.paths.meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(meta), indent=2) + "\n")
        tmp.replace(self.paths.meta)

    def _claim_bridge(self) -> None:
        """Record this dir as the bridge's owner; refuse when another running sandbox owns it."""
        entry = BRIDGE_REGISTRY / self.config.bridge
        try:
            owner = Path(entry.read_text().strip())
        except OSError:
            owner = None
        if owner and owner != self.paths.dir:
            other = Sandbox(SandboxConfig(dir=owner, bridge=self.config.bridge))
            if other.is_running():
                raise SandboxError(f"bridge {self.config.bridge} is used by the running sandbox {owner}; "
                                   f"stop it first (sandbox --dir {owner} down) or pick another bridge")
        BRIDGE_REGISTRY.mkdir(parents=True, exist_ok=True)
        entry.write_text(f"{self.paths.dir}\n")

    def _owns_bridge(self, bridge: str) -> bool:
        try:
            return Path((BRIDGE_REGISTRY / bridge).read_text().strip()) == self.paths.dir
        except OSError:
            return True  # unregistered: whoever made it is gone

    def _start(self) -> None:
        cfg, p = self.config, self.paths
        self._claim_bridge()
        if not cfg.runtime.containerd.exists():
            raise SandboxError(f"{cfg.runtime.containerd} missing (run hack/install-deps.sh)")
        for d in (p.dir, p.root, p.state, p.cni_conf_dir, p.cni_ipam_dir, p.nri_plugin_dir,
                  p.nri_conf_dir, p.images, p.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        p.config.write_text(render_containerd_config(cfg))
        (p.cni_conf_dir / "10-rekindle.conflist").write_text(render_cni_conflist(cfg))
        for stale in (p.socket, p.nri_socket, Path(str(p.socket) + ".ttrpc")):
            stale.unlink(missing_ok=True)
        env = dict(os.environ)
        # A 2.x daemon must find its own shim first; 1.7 must not see a 2.x one.
        own = cfg.runtime is not Runtime.V1_7 or cfg.runtime.bin_dir != Path("/usr/bin")
        env["PATH"] = f"{cfg.runtime.bin_dir}:{SYSTEM_PATH}" if own else SYSTEM_PATH
        env.pop("CONTAINERD_ADDRESS", None)
        with open(p.log, "ab") as logf:
            logf.write(f"---- rekindle sandbox: starting containerd {cfg.runtime.value} at {time.ctime()}\n".encode())
            logf.flush()
            proc = subprocess.Popen([str(cfg.runtime.containerd), "--config", str(p.config)],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, cwd=str(p.dir))
        self._proc = proc
        self._write_meta(_Meta(cfg.runtime.value, proc.pid, cfg.bridge, cfg.subnet))
        log.info("started containerd %s (pid %d), log %s", cfg.runtime.value, proc.pid, p.log)

    def _remove_all_pods(self) -> None:
        try:
            with self.cri(timeout=60.0) as c:
                for pod in c.list_pods():
                    try:
                        c.stop_pod(pod.id)
                        c.remove_pod(pod.id)
                    except RekindleError as e:
                        log.warning("removing pod %s: %s", pod.id, e)
        except RekindleError as e:
            log.warning("listing pods: %s", e)

    def _bundle_netns(self) -> list[str]:
        out = []
        for spec in self.paths.bundles.glob("*/config.json"):
            try:
                nss = json.loads(spec.read_text()).get("linux", {}).get("namespaces", [])
            except (OSError, ValueError):
                continue
            out += [ns["path"] for ns in nss if ns.get("type") == "network" and ns.get("path")]
        return out

    def _stop(self, pid: int) -> None:
        if not pid or not _pid_alive(pid) or not any("containerd" in a for a in _cmdline(pid)[:1]):
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            _reap(pid)
            if not _pid_alive(pid):
                return
            time.sleep(0.1)
        log.warning("containerd %d ignored SIGTERM; killing it", pid)
        os.kill(pid, signal.SIGKILL)
        _reap(pid)

    def _cleanup_leftovers(self, meta: _Meta) -> None:
        p = self.paths
        netns = set(meta.netns) | set(self._bundle_netns())
        # Containers whose shim outlived containerd: force-delete them through runc.
        for bundle in sorted(p.bundles.glob("*")) if p.bundles.exists() else []:
            if (RUNC_ROOT / bundle.name).exists():
                runc = shutil.which("runc", path=f"{self.config.runtime.bin_dir}:{SYSTEM_PATH}") or "runc"
                subprocess.run([runc, "--root", str(RUNC_ROOT), "delete", "--force", bundle.name],
                               capture_output=True)
        for pid in self._shim_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for mp in _mounts_under(p.dir):
            _umount(mp)
        for ns in sorted(netns):
            if Path(ns).exists():
                _umount(ns)
                try:
                    Path(ns).unlink(missing_ok=True)
                except OSError as exc:  # still a mount point beneath a later bind of /run/netns: harmless
                    log.warning("leftover netns %s not removed: %s", ns, exc)
        if self._owns_bridge(meta.bridge):
            if subprocess.run(["ip", "link", "show", meta.bridge], capture_output=True).returncode == 0:
                subprocess.run(["ip", "link", "delete", meta.bridge], capture_output=True)
            (BRIDGE_REGISTRY / meta.bridge).unlink(missing_ok=True)
        for path in (p.state, p.cni_ipam_dir):
            if path.exists() and not _mounts_under(path):
                shutil.rmtree(path, ignore_errors=True)
        for f in (p.socket, p.nri_socket, Path(str(p.socket) + ".ttrpc"), p.meta):
            f.unlink(missing_ok=True)

    def _shim_pids(self) -> list[int]:
        """Shims started by this sandbox's containerd (their -address is our socket)."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            args = _cmdline(int(d.name))
            if args and "containerd-shim" in args[0] and self.address in args:
                pids.append(int(d.name))
        return pids


# --- CLI -------------------------------------------------------------------------------------

def _config_from_args(args: argparse.Namespace) -> SandboxConfig:
    cfg = SandboxConfig(dir=Path(args.dir))
    if getattr(args, "runtime", None):
        return SandboxConfig(dir=cfg.dir, runtime=Runtime(args.runtime))
    meta = Sandbox(cfg)._read_meta()  # down/status/env follow what is running
    return SandboxConfig(dir=cfg.dir, runtime=Runtime(meta.runtime), bridge=meta.bridge, subnet=meta.subnet) if meta else cfg


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sandbox", description="Local single-node containerd sandbox.")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="state directory (default: $REKINDLE_SANDBOX or %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start containerd and import the images")
    up.add_argument("--runtime", choices=[r.value for r in Runtime], default=Runtime.V1_7.value)
    up.add_argument("--no-images", action="store_true")
    down = sub.add_parser("down", help="remove pods, stop containerd, clean up")
    down.add_argument("--purge", action="store_true", help="also delete the state directory")
    sub.add_parser("status", help="print the sandbox's state as JSON")
    sub.add_parser("env", help="print shell exports for this sandbox")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[sandbox] %(message)s")
    sb = Sandbox(_config_from_args(args))
    try:
        if args.cmd == "up":
            sb.up(import_images=not args.no_images)
            print(f"[sandbox] up: containerd {sb.config.runtime.value}, socket {sb.address}, NRI {sb.paths.nri_socket}")
        elif args.cmd == "down":
            sb.down(purge=args.purge)
        elif args.cmd == "status":
            st = sb.status()
            print(json.dumps(asdict(st), indent=2))
            return 0 if st.running else 3
        elif args.cmd == "env":
            for k, v in sb.env().items():
                print(f"export {k}={v}")
    except RekindleError as e:
        print(f"[sandbox] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
