"""examples/hook/rekindle_hook.py: the control-dir protocol against a fake engine HTTP server,
and the supervisor run as a process with a fake engine command."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.waiting import wait_for

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")

HOOK = Path(__file__).resolve().parents[2] / "examples" / "hook" / "rekindle_hook.py"
_spec = importlib.util.spec_from_file_location("rekindle_hook", HOOK)
assert _spec and _spec.loader
hook = importlib.util.module_from_spec(_spec)
sys.modules["rekindle_hook"] = hook
_spec.loader.exec_module(hook)

DEADLINE = 20.0


class FakeEngine:
    """An engine's HTTP API: /health is 503 for the first `unhealthy` calls; every request recorded."""

    def __init__(self, unhealthy: int = 2, status: dict[str, int] | None = None) -> None:
        self.requests: list[tuple[str, str, object]] = []
        self.unhealthy = unhealthy
        self.status = status or {}
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                engine.requests.append((self.command, self.path, body))
                code = engine.status.get(self.path, 200)
                if self.path == "/health" and engine.unhealthy > 0:
                    engine.unhealthy -= 1
                    code = 503
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def calls(self) -> list[tuple[str, str, object]]:
        """Requests other than health checks."""
        return [r for r in self.requests if r[1] != "/health"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.close()


@pytest.fixture
def control(tmp_path: Path) -> Path:
    d = tmp_path / "rekindle"
    d.mkdir()
    return d


def start(life) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def body() -> None:
        try:
            result["outcome"] = life.run()
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, result


def finish(t: threading.Thread, result: dict):
    t.join(DEADLINE)
    assert not t.is_alive(), "the hook did not finish"
    if "error" in result:
        raise result["error"]
    return result["outcome"]


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """Where the container's /tmp would be."""
    (tmp_path / "container-tmp").mkdir()
    return tmp_path / "container-tmp" / "rekindle-engine-serving"


def lifecycle(engine: FakeEngine, control: Path | None, marker: Path, *, source: bool = True, eng=None, **kw):
    return hook.Lifecycle(engine=eng or hook.VLLM(), http=hook.Http(f"http://127.0.0.1:{engine.port}", timeout=5),
                          control=control, source=source, marker=marker, **kw)


SLEEP = [("POST", "/sleep?level=1", None), ("POST", "/wake_up?tags=weights", None)]


def test_vllm_source_sleeps_writes_ready_and_the_restored_copy_wakes(engine, control, marker):
    marker.write_text("stale")  # left from an earlier run: not serving now
    t, res = start(lifecycle(engine, control, marker))
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready-for-checkpoint")
    assert engine.requests[0] == ("GET", "/health", None) and engine.unhealthy == 0  # waited for health
    assert engine.calls() == SLEEP
    assert (control / hook.READY).read_text() == "vllm\n"
    assert not marker.exists()
    (control / hook.RESTORE_COMPLETE).write_text("")
    assert finish(t, res) is hook.Outcome.RESTORED
    assert engine.calls() == SLEEP + [("POST", "/wake_up", None)]
    assert marker.read_text() == "vllm\n"
    # written by rename: no temp files left beside them
    assert sorted(p.name for p in control.iterdir()) == sorted([hook.READY, hook.RESTORE_COMPLETE])
    assert [p.name for p in marker.parent.iterdir()] == [marker.name]


def test_source_after_its_checkpoint_does_not_touch_the_engine(engine, control, marker):
    t, res = start(lifecycle(engine, control, marker))
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    (control / hook.SNAPSHOT_COMPLETE).write_text("qwen-7b\n")
    assert finish(t, res) is hook.Outcome.CHECKPOINTED
    assert engine.calls() == SLEEP  # its CUDA state may still be checkpointed (after-checkpoint: exit)
    assert not marker.exists()


def test_source_that_keeps_running_wakes_after_its_checkpoint(engine, control, marker):
    t, res = start(lifecycle(engine, control, marker, resume_after_checkpoint=True))
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    (control / hook.SNAPSHOT_COMPLETE).write_text("qwen-7b\n")
    assert finish(t, res) is hook.Outcome.CHECKPOINTED
    assert engine.calls() == SLEEP + [("POST", "/wake_up", None)]
    assert marker.exists()


def test_failed_checkpoint_wakes_the_engine(engine, control, marker):
    t, res = start(lifecycle(engine, control, marker))
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    (control / hook.CHECKPOINT_FAILED).write_text("criu dump failed\n")
    assert finish(t, res) is hook.Outcome.FAILED
    assert engine.calls()[-1] == ("POST", "/wake_up", None)


def test_no_checkpoint_in_time_wakes_the_engine(engine, control, marker):
    t, res = start(lifecycle(engine, control, marker, checkpoint_timeout=0.5))
    assert finish(t, res) is hook.Outcome.TIMED_OUT
    assert engine.calls() == SLEEP + [("POST", "/wake_up", None)]
    assert marker.exists()


def test_time_frozen_between_checkpoint_and_restore_does_not_count(engine, control, marker):
    """Restored on a node whose monotonic clock is far ahead: the wait goes on."""
    jump = {"by": 0.0}
    life = lifecycle(engine, control, marker, checkpoint_timeout=60.0, clock=lambda: time.monotonic() + jump["by"])
    t, res = start(life)
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    jump["by"] = 1e6
    time.sleep(0.5)  # several polls see the jumped clock
    assert t.is_alive() and "timed-out" not in life.events
    (control / hook.RESTORE_COMPLETE).write_text("")
    assert finish(t, res) is hook.Outcome.RESTORED


def test_serve_role_releases_nothing(engine, marker):
    t, res = start(lifecycle(engine, None, marker, source=False))
    assert finish(t, res) is hook.Outcome.SERVING
    assert engine.calls() == []
    assert marker.exists()


def test_sglang_releases_and_resumes_the_kv_cache(engine, control, marker):
    t, res = start(lifecycle(engine, control, marker, eng=hook.SGLang()))
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    assert engine.calls() == [("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})]
    (control / hook.RESTORE_COMPLETE).write_text("")
    assert finish(t, res) is hook.Outcome.RESTORED
    assert engine.calls()[-1] == ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})


def test_an_engine_without_sleep_mode_is_never_marked_ready(control, marker):
    e = FakeEngine(unhealthy=0, status={"/sleep?level=1": 404})
    try:
        t, res = start(lifecycle(e, control, marker))
        with pytest.raises(hook.HookError, match=r"POST /sleep\?level=1 answered 404"):
            finish(t, res)
    finally:
        e.close()
    assert list(control.iterdir()) == [] and not marker.exists()


def test_source_without_a_control_dir_is_an_error(engine, marker):
    t, res = start(lifecycle(engine, None, marker))
    with pytest.raises(hook.HookError, match="no control dir"):
        finish(t, res)
    assert engine.calls() == []


# --- the supervisor, as a process ----------------------------------------------------------------------

FAKE_ENGINE = """
import pathlib, signal, sys, time
def stop(sig, frame):
    pathlib.Path(sys.argv[1]).write_text(str(sig))
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def supervise(engine, control, marker, tmp_path):
    procs: list[subprocess.Popen] = []

    def run(*extra: str, source: bool = True) -> tuple[subprocess.Popen, Path]:
        got = tmp_path / "engine-got-signal"
        env = {"PATH": os.environ["PATH"], "REKINDLE_CONTROL_DIR": str(control), hook.MARKER_ENV: str(marker)}
        if source:
            env["REKINDLE_CHECKPOINT"] = "qwen-7b"
        p = subprocess.Popen([sys.executable, str(HOOK), "run", "--engine", "vllm", "--port", str(engine.port),
                              "--stop-grace", "10", *extra, "--", sys.executable, "-c", FAKE_ENGINE, str(got)],
                             env=env, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p, got

    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_job_source_exits_0_after_its_checkpoint(supervise, control):
    p, got = supervise()
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    (control / hook.SNAPSHOT_COMPLETE).write_text("qwen-7b\n")
    assert p.wait(DEADLINE) == 0, p.stderr.read()
    assert got.read_text() == str(int(signal.SIGTERM))  # the engine was stopped


def test_sigterm_from_the_plugin_after_the_checkpoint_is_success(supervise, control):
    """rekindle.dev/after-checkpoint: exit: snapshot-complete, then SIGTERM to the workload root."""
    p, got = supervise()
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    (control / hook.SNAPSHOT_COMPLETE).write_text("qwen-7b\n")
    p.send_signal(signal.SIGTERM)
    assert p.wait(DEADLINE) == 0, p.stderr.read()
    assert got.exists()


def test_sigterm_before_a_checkpoint_exits_with_the_engine(supervise, control):
    p, got = supervise()
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    p.send_signal(signal.SIGTERM)
    assert p.wait(DEADLINE) == 3  # the fake engine's status on SIGTERM
    assert got.exists()


def test_failed_checkpoint_fails_the_job_with_the_reason(supervise, control, engine):
    p, got = supervise()
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready")
    (control / hook.CHECKPOINT_FAILED).write_text("criu dump failed (errno 5)\n")
    assert p.wait(DEADLINE) == 1
    assert "criu dump failed (errno 5)" in p.stderr.read()
    assert engine.calls()[-1] == ("POST", "/wake_up", None) and got.exists()


def test_restore_target_just_serves(supervise, control, engine, marker):
    p, got = supervise(source=False)
    wait_for(lambda: marker.exists(), DEADLINE, "serving")
    assert engine.calls() == [] and p.poll() is None
    env = {"PATH": os.environ["PATH"], hook.MARKER_ENV: str(marker)}
    assert subprocess.run([sys.executable, str(HOOK), "probe"], env=env).returncode == 0
    p.send_signal(signal.SIGTERM)
    assert p.wait(DEADLINE) == 3


def test_probe_fails_until_serving(tmp_path):
    marker = tmp_path / "rekindle-engine-serving"
    env = {"PATH": os.environ["PATH"], hook.MARKER_ENV: str(marker)}
    assert subprocess.run([sys.executable, str(HOOK), "probe"], env=env).returncode == 1
    marker.write_text("vllm\n")
    assert subprocess.run([sys.executable, str(HOOK), "probe"], env=env).returncode == 0


def test_the_marker_is_never_in_the_control_dir_or_a_volume():
    """A restarted restore container keeps its control dir (same pod and name) and its volumes;
    a marker there would pass the startup probe while the restore still runs."""
    marker = hook.serving_marker({"REKINDLE_CONTROL_DIR": "/rekindle"})
    assert marker == Path(hook.DEFAULT_MARKER) and not marker.is_relative_to("/rekindle")
    for f in ("source-job.yaml", "restore-deployment.yaml"):
        for engine in ("vllm", "sglang"):
            for d in yaml.safe_load_all((HOOK.parents[1] / engine / f).read_text()):
                for c in (d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
                    assert not any(marker.is_relative_to(m["mountPath"]) for m in c.get("volumeMounts", []))


def test_release_by_the_plugin_leaves_the_engine_to_the_annotations(engine, control, marker):
    """--release plugin: the plugin's before-checkpoint and after-restore calls do the release;
    the hook only says when to checkpoint and when the engine serves."""
    t, res = start(lifecycle(engine, control, marker, eng=hook.ByPlugin("vllm")))
    wait_for(lambda: (control / hook.READY).exists(), DEADLINE, "ready-for-checkpoint")
    assert engine.calls() == []
    (control / hook.RESTORE_COMPLETE).write_text("")
    assert finish(t, res) is hook.Outcome.RESTORED
    assert engine.calls() == [] and marker.read_text() == "vllm\n"
