"""The engine's release path through the real plugin: ``rekindle.dev/before-checkpoint`` puts a
server to sleep in its pod before the freeze and ``rekindle.dev/after-restore`` wakes it (the
source once its checkpoint ends, the restored copy once it runs). A failed before-call refuses
the checkpoint and leaves the source awake; a failed after-call is a failed restore."""

from __future__ import annotations

import json
import sys
import urllib.request

from devtools.cri import ContainerState
from devtools.gpu import host_python_mounts
from tests.e2e.test_checkpoint_restore import wait_status
from tests.waiting import wait_for

HOST_USR = "localhost/rekindle/host-usr:1"

# An engine's two endpoints, as vLLM means them: /sleep gives up its memory, /wake_up takes it
# back. ``history`` says what it went through, so a restored copy tells what state it was
# dumped in. /sleep_hang sleeps and never answers in time; other POSTs answer 500.
ENGINE = r"""
import json, os, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
state = {"awake": True, "history": [], "pid": os.getpid()}
class H(BaseHTTPRequestHandler):
    def answer(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer(200, json.dumps(state).encode())
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.partition("?")[0]
        if path in ("/sleep", "/sleep_hang", "/sleep_fail"):
            state["awake"] = False
            state["history"].append("sleep")
            if path == "/sleep_hang":
                time.sleep(60)
            self.answer(500 if path == "/sleep_fail" else 200)
        elif path == "/wake_up":
            state["awake"] = True
            state["history"].append("wake")
            self.answer(200)
        else:
            self.answer(500)
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("0.0.0.0", 8000), H)
s.daemon_threads = True
print("serving", flush=True)
s.serve_forever()
"""


def engine_state(ip: str) -> dict:
    with urllib.request.urlopen(f"http://{ip}:8000/state", timeout=3) as r:
        return json.loads(r.read())


def run_engine(sandbox, p) -> tuple[str, str]:
    cid = sandbox.run_container(p, "engine", HOST_USR, command=[sys.executable, "-c", ENGINE],
                                mounts=host_python_mounts(), env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"})
    ip = sandbox.cri.pod_ip(p.id)
    return cid, ip


def serving(ip: str) -> dict:
    found: list[dict] = []
    wait_for(lambda: found.append(engine_state(ip)) is None, 20, f"{ip}:8000 to serve", interval=0.2,
             ignore=(OSError,))
    return found[-1]


SLEEP = "http://127.0.0.1:8000/sleep?level=1"
WAKE = "http://localhost:8000/wake_up"


def test_the_source_sleeps_for_its_checkpoint_and_is_woken_and_so_is_the_restored_copy(sandbox, pod, plugin):
    a = pod("engine-a", annotations={"rekindle.dev/checkpoint": "engine-a", "rekindle.dev/ready-probe": "http://:8000/",
                                     "rekindle.dev/before-checkpoint": SLEEP, "rekindle.dev/after-restore": WAKE})
    _cid, a_ip = run_engine(sandbox, a)
    st = wait_status(plugin, "default", a.name, "engine", {"published", "checkpoint-failed"}, timeout=90)
    assert st["phase"] == "published", st["reason"]
    assert "before_checkpoint" in st["timings"] and "wake_source" in st["timings"], st["timings"]
    src = engine_state(a_ip)
    assert src["awake"] and src["history"] == ["sleep", "wake"], src  # asleep for the dump, awake after

    b = pod("engine-b", annotations={"rekindle.dev/restore": "engine-a", "rekindle.dev/after-restore": WAKE})
    _b_cid, b_ip = run_engine(sandbox, b)
    st = wait_status(plugin, "default", b.name, "engine", {"restored", "cold-start"}, timeout=90)
    assert st["phase"] == "restored", st["reason"]
    assert "after_restore" in st["timings"], st["timings"]
    got = serving(b_ip)
    # The restored copy: the source's process, dumped asleep (one sleep, no wake yet), woken here.
    assert got["pid"] == src["pid"] and got["awake"] and got["history"] == ["sleep", "wake"], got

    c = pod("engine-c", annotations={"rekindle.dev/restore": "engine-a",
                                     "rekindle.dev/after-restore": "http://127.0.0.1:8000/broken"})
    c_cid, c_ip = run_engine(sandbox, c)
    st = wait_status(plugin, "default", c.name, "engine", {"restored", "cold-start"}, timeout=90)
    assert st["phase"] == "cold-start", st
    assert "after-restore POST http://127.0.0.1:8000/broken answered HTTP 500" in st["reason"], st["reason"]
    # The restored tree was ended; the cold start's own process serves (it could bind the port).
    fresh = serving(c_ip)
    assert fresh["history"] == [] and fresh["awake"], fresh
    assert any("serving" in line for line in sandbox.cri.logs(c_cid))

    d = pod("engine-d", annotations={"rekindle.dev/restore": "engine-a", "rekindle.dev/on-restore-failure": "fail",
                                     "rekindle.dev/after-restore": "http://127.0.0.1:8000/broken"})
    d_cid, _d_ip = run_engine(sandbox, d)
    st = wait_status(plugin, "default", d.name, "engine", {"restored", "restore-failed", "cold-start"}, timeout=90)
    assert st["phase"] == "restore-failed", st  # fails closed: the engine's command never runs
    assert "after-restore POST http://127.0.0.1:8000/broken answered HTTP 500" in st["reason"], st["reason"]
    exited = sandbox.cri.wait_container(d_cid, states=(ContainerState.EXITED,), timeout=60)
    assert exited.exit_code == 75, exited  # the init's fail-closed status
    assert not any("serving" in line for line in sandbox.cri.logs(d_cid))


def test_a_failed_before_call_refuses_the_checkpoint_and_the_source_is_woken(sandbox, pod, plugin):
    cases = {"fail": ("http://127.0.0.1:8000/sleep_fail", {}, "answered HTTP 500"),
             "hang": ("http://127.0.0.1:8000/sleep_hang", {"rekindle.dev/before-checkpoint-timeout": "2"},
                      "did not answer within 2s")}
    pods = {}
    for name, (url, extra, _why) in cases.items():
        p = pod(f"engine-{name}", annotations={"rekindle.dev/checkpoint": f"engine-{name}",
                                               "rekindle.dev/ready-probe": "http://:8000/",
                                               "rekindle.dev/before-checkpoint": url,
                                               "rekindle.dev/after-restore": WAKE, **extra})
        pods[name] = (p, run_engine(sandbox, p)[1])
    for name, (p, ip) in pods.items():
        st = wait_status(plugin, "default", p.name, "engine", {"published", "checkpoint-failed"}, timeout=90)
        assert st["phase"] == "checkpoint-failed", st
        assert cases[name][2] in st["reason"] and "no checkpoint taken; the source was woken" in st["reason"], st
        got = engine_state(ip)
        assert got["awake"] and got["history"] == ["sleep", "wake"], got
        assert "wake_source" in st["timings"], st["timings"]
