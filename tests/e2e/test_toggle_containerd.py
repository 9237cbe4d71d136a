"""The NRI toggle on the real default configs of containerd 1.7, 2.1, 2.2 and 2.4, run for real.

For each runtime: `containerd config default` -> private root/state/sockets -> containerd_config.apply
-> start containerd with the result -> the NRI socket appears and the log says NRI is on.
The 1.7 default has NRI disabled, so the same config without the toggle must not open the socket.
The drop-in mode (dropin.apply_drop_in) is checked the same way, plus `containerd config
dump`: the merged config containerd itself computes from the main file and its imports.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomlkit

from devtools.sandbox import Runtime
from nri_plugin.node import containerd_config, dropin

BOOTED = "containerd successfully booted"
NRI_ON_LOG = ("created NRI interface", 'Registered namespace \\"k8s.io\\" with NRI')


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Short path: unix socket paths are limited to 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="rk-toggle-"))
    yield d
    subprocess.run(["umount", "-R", str(d)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def default_config(runtime: Runtime, workdir: Path) -> Path:
    """containerd's own default config, pointed at private paths (the only edit besides the toggle)."""
    if not runtime.containerd.exists():
        pytest.skip(f"{runtime.containerd} missing (hack/install-deps.sh)")
    text = subprocess.run([str(runtime.containerd), "config", "default"], check=True, capture_output=True,
                          text=True).stdout
    doc = tomlkit.parse(text)
    doc["root"] = str(workdir / "root")
    doc["state"] = str(workdir / "state")
    # Version 4 (containerd >= 2.3) moved the servers into plugins.
    servers = doc["plugins"] if runtime.config_version >= 4 else doc
    grpc, ttrpc = ("io.containerd.server.v1.grpc", "io.containerd.server.v1.ttrpc") \
        if runtime.config_version >= 4 else ("grpc", "ttrpc")
    servers[grpc]["address"] = str(workdir / "containerd.sock")
    servers[ttrpc]["address"] = str(workdir / "containerd.sock.ttrpc")
    doc["plugins"]["io.containerd.internal.v1.opt"]["path"] = str(workdir / "opt")
    cfg = workdir / "config.toml"
    cfg.write_text(tomlkit.dumps(doc))
    return cfg


def run_containerd(runtime: Runtime, cfg: Path, nri_socket: Path, wait: float = 30) -> tuple[bool, str]:
    """Start containerd, wait until it booted and (up to `wait` s) for the NRI socket, stop it.

    Returns (socket seen, log)."""
    log_path = cfg.with_name("containerd.log")
    env = {"PATH": f"{runtime.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([str(runtime.containerd), "--config", str(cfg)], stdout=logf,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    seen = False
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and proc.poll() is None:
            seen = nri_socket.exists()
            if seen and BOOTED in log_path.read_text(errors="replace"):
                break
            if not seen and BOOTED in log_path.read_text(errors="replace") and time.monotonic() > deadline - wait + 3:
                break  # booted 3 s ago and still no socket
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return seen, log_path.read_text(errors="replace")


@pytest.mark.parametrize("runtime", list(Runtime), ids=lambda r: f"containerd-{r.value}")
def test_toggle_turns_nri_on(runtime: Runtime, workdir: Path) -> None:
    cfg = default_config(runtime, workdir)
    nri_socket = workdir / "nri.sock"
    res = containerd_config.apply(cfg, socket_path=str(nri_socket))
    assert res.changed and res.restart_needed
    assert res.version == runtime.config_version
    assert res.backup_path is not None and res.backup_path.exists()
    assert not containerd_config.apply(cfg, socket_path=str(nri_socket)).changed

    seen, log = run_containerd(runtime, cfg, nri_socket, wait=30)
    assert seen, f"NRI socket {nri_socket} never appeared; log tail:\n" + "\n".join(log.splitlines()[-30:])
    for marker in NRI_ON_LOG:
        assert marker in log, f"{marker!r} not in the containerd log"


def test_untoggled_1_7_default_keeps_nri_off(workdir: Path) -> None:
    cfg = default_config(Runtime.V1_7, workdir)
    doc = tomlkit.parse(cfg.read_text())
    nri_socket = workdir / "nri.sock"
    doc["plugins"]["io.containerd.nri.v1.nri"]["socket_path"] = str(nri_socket)  # private, still disabled
    cfg.write_text(tomlkit.dumps(doc))
    seen, log = run_containerd(Runtime.V1_7, cfg, nri_socket)
    assert BOOTED in log
    assert not seen
    assert "created NRI interface" not in log


def config_dump(runtime: Runtime, cfg: Path) -> dict:
    out = subprocess.run([str(runtime.containerd), "--config", str(cfg), "config", "dump"], check=True,
                         capture_output=True, text=True).stdout
    return tomllib.loads(out)


@pytest.mark.parametrize("runtime", list(Runtime), ids=lambda r: f"containerd-{r.value}")
def test_drop_in_turns_nri_on_and_keeps_the_operators_nri_settings(runtime: Runtime, workdir: Path) -> None:
    cfg = default_config(runtime, workdir)
    # An operator's own NRI setting in the main config: containerd 1.7 replaces a plugin's whole
    # table with an imported one, so the drop-in must carry it.
    doc = tomlkit.parse(cfg.read_text())
    doc["plugins"][containerd_config.NRI_PLUGIN]["plugin_request_timeout"] = "7s"
    cfg.write_text(tomlkit.dumps(doc))
    main_before = cfg.read_text()
    nri_socket = workdir / "nri.sock"
    drop_in = workdir / "conf.d" / dropin.DROP_IN_NAME

    res = dropin.apply_drop_in(cfg, drop_in, socket_path=str(nri_socket))
    assert res.changed and res.import_added and res.version == runtime.config_version
    assert not dropin.apply_drop_in(cfg, drop_in, socket_path=str(nri_socket)).changed
    # The main config gained only the import; NRI's table there still says what it said.
    assert tomllib.loads(cfg.read_text())["plugins"] == tomllib.loads(main_before)["plugins"]

    merged = config_dump(runtime, cfg)
    nri = merged["plugins"][containerd_config.NRI_PLUGIN]
    assert (nri["disable"], nri["disable_connections"], nri["socket_path"]) == (False, False, str(nri_socket))
    assert nri["plugin_request_timeout"] == "7s"
    assert str(drop_in) in merged["imports"]

    seen, log = run_containerd(runtime, cfg, nri_socket, wait=30)
    assert seen, f"NRI socket {nri_socket} never appeared; log tail:\n" + "\n".join(log.splitlines()[-30:])
    assert "created NRI interface" in log
