"""Node preflight checks, shared by ``rekindle doctor`` and by the test suite's skip reasons.

Each check returns ``Check(name, ok, detail, required)``; a failed required check fails the
doctor, a failed optional one is a warning. The checks do what the plugin would do, not only
look for files: ``criu check``, containerd's API (the CRI Version call), the store (a file is
written and removed; free space), the HMAC key (read as the plugin reads it), and containerd's
config as containerd merges it (``imports`` included), for NRI. The NRI socket itself is
checked by ``nri_plugin.preflight`` (a ttrpc exchange needs the NRI transport).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runtime.containerd.defaults import DEFAULT_SOCKET, NRI_PLUGIN
from runtime.criu import CRIU, MIN_VERSION, parse_version, version_tuple
from runtime.errors import ConfigError, KeyMissing
from runtime.proc.thp import read_mode
from runtime.store import read_key


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _run(argv: list[str], timeout: float = 10) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return 127, str(exc)


def check_root() -> Check:
    return Check("root", os.geteuid() == 0, "running as root" if os.geteuid() == 0 else "must run as root")


def check_criu(criu: str = CRIU) -> Check:
    """The CRIU binary the engine runs (``runtime.criu.command.CRIU``): recent enough, and ``criu check``."""
    rc, out = _run([criu, "--version"])
    if rc != 0:
        return Check("criu", False, f"{criu} not usable: {out[:200]}")
    version = parse_version(out) or "?"
    if (version_tuple(version) or ()) < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        return Check("criu", False, f"CRIU {version} is too old (need >= {need}: 3.17 fails on current kernels, "
                     "4.1 cannot dump TCP sockets on >= 6.16)")
    rc, out = _run([criu, "check"], timeout=30)
    return Check("criu", rc == 0, f"CRIU {version}: {out.splitlines()[-1] if out else rc}")


CAP_SYS_RESOURCE = 24
NOBODY = 65534


def _has_cap(cap: int, status: str = "/proc/self/status") -> bool:
    with open(status) as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    return bool(int(fields["CapEff"].strip(), 16) >> cap & 1)


def _dumps_another_uid(criu: str) -> tuple[bool, str]:
    """Dump (and leave running) a process of uid nobody, as a checkpoint of a non-root tree would."""
    with tempfile.TemporaryDirectory(prefix="rekindle-doctor-") as images:
        try:
            sleeper = subprocess.Popen(["sleep", "30"], user=NOBODY, group=NOBODY, extra_groups=[],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
        except OSError as exc:
            return False, f"cannot start a probe process as uid {NOBODY}: {exc}"
        try:
            rc, _ = _run([criu, "dump", "-t", str(sleeper.pid), "-D", images, "--leave-running",
                          "-o", "dump.log"], timeout=30)
            try:
                log = Path(images, "dump.log").read_text(errors="replace")
            except OSError:
                log = ""
        finally:
            sleeper.kill()
            sleeper.wait()
    # CRIU's own first error (raising its RLIMIT_NOFILE) is harmless; the dump's is the one
    errors = [ln.split("): ", 1)[-1] for ln in log.splitlines() if "Error (criu/cr-dump.c" in ln]
    return rc == 0, (errors[0] if errors else f"exit {rc}")


def check_nonroot(criu: str = CRIU) -> Check:
    """What the node can do for pods whose processes run as another uid than CRIU's (a non-root
    user, or a root parent whose workers drop to one). Reading (and setting) another uid's rlimits
    with prlimit(2) needs CAP_SYS_RESOURCE, which some nodes drop from the bounding set; the
    project's CRIU reads /proc/<pid>/limits instead (hack/criu-patches), the agent lowers a
    restored tree's limits as the tree's owner with util-linux prlimit (runtime.proc.rlimits)."""
    if _has_cap(CAP_SYS_RESOURCE):
        return Check("non-root-pods", True, "CAP_SYS_RESOURCE held: trees of any uid checkpoint and restore",
                     required=False)
    ok, why = _dumps_another_uid(criu)
    helper = shutil.which("prlimit")
    if ok and helper:
        return Check("non-root-pods", True, "no CAP_SYS_RESOURCE: this CRIU dumps processes of another uid "
                     "(limits read from /proc/<pid>/limits), restored ones get the target's limits through "
                     f"{helper} run as their owner (a process whose real and effective uids differ restores "
                     "cold when its limits must be lowered)",
                     required=False)
    cannot = []
    if not ok:
        cannot.append(f"checkpoints of pods with a process of a non-root uid (a runAsNonRoot pod, workers that "
                      f"drop to another user) fail ({why}): rebuild CRIU with hack/build-criu.sh, whose patch "
                      "reads /proc/<pid>/limits; pods whose processes all run as root work, restores of any work")
    if not helper:
        cannot.append("restores into non-root containers start cold (util-linux prlimit is missing)")
    return Check("non-root-pods", False, "no CAP_SYS_RESOURCE: " + "; ".join(cannot), required=False)


def check_binary(name: str, required: bool = True) -> Check:
    path = shutil.which(name)
    return Check(name, path is not None, path or f"{name} not found in PATH", required)


def check_cuda() -> Check:
    try:
        from runtime.gpu import CudaCheckpointer
    except ImportError as exc:
        return Check("cuda", False, str(exc), required=False)
    try:
        cp = CudaCheckpointer()
        gpus = cp.gpus()
        detail = f"driver {cp.driver_version()}, {len(gpus)} GPU(s): " + ", ".join(g.name for g in gpus)
        cp.close()
        return Check("cuda", True, detail, required=False)
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable CUDA here"
        return Check("cuda", False, f"no usable CUDA driver: {exc}", required=False)


def check_stream() -> Check:
    """What the streamed restore path (``--restore-path stream``) needs; without it that path
    falls back to the bulk one, with the reason logged."""
    from runtime.pages.stream import unsupported
    why = unsupported()
    if why is None:
        return Check("stream-restore", True, "userfaultfd with FORK/REMAP/REMOVE/UNMAP events; "
                     "CRIU's --lazy-pages hand-off", required=False)
    return Check("stream-restore", False, f"{why}: --restore-path stream falls back to bulk", required=False)


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def check_thp(path: str = THP_ENABLED) -> Check:
    """The node's transparent huge page mode. Under ``madvise`` the CUDA driver's host copy of a
    checkpointed process gets no huge pages; under ``always`` it does, and the checkpoint (and a
    restore from it) is faster. Either the node's setting (it holds for every process of the
    node), or the plugin's ``--checkpoint-thp always``, which switches it for the seconds of each
    CUDA checkpoint only (runtime.proc.thp; docs/install.md, "Transparent huge pages")."""
    try:
        mode = read_mode(path)
    except (OSError, ValueError) as exc:
        return Check("thp", False, f"{path}: {exc}", required=False)
    if mode == "always":
        return Check("thp", True, "always: the CUDA driver's host copies get huge pages", required=False)
    return Check("thp", False, f"{mode}: the CUDA driver's host copy at a checkpoint gets no huge pages unless the "
                 "plugin runs with --checkpoint-thp always (switched for each CUDA checkpoint only); `always` "
                 "took a 16.8 GiB CUDA checkpoint from 7.6-8.9 s to 5.0-5.7 s (docs/install.md)", required=False)


def check_cache(path: str, max_bytes: int) -> Check:
    """The node cache (``runtime.pages.nodecache``): where, how full, on which file system."""
    from runtime.pages import uffd
    from runtime.pages.nodecache import TMPFS_MAGIC, NodeCache, fs_magic
    if max_bytes == 0:
        return Check("node-cache", True, "off (--cache-bytes 0): every restore reads the store", required=False)
    cache = NodeCache(path, max_bytes)
    entries = cache.entries()
    used = sum(e.bytes for e in entries)
    try:
        if fs_magic(path) == TMPFS_MAGIC:
            why = uffd.probe_minor(path)
            kind = "tmpfs" + ("; a streamed first restore maps the ranges it serves from the entry it makes"
                              if why is None else f"; a streamed first restore copies what it serves ({why})")
        else:
            kind = ("disk (mapped ranges get 4 KiB pages; a streamed first restore copies what it serves: "
                    "mapping as it serves needs a tmpfs)")
    except OSError:
        kind = "not made yet"
    return Check("node-cache", True, f"{path}: {len(entries)} entries, {used / 2**20:.1f} of "
                 f"{max_bytes / 2**20:.0f} MiB, on {kind}" + "".join(
                     f"; {e.label} {e.version} {e.bytes / 2**20:.0f} MiB{' (in use)' if e.in_use else ''}"
                     for e in entries[:8]), required=False)


def check_hmac_key(path: str) -> Check:
    """The plugin's key, read with the plugin's checks. Absent is a warning (the plugin may be
    about to create it); present but unusable fails, since the plugin would refuse to start."""
    try:
        read_key(path)
    except KeyMissing as exc:
        return Check("hmac-key", False, f"{exc} (the chart mounts it from its Secret; "
                     "`rekindle plugin --create-key` creates it)", required=False)
    except ConfigError as exc:
        return Check("hmac-key", False, str(exc))
    return Check("hmac-key", True, f"{path}: 32 bytes, owner and mode ok")


def check_containerd_api(socket_path: str, timeout: float = 3.0) -> tuple[Check, str]:
    """containerd answers its CRI Version call; returns the check and the runtime's version."""
    if not os.path.exists(socket_path):
        return Check("containerd-api", False, f"no socket at {socket_path}"), ""
    from runtime.containerd.cri_lookup import CriLookup
    try:
        with CriLookup(socket_path, timeout=timeout) as cri:
            v = cri.version()
    except Exception as exc:  # noqa: BLE001 - any failure: containerd is not answering
        return Check("containerd-api", False, f"{socket_path}: {exc}"), ""
    return (Check("containerd-api", True, f"{v.runtime_name} {v.runtime_version} (CRI {v.runtime_api_version}) "
                  f"at {socket_path}"), v.runtime_version)


