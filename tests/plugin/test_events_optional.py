"""The Kubernetes client is an optional extra (``rekindle[kubernetes]``): without it the plugin
still starts, says once at start that Events are off, and `rekindle doctor` says so too."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from nri_plugin import agent
from nri_plugin.config import Settings
from runtime.status import StatusBook

from .fake_runtime import FakeRuntime

REPO = Path(__file__).resolve().parents[2]
WARNING = "--events is on but the Kubernetes client cannot be imported"


@pytest.fixture
def no_kubernetes(monkeypatch):
    """`import kubernetes` (and every submodule) raises ImportError, as where it is not installed."""
    for name in [n for n in sys.modules if n == "kubernetes" or n.startswith("kubernetes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kubernetes", None)


def _settings(tmp_path: Path, **kw) -> Settings:
    return Settings.from_flags(dict(state_dir=str(tmp_path), store=str(tmp_path / "store"), metrics_port=0,
                                    events=True, node_name="node-a", **kw))


def test_reporting_without_the_client_warns_once_and_reports_no_events(tmp_path, no_kubernetes, caplog):
    caplog.set_level(logging.INFO, logger="nri_plugin")
    metrics, _health, endpoint, kube = agent._reporting(_settings(tmp_path), StatusBook(str(tmp_path)))
    assert kube is None and endpoint is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and WARNING in warnings[0].getMessage(), caplog.text
    assert "rekindle[kubernetes]" in warnings[0].getMessage()
    assert "reporting outcomes to Kubernetes" not in caplog.text


def test_reporting_with_events_off_says_nothing_about_the_client(tmp_path, no_kubernetes, caplog):
    caplog.set_level(logging.INFO, logger="nri_plugin")
    *_, kube = agent._reporting(Settings.from_flags(dict(state_dir=str(tmp_path), store=str(tmp_path),
                                                                    metrics_port=0)),
                                StatusBook(str(tmp_path)))
    assert kube is None
    assert WARNING not in caplog.text


def test_doctor_reports_the_missing_client_as_a_warning(tmp_path, no_kubernetes):
    from nri_plugin.preflight import check_kubernetes_client, run_checks
    check = check_kubernetes_client(events=True)
    assert not check.ok and not check.required
    assert "--events is on" in check.detail and "rekindle[kubernetes]" in check.detail
    names = {c.name: c for c in run_checks(Settings(state_dir=str(tmp_path), store=str(tmp_path),
                                                    socket_path="", containerd_config=""))}
    assert not names["kubernetes-client"].ok and not names["kubernetes-client"].required


def test_doctor_with_the_client_installed():
    from nri_plugin.preflight import check_kubernetes_client
    check = check_kubernetes_client(events=False)
    assert check.ok, check.detail


def _stub_path(tmp_path: Path) -> Path:
    """A directory that shadows the installed client with a package that cannot be imported."""
    stub = tmp_path / "stub" / "kubernetes"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'kubernetes'\")\n")
    return stub.parent


def test_the_plugin_starts_without_the_client_and_runs_with_events_off(tmp_path):
    """The real plugin process with --events, where `import kubernetes` fails: it registers with
    the runtime and synchronizes, logs the one warning, and stops cleanly."""
    sock = str(tmp_path / "nri.sock")
    state = tmp_path / "state"
    env = dict(os.environ, PYTHONPATH=f"{_stub_path(tmp_path)}{os.pathsep}{REPO}", NODE_NAME="node-a")
    env.pop("NRI_PLUGIN_SOCKET", None)
    argv = [sys.executable, "-m", "nri_plugin", "plugin", "--log-format", "json", "--socket-path", sock,
            "--state-dir", str(state), "--store", str(state / "store"), "--create-key", "--events",
            "--metrics-port", "0", "--init-binary", "/bin/true",
            "--containerd-socket", str(tmp_path / "no-containerd.sock")]

    async def body() -> tuple[int, bytes]:
        async with FakeRuntime(sock) as rt:
            proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=str(tmp_path),
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.PIPE)
            try:
                # Registration, or the process exiting first (the old code: ImportError at start).
                register = asyncio.ensure_future(rt.next_plugin(timeout=60))
                exited = asyncio.ensure_future(proc.wait())
                await asyncio.wait({register, exited}, return_when=asyncio.FIRST_COMPLETED)
                if register.done():
                    await (register.result()).handshake()  # registered, configured, synchronized: it runs
                else:
                    register.cancel()
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            await asyncio.gather(register, exited, return_exceptions=True)
            assert register.done() and not register.cancelled(), err.decode()[-3000:]
            return proc.returncode, err

    rc, err = asyncio.run(body())
    lines = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    text = err.decode()
    assert rc == 0, text[-3000:]
    warnings = [rec for rec in lines if rec.get("level") == "warning" and WARNING in rec.get("msg", "")]
    assert len(warnings) == 1, text[-3000:]
    assert "reporting outcomes to Kubernetes" not in text
