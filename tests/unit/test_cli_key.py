"""Which key each `rekindle` command uses, and that only `rekindle plugin --create-key` makes one.

The real CLI runs as a subprocess (`python -m nri_plugin`), with a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.cli import _settings, build_parser

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "REKINDLE_HMAC_KEY_FILE"  # the chart sets it; a contract, so spelled out here
HINT = f"(the plugin's key; set --hmac-key-file or {KEY_ENV})"


def rekindle(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    return subprocess.run([sys.executable, "-m", "nri_plugin", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})


def _paths(tmp_path: Path) -> list[str]:
    return ["--state-dir", str(tmp_path / "state"), "--store", str(tmp_path / "store")]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    (tmp_path / "state").mkdir()
    (tmp_path / "store").mkdir()
    return tmp_path


@pytest.mark.parametrize("argv", [
    ["artifacts", "inspect", "some-artifact"],
    ["artifacts", "inspect", "--verify", "some-artifact"],
    ["checkpoint", "--container-id", "0" * 64, "--namespace", "default", "--name", "x"],
    ["restore", "--container-id", "0" * 64, "--namespace", "default", "--name", "x"],
], ids=["inspect", "inspect-verify", "checkpoint", "restore"])
def test_commands_without_the_plugins_key_fail_in_one_line_and_create_nothing(state, argv):
    res = rekindle(*argv, *_paths(state))
    assert res.returncode == 1, res
    assert res.stderr == f"rekindle: error: no HMAC key at {state}/state/hmac.key {HINT}\n"
    assert os.listdir(state / "state") == [] and os.listdir(state / "store") == []


def test_the_key_path_comes_from_the_environment(state, tmp_path):
    env_key = tmp_path / "etc-rekindle" / "hmac.key"
    res = rekindle("artifacts", "inspect", "x", *_paths(state), env={KEY_ENV: str(env_key)})
    assert res.returncode == 1
    assert res.stderr == f"rekindle: error: no HMAC key at {env_key} {HINT}\n"
    # the flag beats the variable
    res = rekindle("artifacts", "inspect", "x", *_paths(state), "--hmac-key-file", str(tmp_path / "flag.key"),
                   env={KEY_ENV: str(env_key)})
    assert res.stderr == f"rekindle: error: no HMAC key at {tmp_path}/flag.key {HINT}\n"


def test_inspect_reads_the_plugins_key(state):
    key = state / "state" / "hmac.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o400)
    res = rekindle("artifacts", "inspect", "--namespace", "ns", "x", *_paths(state))
    assert res.returncode == 1
    assert "HMAC" not in res.stderr and "ns/x" in res.stderr, res.stderr  # past the key, to the store
    assert key.read_bytes() == b"k" * 32


def test_a_bad_key_is_one_line_not_a_traceback(state):
    os.mkfifo(state / "state" / "hmac.key", 0o600)
    res = rekindle("artifacts", "inspect", "x", *_paths(state))
    assert res.returncode == 1
    assert res.stderr == f"rekindle: error: HMAC key {state}/state/hmac.key: is a FIFO, not a regular file\n"


def test_the_plugin_does_not_create_a_key_unless_told(state):
    res = rekindle("plugin", *_paths(state), "--socket-path", str(state / "nri.sock"),
                   "--init-binary", str(REPO / "build" / "rekindle-init"))
    assert res.returncode == 1, res
    assert res.stderr == (f"rekindle: error: no HMAC key at {state}/state/hmac.key "
                          "(pass --create-key to create one, or mount the chart's Secret there)\n")
    assert os.listdir(state / "state") == []  # stopped before installing anything


def test_create_key_is_a_plugin_flag_only():
    parser = build_parser()
    assert _settings(parser.parse_args(["plugin", "--create-key"])).create_key is True
    assert _settings(parser.parse_args(["plugin"])).create_key is False
    for argv in (["artifacts", "inspect", "x"], ["checkpoint", "--container-id", "c", "--namespace", "n",
                                                 "--name", "a"], ["doctor"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--create-key"])
        assert _settings(parser.parse_args(argv)).create_key is False


def test_doctor_reports_the_key(state):
    from runtime.doctor import check_hmac_key
    path = state / "state" / "hmac.key"
    c = check_hmac_key(str(path))
    assert (c.ok, c.required) == (False, False) and c.detail.startswith(f"no HMAC key at {path}")
    path.write_bytes(b"k" * 32)
    path.chmod(0o644)
    c = check_hmac_key(str(path))
    assert (c.ok, c.required) == (False, True) and "group/world accessible" in c.detail
    path.chmod(0o600)
    assert check_hmac_key(str(path)).ok


@pytest.mark.parametrize("text, ok, word", [("always [madvise] never\n", False, "madvise"),
                                            ("[always] madvise never\n", True, "always"),
                                            ("always madvise [never]\n", False, "never")])
def test_doctor_reports_the_nodes_huge_page_mode_and_never_requires_it(tmp_path, text, ok, word):
    from runtime.doctor import check_thp
    path = tmp_path / "enabled"
    path.write_text(text)
    c = check_thp(str(path))
    assert (c.ok, c.required) == (ok, False) and c.detail.startswith(word)
    assert not check_thp(str(tmp_path / "missing")).ok
