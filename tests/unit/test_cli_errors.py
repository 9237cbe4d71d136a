"""How `rekindle` reports a failure: one line on stderr and no log lines before it (unless -v);
under `-o json` one JSON object on stdout; usage errors exit 2; and `restore` checks its
arguments and the artifact before it probes CUDA or containerd. The real CLI runs as a
subprocess (`python -m nri_plugin`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def rekindle(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REKINDLE_")}
    return subprocess.run([sys.executable, "-m", "nri_plugin", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.fixture
def paths(tmp_path: Path) -> list[str]:
    """A state dir with a key, an empty store, and a containerd that is not there."""
    (tmp_path / "state").mkdir()
    (tmp_path / "store").mkdir()
    key = tmp_path / "state" / "hmac.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o400)
    return ["--state-dir", str(tmp_path / "state"), "--store", str(tmp_path / "store"),
            "--containerd-socket", str(tmp_path / "no-containerd.sock"),
            "--containerd-state", str(tmp_path / "no-containerd-state")]


RESTORE = ["restore", "--container-id", "a" * 64, "--namespace", "default", "--name", "missing"]


def test_a_failing_restore_prints_its_error_and_nothing_else(paths, tmp_path):
    res = rekindle(*RESTORE, *paths)
    assert res.returncode == 1
    assert res.stderr == f"rekindle: error: artifact default/missing not found in {tmp_path}/store\n"
    assert res.stdout == ""


def test_restore_checks_the_artifact_before_it_probes_cuda_or_containerd(paths):
    res = rekindle(*RESTORE, *paths, "-v")  # -v: every log line the command makes shows
    assert res.returncode == 1
    assert "default/missing not found" in res.stderr
    for probed in ("CUDA", "containerd socket", "node "):
        assert probed not in res.stderr, res.stderr


@pytest.mark.parametrize("flag", [["-o", "json"], ["--output", "json"], ["--json"], ["-ojson"], ["--output=json"]])
def test_errors_under_o_json_are_one_json_object_on_stdout(paths, tmp_path, flag):
    res = rekindle(*RESTORE, *paths, *flag)
    assert res.returncode == 1
    assert json.loads(res.stdout) == {"error": f"artifact default/missing not found in {tmp_path}/store",
                                      "exit_code": 1}
    assert res.stderr == ""


def test_a_missing_key_under_o_json(tmp_path):
    res = rekindle("artifacts", "inspect", "x", "--state-dir", str(tmp_path), "--store", str(tmp_path), "-o", "json")
    assert res.returncode == 1
    assert json.loads(res.stdout)["error"].startswith(f"no HMAC key at {tmp_path}/hmac.key")


@pytest.mark.parametrize("argv, message", [
    (["restore", "--container-id", "a" * 64, "--namespace", "Default", "--name", "x"],
     "--namespace 'Default' is not a Kubernetes namespace name"),
    (["restore", "--container-id", "../../etc", "--namespace", "default", "--name", "x"],
     "--container-id '../../etc' is not a containerd container id"),
    (["restore", "--container-id", "a" * 64, "--namespace", "default", "--name", "X/y"],
     "--name 'X/y' is not an artifact name"),
    (["restore", "--namespace", "default"], "the following arguments are required: --container-id, --name"),
    (["artifacts", "prune"], "say what to prune"),
    (["status", "--bogus"], "unrecognized arguments: --bogus"),
], ids=["namespace", "container-id", "name", "required", "prune", "unknown-flag"])
def test_usage_errors_exit_2_in_text_and_json(paths, argv, message):
    res = rekindle(*argv, *paths)
    assert res.returncode == 2, res
    assert message in res.stderr.splitlines()[-1] and "error:" in res.stderr.splitlines()[-1], res.stderr
    assert "Traceback" not in res.stderr
    res = rekindle(*argv, *paths, "-o", "json")
    assert res.returncode == 2, res
    doc = json.loads(res.stdout)
    assert message in doc["error"] and doc["exit_code"] == 2
    assert res.stderr == ""


def test_bad_names_are_refused_before_the_key_is_read(tmp_path):
    res = rekindle("restore", "--container-id", "a" * 64, "--namespace", "default", "--name", "..",
                   "--state-dir", str(tmp_path / "nothing-here"))
    assert res.returncode == 2 and "HMAC" not in res.stderr, res.stderr
