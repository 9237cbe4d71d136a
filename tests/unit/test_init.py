"""Tests of the real rekindle-init binary (runtime/init/rekindle-init.c).

Most tests run the init as PID 1 of a fresh pid namespace (``unshare --fork --pid --mount-proc``),
which needs root. The control dir is a temp dir; the "agent" is played by the test, which writes
the control files and plants processes in the namespace with ``nsenter -p``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
INIT = REPO / "build" / "rekindle-init"
SH = "/bin/sh"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (unshare --pid, nsenter)"
    for tool in ("make", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not os.path.exists(SH):
        return f"{SH} not found"
    return None


@pytest.fixture(scope="module")
def init_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"C compiler {cc!r} not found (install build-essential)")
    probe_dir = tmp_path_factory.mktemp("ccprobe")
    (probe_dir / "p.c").write_text("int main(void) { return 0; }\n")
    probe = subprocess.run(
        [cc, "-static", "-o", str(probe_dir / "p"), str(probe_dir / "p.c")],
        capture_output=True, text=True, timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot link static binaries (install libc6-dev): {probe.stderr.strip()[:200]}")
    build = subprocess.run(
        ["make", "build/rekindle-init"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert build.returncode == 0, f"make failed:\n{build.stdout}\n{build.stderr}"
    return INIT


def write_control(ctl: Path, name: str, content: str) -> None:
    """Like the agent: temp name in the same dir, then rename."""
    tmp = ctl / f".{name}.test-tmp"
    tmp.write_text(content)
    os.rename(tmp, ctl / name)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


class Init:
    """One run of the init, as PID 1 of a new pid namespace unless pidns is False."""

    def __init__(self, binary: Path, tmp: Path, args: list[str], cmd: list[str], pidns: bool = True):
        self.tmp = tmp
        self.pidns = pidns
        self.stdout_path = tmp / "init.stdout"
        self.stderr_path = tmp / "init.stderr"
        argv = [str(binary), *args, "--", *cmd]
        if pidns:
            argv = ["unshare", "--fork", "--pid", "--mount-proc", *argv]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,
            )
        self.started = time.monotonic()
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """Host pid of rekindle-init (the child unshare forked, once it exec'd the init)."""
        if self._pid is not None:
            return self._pid
        if not self.pidns:
            self._pid = self.proc.pid
            return self._pid

        def find() -> bool:
            for entry in os.listdir("/proc"):
                if entry.isdigit() and _ppid(int(entry)) == self.proc.pid:
                    try:
                        exe = os.readlink(f"/proc/{entry}/exe")
                    except OSError:
                        continue
                    if exe == str(INIT):
                        self._pid = int(entry)
                        return True
            return False

        wait_for(find, 5, "rekindle-init to start in its pid namespace")
        assert self._pid is not None
        return self._pid

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def wait_log(self, text: str, timeout: float = 5) -> None:
        wait_for(lambda: text in self.stderr(), timeout, f"{text!r} in the init's log")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def nsenter(self, script: str) -> None:
        """Run a shell in the init's pid namespace; its background children become orphans
        that the kernel reparents to the init."""
        subprocess.run(
            ["nsenter", "-t", str(self.pid), "-p", "--", SH, "-c", script],
            cwd=self.tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, timeout=10, check=True,
        )

    def wait(self, timeout: float = 10) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"init did not exit within {timeout} s; log:\n{self.stderr()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


@pytest.fixture
def run(init_bin: Path, tmp_path: Path):
    started: list[Init] = []

    def start(args: list[str], cmd: list[str], pidns: bool = True) -> Init:
        i = Init(init_bin, tmp_path, args, cmd, pidns)
        started.append(i)
        return i

    yield start
    for i in started:
        i.kill()


@pytest.fixture
def ctl(tmp_path: Path) -> Path:
    d = tmp_path / "ctl"
    d.mkdir()
    return d


# A command that records each run in ./runs (the tests assert it ran exactly once, or never).
RECORD = [SH, "-c", "echo ran >> runs"]


def restore_args(ctl: Path, timeout: int = 30) -> list[str]:
    return ["--mode", "restore", "--control", str(ctl), "--timeout", str(timeout)]


# --- source mode -----------------------------------------------------------------------------


def test_workload_is_not_pid1(run, tmp_path):
    init = run(["--mode", "source"], [SH, "-c", "echo $$"])
    assert init.wait() == 0
    assert init.stdout() == "2\n"
    assert "mode=source control=/rekindle timeout=1800 pid=1\n" in init.stderr()
    assert "main pid 2 exited with status 0\n" in init.stderr()


@pytest.mark.parametrize(
    "script, code", [("exit 3", 3), ("exit 0", 0), ("kill -9 $$", 137), ("kill -15 $$", 143)]
)
def test_exit_status_propagates(run, script, code):
    init = run(["--mode", "source"], [SH, "-c", script])
    assert init.wait() == code
    assert init.stderr().endswith(f"rekindle-init: exiting with status {code}\n")


def test_exec_failure_is_127(run):
    init = run(["--mode", "source"], ["/no/such/binary"])
    assert init.wait() == 127
    assert "rekindle-init: /no/such/binary: No such file or directory\n" in init.stderr()


def test_sigterm_is_forwarded(run, tmp_path):
    script = 'trap "echo got-term; exit 42" TERM; touch ready; while :; do sleep 0.05; done'
    init = run(["--mode", "source"], [SH, "-c", script])
    wait_for(lambda: (tmp_path / "ready").exists(), 5, "the workload to start")
    init.signal(signal.SIGTERM)
    assert init.wait() == 42
    assert init.stdout() == "got-term\n"
    assert "forwarding signal 15 to main pid 2\n" in init.stderr()


def test_orphans_are_reaped(run):
    # The inner shell exits at once; its background sleep is reparented to the init, which
    # must reap it. Count zombies in the namespace (/proc is the namespace's).
    script = (
        f'{SH} -c "sleep 0.1 &"; sleep 0.8; '
        "n=0; for s in /proc/[0-9]*/stat; do "
        'read -r l < "$s" 2>/dev/null || continue; '
        'case "${l##*) }" in Z*) n=$((n+1));; esac; done; echo zombies=$n'
    )
    init = run(["--mode", "source"], [SH, "-c", script])
    assert init.wait() == 0
    assert init.stdout() == "zombies=0\n"


def test_bad_usage_exits_2(run):
    for args in (["--mode", "sideways"], ["--mode", "restore", "--timeout", "x"], ["--bogus"]):
        init = run(args, ["true"], pidns=False)
        assert init.wait() == 2, args


# --- restore mode ----------------------------------------------------------------------------


def test_restore_failed_cold_starts_once_and_clears_namespace(run, ctl, tmp_path):
    script = (
        "echo ran >> runs; "
        'if kill -0 "$(cat orphan)" 2>/dev/null; then echo orphan-alive; else echo orphan-dead; fi >> runs'
    )
    init = run(restore_args(ctl), [SH, "-c", script])
    init.wait_log("waiting for a restore (timeout 30 s)")
    # A leftover of a half-done restore: must be SIGKILLed before the workload starts.
    init.nsenter("sleep 30 & echo $! > orphan")
    assert init.proc.poll() is None
    write_control(ctl, "restore-failed", "criu exploded\nsecond line\n")
    assert init.wait() == 0
    assert (tmp_path / "runs").read_text() == "ran\norphan-dead\n"
    assert (ctl / "cold-start").read_text() == "restore-failed: criu exploded\n"
    assert sorted(p.name for p in ctl.iterdir()) == ["cold-start", "restore-failed"]
    assert "cold start: restore-failed: criu exploded\n" in init.stderr()


def test_timeout_cold_starts_once(run, ctl, tmp_path):
    init = run(restore_args(ctl, timeout=1), RECORD)
    assert init.wait() == 0
    elapsed = time.monotonic() - init.started
    assert 0.9 <= elapsed < 5, elapsed
    assert (tmp_path / "runs").read_text() == "ran\n"
    assert (ctl / "cold-start").read_text() == "no restore within 1 s\n"


@pytest.mark.parametrize("verdict", ["restore-failed", "timeout"])
def test_a_rollback_still_owed_is_never_a_cold_start(run, ctl, tmp_path, verdict):
    """rootfs-pending: the agent has not rolled back what a restore changed in the rootfs (it
    died, or could not): the original command must not run on it; the init exits instead."""
    write_control(ctl, "rootfs-pending", "a restore is changing the rootfs\n")
    init = run(restore_args(ctl, timeout=1 if verdict == "timeout" else 30), RECORD)
    if verdict == "restore-failed":
        init.wait_log("waiting for a restore")
        write_control(ctl, "restore-failed", "the rollback was incomplete\n")
    assert init.wait() == 1
    assert not (tmp_path / "runs").exists() and not (ctl / "cold-start").exists()
    assert "no cold start" in init.stderr() and "rootfs-pending" in init.stderr()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_while_waiting_exits_at_once(run, ctl, tmp_path, sig, code):
    init = run(restore_args(ctl, timeout=60), RECORD)
    init.wait_log("waiting for a restore")
    t0 = time.monotonic()
    init.signal(sig)
    assert init.wait(timeout=5) == code
    assert time.monotonic() - t0 < 1
    assert not (tmp_path / "runs").exists()
    assert not (ctl / "cold-start").exists()


def test_other_signals_while_waiting_are_ignored(run, ctl, tmp_path):
    init = run(restore_args(ctl, timeout=1), RECORD)
    init.wait_log("waiting for a restore")
    init.signal(signal.SIGHUP)
    assert init.wait() == 0
    assert "ignoring signal 1: no main process yet\n" in init.stderr()
    assert (tmp_path / "runs").read_text() == "ran\n"


def test_restore_complete_adopts_restored_pid(run, ctl, tmp_path):
    init = run(restore_args(ctl), RECORD)
    init.wait_log("waiting for a restore")
    # The "restored" process: a child of the nsenter'd shell, orphaned when it exits.
    # $! is its pid in the namespace's numbering, which is what the agent writes.
    init.nsenter("(sleep 1; exit 7) & echo $! > ctl/.restore-pid.tmp && mv ctl/.restore-pid.tmp ctl/restore-pid")
    ns_pid = int((ctl / "restore-pid").read_text())
    write_control(ctl, "restore-complete", "")
    init.wait_log(f"restore complete: adopted main pid {ns_pid}\n")
    assert init.proc.poll() is None  # still running while the adopted process lives
    assert init.wait() == 7
    assert not (tmp_path / "runs").exists()
    assert not (ctl / "cold-start").exists()
    assert f"main pid {ns_pid} exited with status 7\n" in init.stderr()


def test_signals_are_forwarded_to_adopted_pid(run, ctl, tmp_path):
    init = run(restore_args(ctl), RECORD)
    init.wait_log("waiting for a restore")
    init.nsenter(
        '(trap "exit 9" USR1; while :; do sleep 0.05; done) & echo $! > ctl/.p && mv ctl/.p ctl/restore-pid'
    )
    write_control(ctl, "restore-complete", "")
    init.wait_log("restore complete: adopted main pid")
    init.signal(signal.SIGUSR1)
    assert init.wait() == 9
    assert not (tmp_path / "runs").exists()


def test_restored_pid_that_already_exited(run, ctl, tmp_path):
    init = run(restore_args(ctl), RECORD)
    init.wait_log("waiting for a restore")
    # It outlives the nsenter'd shell (which would otherwise reap it), then exits; the init
    # reaps it before restore-complete arrives.
    init.nsenter("(sleep 1; exit 5) & echo $! > ctl/.p && mv ctl/.p ctl/restore-pid")
    time.sleep(2.0)
    write_control(ctl, "restore-complete", "")
    assert init.wait() == 5
    assert "had already exited\n" in init.stderr()
    assert not (tmp_path / "runs").exists()
    assert not (ctl / "cold-start").exists()


@pytest.mark.parametrize(
    "pid_file, reason",
    [
        ("banana\n", "restore-pid is not a usable pid: 'banana'"),
        ("12x\n", "restore-pid is not a usable pid: '12x'"),
        ("1\n", "restore-pid is not a usable pid: '1'"),
        ("-5\n", "restore-pid is not a usable pid: '-5'"),
        ("4000\n", "restore-pid 4000 does not exist"),
        (None, "restore-complete without a readable restore-pid: No such file or directory"),
    ],
)
def test_bad_restore_pid_cold_starts(run, ctl, tmp_path, pid_file, reason):
    if pid_file is not None:
        write_control(ctl, "restore-pid", pid_file)
    write_control(ctl, "restore-complete", "")
    init = run(restore_args(ctl), RECORD)
    assert init.wait() == 0
    assert (ctl / "cold-start").read_text() == reason + "\n"
    assert (tmp_path / "runs").read_text() == "ran\n"


def test_missing_control_dir_cold_starts_at_once(run, tmp_path):
    init = run(restore_args(tmp_path / "absent", timeout=60), RECORD)
    assert init.wait(timeout=5) == 0
    assert f"cold start: control dir {tmp_path / 'absent'} is missing\n" in init.stderr()
    assert (tmp_path / "runs").read_text() == "ran\n"


def test_not_pid1_never_kills_other_processes(init_bin, ctl, tmp_path):
    # Not PID 1 (e.g. a shared pod pid namespace): kill(-1, SIGKILL) would hit every process the
    # init may signal, so it must not happen. Contained in a pid namespace whose PID 1 is a shell
    # with a bystander sleep, so a regression cannot take the test machine down.
    cmd = (
        "echo ran >> runs; "
        'if kill -0 "$(cat bystander)" 2>/dev/null; then echo bystander-alive; else echo bystander-dead; fi >> runs'
    )
    outer = (
        'sleep 30 & echo $! > bystander; '
        f'"$0" --mode restore --control ctl --timeout 1 -- {SH} -c \'{cmd}\'; echo "init-exit=$?" >> runs'
    )
    proc = subprocess.Popen(
        ["unshare", "--fork", "--pid", "--mount-proc", SH, "-c", outer, str(init_bin)],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True, text=True,
    )
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        pytest.fail("init did not exit within 10 s")
    assert proc.returncode == 0, err
    assert (tmp_path / "runs").read_text() == "ran\nbystander-alive\ninit-exit=0\n"
    assert (ctl / "cold-start").read_text() == "no restore within 1 s\n"
    assert "pid=3\n" in err  # really not PID 1


def test_adopted_pid_that_is_not_our_child_is_polled(run, ctl, tmp_path):
    init = run(restore_args(ctl), RECORD)
    init.wait_log("waiting for a restore")
    # The restored root is a child of a process outside the namespace (nsenter) that stays
    # alive and reaps it: the init can only watch it with kill(pid, 0).
    outside = subprocess.Popen(
        ["nsenter", "-t", str(init.pid), "-p", "--", SH, "-c",
         "echo $$ > ctl/.p && mv ctl/.p ctl/restore-pid && sleep 1; exit 4"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (ctl / "restore-pid").exists(), 5, "restore-pid")
        ns_pid = int((ctl / "restore-pid").read_text())
        write_control(ctl, "restore-complete", "")
        init.wait_log(f"main pid {ns_pid} is not our child; polling its liveness\n")
        assert outside.wait(timeout=10) == 4
        assert init.wait() == 1
        assert f"main pid {ns_pid} is gone; its exit status is unknown\n" in init.stderr()
        assert not (tmp_path / "runs").exists()
    finally:
        if outside.poll() is None:
            outside.kill()
            outside.wait(timeout=10)


# --- restore mode, failing closed (--on-failure fail) -----------------------------------------


@pytest.mark.parametrize("verdict", ["restore-failed", "timeout", "bad-pid", "rootfs-pending"])
def test_fail_closed_never_runs_the_command(run, ctl, tmp_path, verdict):
    """--on-failure fail: where the init would start cold, it exits with status 75 and the reason
    on stderr (the container log); the original command never runs and no cold-start is written."""
    if verdict == "rootfs-pending":
        write_control(ctl, "rootfs-pending", "a restore is changing the rootfs\n")
    init = run([*restore_args(ctl, timeout=1 if verdict == "timeout" else 30), "--on-failure", "fail"], RECORD)
    init.wait_log("waiting for a restore")
    if verdict in ("restore-failed", "rootfs-pending"):
        write_control(ctl, "restore-failed", "image differs\n")
    elif verdict == "bad-pid":
        write_control(ctl, "restore-pid", "nope\n")
        write_control(ctl, "restore-complete", "")
    assert init.wait() == 75
    assert not (tmp_path / "runs").exists()
    assert not (ctl / "cold-start").exists()
    reason = {"restore-failed": "restore-failed: image differs", "rootfs-pending": "restore-failed: image differs",
              "timeout": "no restore within 1 s", "bad-pid": "restore-pid is not a usable pid: 'nope'"}[verdict]
    assert (f"restore failed: {reason}; not starting the original command (on-restore-failure: fail)\n"
            in init.stderr()), init.stderr()
    assert "exiting with status 75\n" in init.stderr()


def test_fail_closed_at_once_when_the_control_dir_is_missing(run, tmp_path):
    init = run([*restore_args(tmp_path / "absent"), "--on-failure", "fail"], RECORD)
    assert init.wait(timeout=5) == 75
    assert not (tmp_path / "runs").exists()


def test_fail_closed_still_adopts_a_completed_restore(run, ctl, tmp_path):
    init = run([*restore_args(ctl), "--on-failure", "fail"], RECORD)
    init.wait_log("on-failure=fail")
    init.nsenter("sh -c 'sleep 0.5; exit 7' & echo $! > restored")
    write_control(ctl, "restore-pid", (tmp_path / "restored").read_text().strip() + "\n")
    write_control(ctl, "restore-complete", "")
    assert init.wait() == 7
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", ["", "Fail", "closed"])
def test_on_failure_takes_only_cold_start_or_fail(run, value):
    init = run(["--mode", "restore", "--on-failure", value], ["true"], pidns=False)
    assert init.wait() == 2
    init = run(["--mode", "restore", "--timeout", "1", f"--on-failure=cold-start"], ["true"], pidns=False)
    assert init.wait() == 0
