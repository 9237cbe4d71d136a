"""`-o yaml` beside `-o json`, live progress on a terminal only, and `status --watch`."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nri_plugin import cli
from nri_plugin.cli import TerminalProgress, build_parser, watch
from nri_plugin.yamlout import dumps
from runtime.status import ContainerStatus, Phase, Progress, StatusBook

REPO = Path(__file__).resolve().parents[2]


def rekindle(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nri_plugin", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def book(tmp_path) -> StatusBook:
    b = StatusBook(tmp_path / "state")
    b.write(ContainerStatus(namespace="team-a", pod="qwen-1", container="server", role="restore",
                            artifact="qwen-7b", phase=Phase.RESTORING, container_id="c1", pod_uid="u1",
                            timings={"stage": 0.31}, progress=Progress("fill", 3 << 30, 18 << 30, rate=1.5e9,
                                                                      phase_started_at=time.time() - 3)))
    b.write(ContainerStatus(namespace="team-a", pod="qwen-0", container="server", role="checkpoint",
                            artifact="qwen-7b", phase=Phase.PUBLISHED, timings={"total": 4.0}, bytes=18 << 30,
                            reason='a: "b" #c\n- d'))
    return b


# ---------------------------------------------------------------- -o yaml
@pytest.mark.parametrize("doc", [
    {}, [], {"a": []}, {"a": {}}, [[]], [{}], None, True, 0, -7, 1.5, 1e20, 1e-7, 2**70,
    "", "yes", "no", "null", "~", "1.0", "0x1f", "-", "- a", "a: b", "#x", "&a", "*a", "!t", "%", "@", "`",
    "'q'", '"q"', "tab\there", "new\nline", "nul\0", "\x7f\x85\u2028\ufeff", "é ü 漢字", "😀", "\\",
    {"k: v": 1, "": 2, "#": [1, {"x": None}], "list": [[1, 2], [], {"a": [3]}]},
    [{"a": 1, "b": [{"c": "d"}]}, [[[]]]],
])
def test_yaml_reads_back_as_the_same_json_data(doc):
    text = dumps(doc)
    assert yaml.safe_load(text) == doc, text


def test_yaml_is_block_style_with_quoted_strings():
    assert dumps({"ns": "a", "rows": [{"n": 1}, 2]}) == '"ns": "a"\n"rows":\n  - "n": 1\n  - 2\n'


@pytest.mark.parametrize("argv", [
    ["status"], ["doctor"], ["artifacts", "list"], ["artifacts", "inspect", "x"], ["artifacts", "delete", "x"],
    ["artifacts", "prune", "--leftovers"], ["checkpoint", "--container-id", "c", "--namespace", "n", "--name", "a"],
    ["restore", "--container-id", "c", "--namespace", "n", "--name", "a"],
], ids=lambda a: "-".join(a[:2]))
def test_every_command_with_o_json_takes_o_yaml(argv):
    parser = build_parser()
    assert parser.parse_args([*argv, "-o", "yaml"]).output == "yaml"
    assert parser.parse_args([*argv, "--output=yaml"]).output == "yaml"


def test_status_yaml_is_the_json_document(book):
    state = str(book.root.parent)
    as_json = json.loads(rekindle("status", "--state-dir", state, "-o", "json").stdout)
    res = rekindle("status", "--state-dir", state, "-o", "yaml")
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout) == as_json
    assert next(r for r in as_json if r["pod"] == "qwen-0")["reason"] == 'a: "b" #c\n- d'


def test_an_error_under_o_yaml_is_a_yaml_object_on_stdout(tmp_path):
    res = rekindle("artifacts", "inspect", "missing", "--store", str(tmp_path / "store"),
                   "--state-dir", str(tmp_path / "state"), "-o", "yaml")
    assert res.returncode == 1 and res.stderr == ""
    doc = yaml.safe_load(res.stdout)
    assert doc["exit_code"] == 1 and "HMAC key" in doc["error"]


def test_a_usage_error_under_o_yaml_exits_2_with_a_yaml_object():
    res = rekindle("status", "-o", "yaml", "--interval", "0")
    assert res.returncode == 2
    assert yaml.safe_load(res.stdout)["exit_code"] == 2


# ---------------------------------------------------------------- live progress
class FakeTty(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_is_one_line_rewritten_in_place_on_a_terminal():
    out, clock = FakeTty(True), Clock()
    live = TerminalProgress(out, clock=clock, wall=clock)
    live("stage", 0, 0)
    clock.t += 2.0
    live("fill", 0, 4 << 30)
    clock.t += 2.0
    live("fill", 1 << 30, 4 << 30)
    clock.t += 0.05
    live("fill", (1 << 30) + 1, 4 << 30)  # within the interval: not shown
    live.close()
    frames = out.getvalue().split("\r\x1b[K")
    assert frames == ["", "stage, 0s", "fill 0 B of 4.0 GiB (0%), 0s",
                      "fill 1.0 GiB of 4.0 GiB (25%), 512.0 MiB/s, 2s", ""], frames
    assert "\n" not in out.getvalue()


def test_progress_shows_nothing_when_not_a_terminal():
    out = FakeTty(False)
    live = TerminalProgress(out)
    assert not live.live
    live("fill", 1, 2)
    live.close()
    assert out.getvalue() == ""


def test_checkpoint_passes_the_progress_only_on_a_terminal(monkeypatch):
    got = []

    def fake_checkpoint_once(settings, cid, ns, name, exit_after=False, progress=None):
        got.append(progress)
        if progress is not None:
            progress("criu_dump", 0, 0)
        return {"criu_dump": 1.0}

    import nri_plugin.agent as agent
    monkeypatch.setattr(agent, "checkpoint_once", fake_checkpoint_once)
    argv = ["checkpoint", "--container-id", "c1", "--namespace", "n", "--name", "a"]
    for tty in (True, False):
        err = FakeTty(tty)
        monkeypatch.setattr(sys, "stderr", err)
        assert cli.main(argv) == 0
        assert ("criu_dump" in err.getvalue()) is tty
    assert got[0] is not None and got[1] is None


# ---------------------------------------------------------------- status --watch
def test_watch_prints_again_only_on_change_and_stops_after_count():
    views = iter(["a", "a", "b", "b", "b", "c"])
    out, slept = io.StringIO(), []
    assert watch(lambda: next(views), out, interval=0.5, count=6, sleep=slept.append) == 0
    assert out.getvalue() == "a\n\nb\n\nc\n"
    assert slept == [0.5] * 5


def test_watch_exits_0_on_ctrl_c():
    def interrupted(_: float) -> None:
        raise KeyboardInterrupt

    out = io.StringIO()
    assert watch(lambda: "x", out, interval=1.0, sleep=interrupted) == 0
    assert out.getvalue() == "x\n"


def test_watch_separates_yaml_documents():
    views = iter(["- 1", "- 2"])
    out = io.StringIO()
    watch(lambda: next(views), out, interval=0.1, count=2, sleep=lambda _: None, fmt="yaml")
    assert list(yaml.safe_load_all(out.getvalue())) == [[1], [2]]


def test_status_watch_sees_a_change_made_while_it_runs_and_ctrl_c_exits_0(book):
    state = str(book.root.parent)
    # --watch-count bounds the run (60 s) should the change never show.
    proc = subprocess.Popen([sys.executable, "-m", "nri_plugin", "status", "--state-dir", state, "--watch",
                             "--interval", "0.1", "--watch-count", "600", "-o", "json"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    docs: list[list[dict[str, object]]] = []
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:  # one JSON document ends with a line "]"
            lines.append(line)
            if line != "]\n":
                continue
            docs.append(json.loads("".join(lines)))
            lines = []
            phase = next(r for r in docs[-1] if r["pod"] == "qwen-1")["phase"]
            if phase == "restored":
                break
            book.write(ContainerStatus(namespace="team-a", pod="qwen-1", container="server", role="restore",
                                       artifact="qwen-7b", phase=Phase.RESTORED, container_id="c1", pod_uid="u1"))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert [next(r for r in d if r["pod"] == "qwen-1")["phase"] for d in docs] == ["restoring", "restored"]


@pytest.mark.parametrize("bad", ["0", "0.01", "61", "nan", "inf", "x", "-1"])
def test_watch_interval_is_bounded(bad):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["status", "--watch", "--interval", bad])
    assert exc.value.code == 2
