"""The release path's HTTP calls (runtime.pod.hooks) and their annotations (nri_plugin.policy)."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nri_plugin.policy import decide
from runtime.errors import AnnotationError
from runtime.pod import hooks

SRC = {"rekindle.dev/checkpoint": "engine"}
DST = {"rekindle.dev/restore": "engine"}


def test_hook_annotations_parse_with_the_probe_host_rules():
    got = decide({**SRC, "rekindle.dev/before-checkpoint": "http://localhost:8000/sleep?level=1",
                  "rekindle.dev/after-restore": "http://[::1]:8000/wake_up",
                  "rekindle.dev/after-restore-timeout": "30"}, "c")
    assert got is not None
    assert got.before_checkpoint == hooks.Call("127.0.0.1", 8000, "/sleep?level=1", hooks.DEFAULT_TIMEOUT)
    assert got.after_restore == hooks.Call("::1", 8000, "/wake_up", 30)
    assert str(got.after_restore) == "http://[::1]:8000/wake_up"
    restore = decide({**DST, "rekindle.dev/after-restore": "http://:8000/wake_up"}, "c")
    assert restore is not None and restore.after_restore == hooks.Call("127.0.0.1", 8000, "/wake_up")
    assert decide(SRC, "c").before_checkpoint is None  # type: ignore[union-attr]


@pytest.mark.parametrize("extra, key", [
    ({"rekindle.dev/before-checkpoint": "http://engine.local:8000/sleep"}, "rekindle.dev/before-checkpoint"),
    ({"rekindle.dev/before-checkpoint": "https://127.0.0.1:8000/sleep"}, "rekindle.dev/before-checkpoint"),
    ({"rekindle.dev/before-checkpoint": "http://127.0.0.1/sleep"}, "rekindle.dev/before-checkpoint"),
    ({"rekindle.dev/before-checkpoint": "http://u:p@127.0.0.1:8000/"}, "rekindle.dev/before-checkpoint"),
    ({"rekindle.dev/after-restore": "http://127.0.0.1:8000/a b"}, "rekindle.dev/after-restore"),
    ({"rekindle.dev/after-restore": "http://127.0.0.1:8000/x\r\nX: y"}, "rekindle.dev/after-restore"),
    ({"rekindle.dev/after-restore": "http://127.0.0.1:8000/", "rekindle.dev/after-restore-timeout": "0"},
     "rekindle.dev/after-restore-timeout"),
    ({"rekindle.dev/after-restore": "http://127.0.0.1:8000/", "rekindle.dev/after-restore-timeout": "3601"},
     "rekindle.dev/after-restore-timeout"),
    ({"rekindle.dev/before-checkpoint-timeout": "5"}, "rekindle.dev/before-checkpoint-timeout"),
])
def test_bad_hook_annotations_name_their_key(extra, key):
    with pytest.raises(AnnotationError) as err:
        decide({**SRC, **extra}, "c")
    assert err.value.key == key


def test_before_checkpoint_is_for_sources_only():
    with pytest.raises(AnnotationError) as err:
        decide({**DST, "rekindle.dev/before-checkpoint": "http://127.0.0.1:8000/sleep"}, "c")
    assert err.value.key == "rekindle.dev/before-checkpoint"


class _Engine(BaseHTTPRequestHandler):
    answers: dict[str, int] = {}
    release = threading.Event()
    seen: list[tuple[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.command, self.path, self.headers["Content-Type"], body))
        code = self.answers.get(self.path.partition("?")[0], 200)
        if code == 0:
            self.release.wait(10)  # never in time: until the test ends
            return
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine():
    _Engine.answers = {"/fail": 500, "/hang": 0}
    _Engine.seen = []
    _Engine.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    server.daemon_threads = False  # server_close joins the handlers: no thread outlives the test
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    try:
        yield server.server_address[1]
    finally:
        _Engine.release.set()
        server.shutdown()
        server.server_close()
        serving.join()


def test_a_2xx_answer_is_a_call_that_worked(engine):
    took = hooks.run("", hooks.Call("127.0.0.1", engine, "/sleep?level=1", 5), "before-checkpoint")
    assert 0 <= took < 5
    assert _Engine.seen == [("POST", "/sleep?level=1", "application/json", b"{}")]


def test_a_failing_answer_names_the_status(engine):
    with pytest.raises(hooks.HookFailed, match=r"before-checkpoint POST http://127.0.0.1:\d+/fail answered HTTP 500"):
        hooks.run("", hooks.Call("127.0.0.1", engine, "/fail", 5), "before-checkpoint")


def test_a_call_that_never_answers_fails_at_its_deadline(engine):
    t0 = time.monotonic()
    with pytest.raises(hooks.HookFailed, match="did not answer within 1s"):
        hooks.run("", hooks.Call("127.0.0.1", engine, "/hang", 1), "after-restore")
    assert time.monotonic() - t0 < 2.5


def test_a_refused_connection_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(hooks.HookFailed, match="after-restore POST .* failed: Connection refused"):
            hooks.run("", hooks.Call("127.0.0.1", port, "/wake_up", 2), "after-restore")
