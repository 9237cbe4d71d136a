"""Node preflight checks, shared by ``rekindle doctor`` and by the test suite's skip reasons."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, KeyMissing
from .keys import read_key


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


def check_criu(criu: str = "criu") -> Check:
    rc, out = _run([criu, "--version"])
    if rc != 0:
        return Check("criu", False, f"{criu} not usable: {out[:200]}")
    version = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version")), "?")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < (4, 2):
        return Check("criu", False, f"CRIU {version} is too old (need >= 4.2: 3.17 fails on current kernels, 4.1 cannot dump TCP sockets on >= 6.16)")
    rc, out = _run([criu, "check"], timeout=30)
    return Check("criu", rc == 0, f"CRIU {version}: {out.splitlines()[-1] if out else rc}")


def check_binary(name: str, required: bool = True) -> Check:
    path = shutil.which(name)
    return Check(name, path is not None, path or f"{name} not found in PATH", required)


def check_cuda() -> Check:
    try:
        from .cuda import CudaCheckpointer
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


def run_checks(settings: Any) -> list[Check]:
    checks = [check_root(), check_criu(getattr(settings, "criu_bin", "criu")),
              check_binary("nsenter"), check_binary("unshare")]
    init = settings.init_source()
    checks.append(Check("rekindle-init", init is not None, init or "not built (run make)"))
    sock = getattr(settings, "socket_path", "")
    if sock:
        checks.append(Check("nri-socket", os.path.exists(sock),
                            sock if os.path.exists(sock) else f"{sock} missing: is NRI enabled? (rekindle nri-toggle)"))
    checks.append(Check("containerd-socket", os.path.exists(settings.containerd_socket), settings.containerd_socket))
    checks.append(check_hmac_key(str(settings.key_path)))
    checks.append(check_cuda())
    return checks
