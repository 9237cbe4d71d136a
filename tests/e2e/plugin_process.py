"""Run the real ``rekindle plugin`` as a subprocess against a sandbox's containerd."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.waiting import WaitTimeout, wait_for

REPO = Path(__file__).resolve().parents[2]


class PluginProcess:
    def __init__(self, sandbox, workdir: Path, idx: str = "50", extra_args: list[str] | None = None) -> None:
        self.sandbox = sandbox
        self.workdir = workdir
        self.idx = idx
        # e.g. ["--metrics-port", "PORT", "--events", ...]; without it, no HTTP endpoint (several
        # plugins run on this host at once, and 9464 is the chart's port, not a test's)
        self.extra_args = list(extra_args or [])
        self.state_dir = workdir / "state"
        self.store = workdir / "store"
        self.log_path = workdir / "plugin.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}  # extra environment for the next start()

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "nri_plugin", "plugin", "-v",
                "--socket-path", str(self.sandbox.nri_socket), "--idx", self.idx,
                "--state-dir", str(self.state_dir), "--store", str(self.store),
                "--containerd-socket", str(self.sandbox.containerd_socket),
                "--containerd-state", str(self.sandbox.state_dir),
                "--init-binary", str(REPO / "build" / "rekindle-init"),
                "--create-key",  # run from the host, the plugin makes its own key in its state dir
                *(self.extra_args if "--metrics-port" in self.extra_args else ["--metrics-port", "0",
                                                                               *self.extra_args])]

    def start(self, wait: bool = True) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        log.close()
        if wait:
            try:
                self.wait_log("synchronized:", count=self.log().count("synchronized:") + 1)
            except BaseException:
                self.kill()  # a plugin left running would join the next test's containerd
                raise

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, needle: str, count: int = 1, timeout: float = 20.0) -> str:
        def seen() -> str | None:
            text = self.log()
            if text.count(needle) >= count:
                return text
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"plugin exited ({self.proc.returncode}):\n{text[-3000:]}")
            return None
        try:
            return wait_for(seen, timeout, f"{needle!r} x{count} in the plugin log", interval=0.1)
        except WaitTimeout:
            raise AssertionError(f"plugin log lacks {needle!r} x{count} after {timeout}s:\n{self.log()[-3000:]}") \
                from None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def drop_store(self) -> None:
        """Remove the store's artifacts (gigabytes over a run; the disk of a CI machine is not
        endless). The plugin's log and state dir stay for a failure's post-mortem."""
        shutil.rmtree(self.store, ignore_errors=True)

    def control_dir(self, pod_uid: str, container: str) -> Path:
        return self.state_dir / "control" / pod_uid / container


def build_native() -> None:
    subprocess.run(["make", "-C", str(REPO), "--no-print-directory"], check=True, capture_output=True)
