"""hack/test.sh runs the suite, then the e2e tests of the same selection once more on each
further containerd (the docs say the whole e2e suite is tested on 1.7 and 2.4, the modules marked
every_runtime on 2.1 and 2.2 too), and fails the run when any pass fails. Run against a copy of the script whose set-up is a no-op and
whose pytest is a fake that records its arguments and runtime and exits as told."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="hack/test.sh refuses to run unless root")

FAKE_PYTEST = """#!/bin/sh
echo "$REKINDLE_E2E_RUNTIME|$*" >> "$CALLS"
eval "exit \\${RC_$(echo "$REKINDLE_E2E_RUNTIME" | tr . _):-0}"
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "hack").mkdir()
    shutil.copy(REPO / "hack" / "test.sh", tmp_path / "hack" / "test.sh")
    (tmp_path / "hack" / "setup.sh").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "pytest").write_text(FAKE_PYTEST)
    bins = [tmp_path / f"containerd-{rt}" / "usr" / "bin" / "containerd" for rt in LATER]
    for b in bins:
        b.parent.mkdir(parents=True)
        b.write_text("#!/bin/sh\n")
    for p in (tmp_path / "hack" / "setup.sh", tmp_path / "venv" / "bin" / "pytest", *bins):
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return tmp_path


LATER = ("2.1", "2.2", "2.4")


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REKINDLE_")}
    env.update(REKINDLE_VENV=str(root / "venv"), CALLS=str(root / "calls"),
               **{f"REKINDLE_CONTAINERD{rt.replace('.', '')}_PREFIX": str(root / f"containerd-{rt}") for rt in LATER})
    return env


def run(tmp_path: Path, *args: str, **rcs: int) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    root = _tree(tmp_path)
    calls = tmp_path / "calls"
    env = _env(root)
    env.update({f"RC_{k}": str(v) for k, v in rcs.items()})
    res = subprocess.run(["bash", str(root / "hack" / "test.sh"), *args], capture_output=True, text=True,
                         env=env, timeout=60)
    return res, calls.read_text().splitlines() if calls.exists() else []


ALL_PASSED = ("==> tests passed: all on 1.7: exit 0; e2e on 2.4: exit 0; e2e (every_runtime) on 2.1: exit 0; "
              "e2e (every_runtime) on 2.2: exit 0")


def test_the_e2e_suite_runs_again_on_the_newest_and_a_subset_on_the_others(tmp_path):
    res, calls = run(tmp_path)
    assert calls == ["1.7|", "2.4|-m e2e", "2.1|-m e2e and every_runtime", "2.2|-m e2e and every_runtime"], calls
    assert res.returncode == 0
    assert res.stdout.splitlines()[-1] == ALL_PASSED


def test_a_failing_later_pass_fails_the_run(tmp_path):
    res, _ = run(tmp_path, **{"2_2": 1})
    assert res.returncode == 1
    assert res.stdout.splitlines()[-1] == ALL_PASSED.replace("passed:", "FAILED (exit 1):").replace(
        "on 2.2: exit 0", "on 2.2: exit 1")


def test_a_failing_first_pass_is_not_hidden_by_the_later_ones(tmp_path):
    res, calls = run(tmp_path, **{"1_7": 1})
    assert len(calls) == 4 and res.returncode == 1


def test_statuses_do_not_wrap_when_added(tmp_path):
    res, _ = run(tmp_path, **{"1_7": 128, "2_4": 128})  # a sum would be 256, i.e. 0
    assert res.returncode == 128


def test_a_marker_expression_is_anded_with_e2e_and_the_subset(tmp_path):
    res, calls = run(tmp_path, "tests/e2e/test_x.py", "-m", "not slow", "-k", "restore")
    assert calls == ["1.7|tests/e2e/test_x.py -k restore -m not slow",
                     "2.4|tests/e2e/test_x.py -k restore -m e2e and (not slow)",
                     "2.1|tests/e2e/test_x.py -k restore -m e2e and every_runtime and (not slow)",
                     "2.2|tests/e2e/test_x.py -k restore -m e2e and every_runtime and (not slow)"], calls
    assert res.returncode == 0


def test_a_selection_without_e2e_tests_passes_on_the_later_runtimes(tmp_path):
    res, _ = run(tmp_path, "tests/unit", **{"2_1": 5, "2_2": 5, "2_4": 5})
    assert res.returncode == 0
    assert res.stdout.splitlines()[-1] == ("==> tests passed: all on 1.7: exit 0; e2e on 2.4: none selected; "
                                           "e2e (every_runtime) on 2.1: none selected; "
                                           "e2e (every_runtime) on 2.2: none selected")


def test_nothing_collected_in_the_first_pass_still_fails(tmp_path):
    res, _ = run(tmp_path, "tests/nothing", **{"1_7": 5, "2_1": 5, "2_2": 5, "2_4": 5})
    assert res.returncode == 5


def test_a_runtime_that_is_not_installed_is_not_run_and_the_summary_says_so(tmp_path):
    root = _tree(tmp_path)
    (root / "containerd-2.2" / "usr" / "bin" / "containerd").unlink()
    res = subprocess.run(["bash", str(root / "hack" / "test.sh")], capture_output=True, text=True, env=_env(root),
                         timeout=60)
    assert [c.split("|")[0] for c in (root / "calls").read_text().splitlines()] == ["1.7", "2.4", "2.1"]
    assert res.returncode == 0
    assert "e2e (every_runtime) on 2.2: not run, no containerd 2.2" in res.stdout.splitlines()[-1]
    assert "NOT RUN" in res.stderr


def test_one_runtime_alone_runs_one_pass(tmp_path):
    root = _tree(tmp_path)
    env = _env(root)
    env.update(REKINDLE_E2E_RUNTIMES="1.7")
    subprocess.run(["bash", str(root / "hack" / "test.sh")], capture_output=True, env=env, timeout=60, check=True)
    assert (tmp_path / "calls").read_text().splitlines() == ["1.7|"]
