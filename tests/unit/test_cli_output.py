"""`rekindle status` shows live progress; every command that prints takes `-o json` (and the
old `--json`); status records written before the progress fields existed still read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nri_plugin.cli import build_parser
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
                            timings={"stage": 0.31, "criu_restore": 2.9},
                            progress=Progress("fill", 3 << 30, 18 << 30, rate=float(1 << 30),
                                              phase_started_at=time.time() - 3)))
    b.write(ContainerStatus(namespace="team-a", pod="qwen-0", container="server", role="checkpoint",
                            artifact="qwen-7b", phase=Phase.PUBLISHED, timings={"total": 4.0}, bytes=18 << 30))
    return b


def test_status_shows_live_progress_of_a_running_restore(book):
    out = rekindle("status", "--state-dir", str(book.root.parent)).stdout
    running = next(line for line in out.splitlines() if "qwen-1" in line)
    # the phase began 3 s before the book was written; the command reads the clock when it runs,
    # which on a loaded machine can be seconds later
    m = re.search(r"restoring  <fill 3\.0 GiB of 18\.0 GiB \(16%\), 1\.0 GiB/s, (\d+)s>", running)
    assert m and 3 <= int(m[1]) <= 60, running
    done = next(line for line in out.splitlines() if "qwen-0" in line)
    assert "published  18.0 GiB" in done and "<" not in done


@pytest.mark.parametrize("flag", [["-o", "json"], ["--output", "json"], ["--json"]])
def test_status_json_under_every_spelling(book, flag):
    rows = json.loads(rekindle("status", "--state-dir", str(book.root.parent), *flag).stdout)
    running = next(r for r in rows if r["pod"] == "qwen-1")
    assert running["progress"]["phase"] == "fill" and running["progress"]["bytes_total"] == 18 << 30
    assert next(r for r in rows if r["pod"] == "qwen-0")["bytes"] == 18 << 30


@pytest.mark.parametrize("argv", [
    ["status"], ["doctor"], ["artifacts", "list"], ["artifacts", "inspect", "x"], ["artifacts", "delete", "x"],
    ["artifacts", "prune", "--leftovers"], ["checkpoint", "--container-id", "c", "--namespace", "n", "--name", "a"],
    ["restore", "--container-id", "c", "--namespace", "n", "--name", "a"],
], ids=lambda a: "-".join(a[:2]))
def test_every_printing_command_takes_o_json(argv):
    parser = build_parser()
    assert parser.parse_args([*argv, "-o", "json"]).output == "json"
    assert parser.parse_args([*argv, "--json"]).output == "json"
    assert parser.parse_args(argv).output == "text"


def test_a_record_from_before_progress_existed_still_reads(tmp_path):
    path = tmp_path / "state" / "status" / "ns" / "p" / "c.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"namespace": "ns", "pod": "p", "container": "c", "role": "restore",
                                "artifact": "a", "phase": "restored", "reason": "", "container_id": "x",
                                "pod_uid": "u", "timings": {}, "updated_at": 1.0}))
    st = StatusBook(tmp_path / "state").read("ns", "p", "c")
    assert st is not None and st.progress is None and st.bytes == 0


def test_observers_hear_every_write_and_a_failing_one_changes_nothing(tmp_path):
    book = StatusBook(tmp_path / "state")
    heard = []
    book.observe(lambda s: (_ for _ in ()).throw(RuntimeError("boom")))
    book.observe(lambda s: heard.append(s.phase))
    book.write(ContainerStatus(namespace="ns", pod="p", container="c", phase=Phase.RESTORING))
    book.write(ContainerStatus(namespace="ns", pod="p", container="c", phase=Phase.RESTORED))
    assert heard == [Phase.RESTORING, Phase.RESTORED]
    assert book.read("ns", "p", "c").phase is Phase.RESTORED


def test_nri_toggle_takes_o_json_too(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n")
    for flag in (["-o", "json"], ["--json"]):
        res = rekindle("nri-toggle", "--dry-run", "--config", str(cfg), *flag)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["changed"] is True


EVIL = "\x1b]0;owned\x07\x1b[2J\x9b\u202e"


def test_status_and_the_store_listing_never_print_a_control_character(tmp_path):
    """A reason (a tenant's, the store's), a store entry's name and its owner record are
    printed with their control characters spelled out: none reaches the operator's terminal."""
    state, store = tmp_path / "state", tmp_path / "store"
    StatusBook(state).write(ContainerStatus(namespace="team-a", pod="p", container="c", role="restore",
                                            artifact="a", phase=Phase.COLD_START, reason=f"bad {EVIL} bytes"))
    state.mkdir(exist_ok=True)
    (state / "hmac.key").write_bytes(b"k" * 32)
    (state / "hmac.key").chmod(0o600)
    planted = store / "team-a" / f".staging-x{EVIL}-0123456789abcdef"
    planted.mkdir(parents=True)
    (planted / ".owner.json").write_text(json.dumps({"node": f"n{EVIL}", "boot_id": "b", "pid": 1,
                                                     "start_time": 1, "created": 1.0}))
    status = rekindle("status", "--state-dir", str(state))
    listing = rekindle("artifacts", "list", "--all", "--state-dir", str(state), "--store", str(store))
    assert status.returncode == 0 and listing.returncode == 0, (status.stderr, listing.stderr)
    assert "bad \\x1b]0;owned\\x07\\x1b[2J\\x9b\\u202e bytes" in status.stdout, status.stdout
    assert ".staging-x\\x1b]0;owned" in listing.stdout and "owner n\\x1b]0;owned" in listing.stdout, listing.stdout
    for out in (status.stdout, listing.stdout):
        assert not any(ch in out for ch in "\x1b\x07\x9b\u202e"), out