def _load_merged(path: str) -> tuple[dict[str, Any], list[str]]:
    """containerd's config as containerd reads it: the file, then its ``imports`` in order, each
    merged over the result (tables deeply, later values winning). Returns (config, files read)."""
    merged: dict[str, Any] = {}
    read: list[str] = []
    pending = [os.path.abspath(path)]
    while pending:
        current = pending.pop(0)
        if current in read:
            continue
        with open(current, "rb") as f:
            doc = tomllib.load(f)
        read.append(current)
        for pattern in doc.get("imports", []) or []:
            pattern = pattern if os.path.isabs(pattern) else os.path.join(os.path.dirname(current), pattern)
            pending.extend(sorted(glob.glob(pattern)))
        _merge(merged, doc)
    return merged, read


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def check_nri_config(path: str, containerd_version: str = "", socket_path: str = "") -> Check:
    """NRI as containerd's config leaves it: on (``disable = false``; the default from 2.0),
    accepting external plugins, on the expected socket."""
    try:
        config, files = _load_merged(path)
    except FileNotFoundError:
        return Check("nri-config", False, f"{path} not found here (mounted in this container?); containerd "
                     "defaults: NRI off on 1.7, on from 2.0", required=False)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return Check("nri-config", False, f"{path}: {exc}", required=False)
    nri = (config.get("plugins") or {}).get(NRI_PLUGIN) or {}
    m = re.match(r"v?(\d+)\.", containerd_version or "")
    major = int(m.group(1)) if m else None
    where = " + ".join(files)
    disable = nri.get("disable")
    if disable is None:
        if major is None:
            return Check("nri-config", False, f"{where}: NRI's 'disable' is unset: on for containerd 2.x, "
                         "off for 1.7 (containerd's version unknown)", required=False)
        if major < 2:
            return Check("nri-config", False, f"{where}: NRI is off (containerd {containerd_version} defaults "
                         "to disable = true; rekindle nri-toggle)")
    elif disable:
        return Check("nri-config", False, f"{where}: NRI is off (disable = true; rekindle nri-toggle)")
    if nri.get("disable_connections"):
        return Check("nri-config", False, f"{where}: NRI refuses external plugins (disable_connections = true)")
    configured = nri.get("socket_path", DEFAULT_SOCKET)
    if socket_path and os.path.normpath(configured) != os.path.normpath(socket_path):
        return Check("nri-config", False, f"{where}: NRI listens on {configured}, not on {socket_path}")
    return Check("nri-config", True, f"{where}: NRI on, socket {configured}")


STORE_LOW = 10 * 2**30  # below this, a GPU artifact (tens of GiB) may not fit


def check_store(path: str) -> list[Check]:
    """The store is writable (a file is created, synced and removed) and has room."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".doctor-")
    except OSError as exc:
        return [Check("store", False, f"{path}: not writable: {exc}")]
    try:
        os.write(fd, b"x")
        os.fsync(fd)
    except OSError as exc:
        return [Check("store", False, f"{path}: write failed: {exc}")]
    finally:
        os.close(fd)
        os.unlink(tmp)
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    gib = f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
    return [Check("store", True, f"{path}: writable, {gib}"),
            Check("store-space", free >= STORE_LOW, gib if free >= STORE_LOW else
                  f"only {gib}: GPU artifacts take tens of GiB", required=False)]


class DoctorSettings(Protocol):
    """What the checks read of the plugin's settings (``nri_plugin.config.Settings``); an empty
    ``socket_path`` or ``containerd_config`` skips its check."""

    @property
    def socket_path(self) -> str: ...
    @property
    def containerd_socket(self) -> str: ...
    @property
    def containerd_config(self) -> str: ...
    @property
    def store(self) -> str: ...
    @property
    def key_path(self) -> Path: ...
    def init_source(self) -> str | None: ...


def run_checks(settings: DoctorSettings) -> list[Check]:
    checks = [check_root(), check_criu(),
              check_binary("nsenter"), check_binary("unshare")]
    init = settings.init_source()
    checks.append(Check("rekindle-init", init is not None, init or "not built (run make)"))
    sock = settings.socket_path
    if sock:
        checks.append(Check("nri-socket", os.path.exists(sock),
                            sock if os.path.exists(sock) else f"{sock} missing: is NRI enabled? (rekindle nri-toggle)"))
    api, version = check_containerd_api(settings.containerd_socket)
    checks.append(api)
    config = settings.containerd_config
    if config:
        checks.append(check_nri_config(config, version, sock))
    checks.extend(check_store(settings.store))
    checks.append(check_hmac_key(str(settings.key_path)))
    checks.append(check_cuda())
    checks.append(check_thp())
    checks.append(check_stream())
    checks.append(check_nonroot())
    return checks
