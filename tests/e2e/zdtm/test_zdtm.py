"""CRIU's zdtm static tests, each checkpointed by annotation through the real plugin and restored
into a new pod, on every restore path (bulk, the default; stock; stream).

The tests come from the CRIU source package hack/build-criu.sh builds (hack/build-zdtm.sh links
the ones in selection.toml statically into build/zdtm/bin) and run in a busybox image: the pod's
workload is a shell (``/zdtm/run.sh``) under a subreaper that starts a batch of tests, each in
its own directory, waits until every one has daemonized (zdtm's ``test_daemon()``), then writes
the ready file and waits. A test checks its state when it gets SIGTERM and writes PASS or FAIL
to its own output file, so every test's result stays its own within a batch.

1. ``test_passes_in_a_pod``: all tests in one pod, no checkpoint: signalled, each must PASS.
2. Every batch is started in a source pod annotated ``rekindle.dev/checkpoint``, the agent
   checkpoints it once it says ready; ``test_passes_after_restore[<path>-<test>]`` restores each
   artifact into a new pod with the plugin on that path, checks the restore really happened
   (status ``restored``, no cold start by the init, the bulk fill on the bulk path only, the
   source's test pids), signals the tests and reads back each one's PASS.
3. The source batches and every path's restores run once for the module: one pod per batch, all
   started together (about a minute for every path on 2 cores).

selection.toml says what is skipped (why an unprivileged pod cannot run it) and what fails
after a restore on one path (strict xfail, with the reason).
"""

from __future__ import annotations

import json
import logging
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from devtools.cri import Pod, PodState
from devtools.images import Dir, File, ImageSpec, busybox_rootfs, import_archive, write_oci_archive
from runtime.errors import RekindleError
from runtime.status import Phase, StatusBook
from tests.e2e.plugin_process import REPO, PluginProcess
from tests.e2e.zdtm.selection import HERE, PATHS, ZdtmTest, load
from tests.waiting import wait_for

log = logging.getLogger(__name__)

BIN = Path(REPO) / "build" / "zdtm" / "bin"
IMAGE = "localhost/rekindle/zdtm:1"
NAMESPACE = "zdtm"
CONTAINER = "zdtm"
BATCH = 8  # tests per pod: few pods for 2 cores, and one broken restore costs few results

SELECTED = load()
RUN = [t for t in SELECTED if t.skip is None]
_SHARED = [t for t in RUN if not t.alone]
BATCHES = [[t] for t in RUN if t.alone] + [_SHARED[i:i + BATCH] for i in range(0, len(_SHARED), BATCH)]


class FailedAfterRestore(AssertionError):
    """A test that passed on its source did not PASS after a restore."""


class NoRestore(AssertionError):
    """The pod of a test was not checkpointed or not restored (a test run alone may expect it)."""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    detail: str  # the test's output, or why there is none


@dataclass
class Batch:
    index: int
    tests: list[ZdtmTest]
    artifact: str
    pids: dict[str, str] = field(default_factory=dict)  # test -> its pid in the source
    error: str | None = None  # the checkpoint did not publish


# --- the image ---------------------------------------------------------------------------------

def zdtm_layer(tests: list[ZdtmTest]) -> list:
    entries: list = [File("/zdtm/subreaper", source=BIN / "subreaper", mode=0o755),
                     File("/zdtm/run.sh", source=HERE / "run.sh", mode=0o644)]
    for t in tests:
        entries += [Dir(f"/zdtm/{t.name}"),
                    File(f"/zdtm/{t.name}/{t.name}", source=BIN / t.name, mode=0o755),
                    File(f"/zdtm/{t.name}/args", data=" ".join(t.argv()).encode())]
    return entries


@pytest.fixture(scope="module")
def zdtm_image(sandbox, tmp_path_factory: pytest.TempPathFactory) -> str:
    missing = [n for n in ["subreaper", *(t.name for t in RUN)] if not (BIN / n).exists()]
    if missing:
        pytest.fail(f"zdtm binaries missing from {BIN}: {', '.join(missing)} (run hack/build-zdtm.sh)")
    spec = ImageSpec(IMAGE, lambda: [busybox_rootfs(), zdtm_layer(RUN)])
    archive = write_oci_archive(spec, tmp_path_factory.mktemp("zdtm-image") / "zdtm.oci.tar")
    import_archive(archive, sandbox.containerd_socket, sandbox.ctr)
    return IMAGE


# --- pods ----------------------------------------------------------------------------------------

class Pods:
    """The module's pods (the ``pod`` fixture is per test; these live across the module)."""

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox
        self.made: list[Pod] = []

    def run(self, name: str, tests: list[ZdtmTest], annotations: dict[str, str] | None = None) -> tuple[Pod, str]:
        p = self.sandbox.cri.run_pod_sandbox(name, NAMESPACE, annotations=annotations)
        self.made.append(p)
        cid = self.sandbox.run_container(p, CONTAINER, IMAGE,
                                         command=["/zdtm/subreaper", "/bin/sh", "/zdtm/run.sh",
                                                  *(t.name for t in tests)])
        return p, cid

    def remove(self, p: Pod) -> None:
        self.sandbox.cri.stop_pod(p.id)
        self.sandbox.cri.remove_pod(p.id)
        self.made.remove(p)

    def sweep(self) -> None:
        """Stop the pods a killed earlier session left running in the namespace (their tests would
        run on beside these); ones already stopped hold nothing and are left to the runtime."""
        for p in self.sandbox.cri.list_pods():
            if p.namespace == NAMESPACE and p.state is PodState.READY:
                try:
                    self.sandbox.cri.stop_pod(p.id)
                    self.sandbox.cri.remove_pod(p.id)
                except RekindleError as e:
                    log.warning("removing the leftover pod %s: %s", p.name, e)

    def close(self) -> None:
        for p in reversed(list(self.made)):
            self.remove(p)


def started(sandbox, cid: str, tests: list[ZdtmTest]) -> None:
    """Wait until the pod's shell has started every test (each start ends within 20 s)."""
    try:
        wait_for(lambda: sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "test -e /zdtm/started"]).exit_code == 0,
                 30 + 20 * len(tests), "the zdtm tests to start", interval=0.2)
    except AssertionError as e:
        state = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ls /zdtm/*/start.rc; ps -o pid,ppid,stat,args"]).out
        raise AssertionError(f"{e}\n{state}") from None


def read_pids(sandbox, cid: str, tests: list[ZdtmTest]) -> dict[str, str]:
    res = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", " ".join(
        f"echo {t.name} $(cat /zdtm/{t.name}/{t.name}.pid);" for t in tests)])
    return dict(ln.split(" ", 1) for ln in res.out.splitlines() if " " in ln)


# Signal every test of the batch, wait (bounded) until each one has written its output file or
# is gone without one (it crashed: zdtm renames the file as the test exits), print each result.
COLLECT = r"""
for t in $TESTS; do
    p=$(cat /zdtm/$t/$t.pid 2>/dev/null) && kill -TERM "$p" 2>/dev/null
    echo "$p" > /zdtm/$t/signalled
done
end=$(( $(date +%s) + $TIMEOUT ))
alive() { [ -n "$1" ] && [ -e /proc/$1/status ] && ! grep -q '^State:.*Z' /proc/$1/status; }
for t in $TESTS; do
    p=$(cat /zdtm/$t/signalled)
    while [ ! -e /zdtm/$t/$t.out ] && alive "$p" && [ "$(date +%s)" -lt "$end" ]; do sleep 0.1; done
done
for t in $TESTS; do
    echo "@@ $t"
    echo "started: exit status $(cat /zdtm/$t/start.rc) $(cat /zdtm/$t/start.err)"
    if [ -e /zdtm/$t/$t.out ]; then cat /zdtm/$t/$t.out
    else
        p=$(cat /zdtm/$t/signalled)
        if alive "$p"; then echo "NO RESULT: still running ${TIMEOUT}s after SIGTERM"
        else echo "NO RESULT: the test ended without its output (killed or crashed)"; fi
        tail -n 20 /zdtm/$t/$t.out.inprogress 2>/dev/null
    fi
done
"""


def passed(output: str) -> bool:
    """zdtm's verdict: a message line ``...: PASS`` (zdtm.py looks for the same word)."""
    return any(line.rsplit(":", 1)[-1].strip() == "PASS" for line in output.splitlines())


def collect(sandbox, cid: str, tests: list[ZdtmTest]) -> dict[str, Outcome]:
    timeout = int(max(t.timeout for t in tests))
    script = f"TESTS={shlex.quote(' '.join(t.name for t in tests))}; TIMEOUT={timeout}\n{COLLECT}"
    res = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", script], timeout=timeout + 30)
    found = {m.group(1): m.group(2).strip() for m in re.finditer(r"^@@ (\S+)\n(.*?)(?=^@@ |\Z)", res.out, re.M | re.S)}
    return {t.name: Outcome(passed(found.get(t.name, "")),
                            found.get(t.name) or f"no output (exec: {res.exit_code} {res.err.strip()})")
            for t in tests}


def phase(plugin: PluginProcess, p: Pod, phases: set[str], timeout: float = 120.0):
    st = StatusBook(plugin.state_dir).wait(p.namespace, p.name, CONTAINER, {Phase(x) for x in phases}, timeout)
    if st is None or st.phase.value not in phases:
        raise AssertionError(f"status of {p.name} is {st.phase.value if st else None} ({st.reason if st else ''}), "
                             f"wanted {phases}\nplugin log:\n{plugin.log()[-4000:]}")
    return st


# --- the runs ------------------------------------------------------------------------------------

class Campaign:
    """Runs each stage once, on first use; its result, or its failure, is what every later test gets."""

    def __init__(self, sandbox, plugin: PluginProcess, pods: Pods) -> None:
        self.sandbox, self.plugin, self.pods = sandbox, plugin, pods
        self.errors: dict[tuple[str, int], str] = {}  # (path, batch) -> why its restore gave no result
        self._done: dict[str, tuple[Any, Exception | None]] = {}
        self._path: str | None = None  # the plugin's restore path, once this module set it

    def baseline(self) -> dict[str, Outcome]:
        return self._once("baseline", self._baseline)

    def batches(self) -> list[Batch]:
        return self._once("checkpoint", self._checkpoint)

    def restored(self, path: str) -> dict[str, Outcome]:
        return self._once(f"{path} restore", lambda: self._restore(path))

    def _once(self, stage: str, run: Callable[[], Any]) -> Any:
        if stage not in self._done:
            try:
                self._done[stage] = (run(), None)
            except Exception as e:  # noqa: BLE001 - re-raised for each test that needs the stage
                self._done[stage] = (None, e)
        result, error = self._done[stage]
        if error is not None:
            raise AssertionError(f"the zdtm {stage} stage failed: {error}") from error
        return result

    def _baseline(self) -> dict[str, Outcome]:
        p, cid = self.pods.run("zdtm-baseline", RUN)
        started(self.sandbox, cid, RUN)
        out = collect(self.sandbox, cid, RUN)
        self.pods.remove(p)
        return out

    def _checkpoint(self) -> list[Batch]:
        self._set_path("bulk")  # either path's plugin checkpoints the same way
        made = []
        for i, tests in enumerate(BATCHES):
            b = Batch(i, tests, f"zdtm-{i}")
            made.append((b, *self.pods.run(f"zdtm-src-{i}", tests, {"rekindle.dev/checkpoint": b.artifact})))
        for b, p, cid in made:  # all started at once: the plugin checkpoints each as it says ready
            try:
                started(self.sandbox, cid, b.tests)
                b.pids = read_pids(self.sandbox, cid, b.tests)
                st = phase(self.plugin, p, {"published", "checkpoint-failed"})
                if st.phase.value != "published":
                    b.error = f"checkpoint of batch {b.index} failed: {st.reason}"
            except AssertionError as e:
                b.error = f"batch {b.index} was not checkpointed: {e}"
            self.pods.remove(p)
        return [b for b, _, _ in made]

    def _restore(self, path: str) -> dict[str, Outcome]:
        batches = self.batches()
        self._set_path(path)
        made = [(b, *self.pods.run(f"zdtm-{path}-{b.index}", b.tests, {"rekindle.dev/restore": b.artifact}))
                for b in batches if b.error is None]
        out: dict[str, Outcome] = {}
        for b, p, cid in made:
            st = phase(self.plugin, p, {"restored", "cold-start"})
            filled = "fill" in json.loads(st.to_json())["timings"]
            if st.phase.value != "restored":
                self.errors[(path, b.index)] = f"restore of batch {b.index} on {path}: {st.reason}"
            elif filled != (path == "bulk"):  # the plugin really took the path asked for
                self.errors[(path, b.index)] = f"batch {b.index} on {path}: bulk fill ran: {filled}"
            elif (self.plugin.control_dir(p.uid, CONTAINER) / "cold-start").exists():  # the init started anew
                self.errors[(path, b.index)] = f"batch {b.index} on {path}: restored, yet the init started cold"
            elif (pids := read_pids(self.sandbox, cid, b.tests)) != b.pids:
                self.errors[(path, b.index)] = f"batch {b.index} on {path}: pids {pids}, source {b.pids}"
            else:
                out.update(collect(self.sandbox, cid, b.tests))
            self.pods.remove(p)
        return out

    def _set_path(self, path: str) -> None:
        if self._path != path:
            self.plugin.stop()
            self.plugin.env = {"REKINDLE_RESTORE_PATH": path}
            self.plugin.start()
            self._path = path


@pytest.fixture(scope="module")
def campaign(sandbox, plugin, zdtm_image) -> Iterator[Campaign]:
    pods = Pods(sandbox)
    pods.sweep()
    try:
        yield Campaign(sandbox, plugin, pods)
    finally:
        pods.close()
        plugin.stop()
        plugin.env = {}


def _source_params() -> list:
    return [pytest.param(t, id=t.name, marks=[pytest.mark.skip(reason=t.skip)] if t.skip else [])
            for t in SELECTED]


def _restore_params() -> list:
    params = []
    for path in PATHS:
        for t in SELECTED:
            marks = []
            if t.skip:
                marks.append(pytest.mark.skip(reason=t.skip))
            elif path in t.xfail:
                marks.append(pytest.mark.xfail(strict=True, raises=(FailedAfterRestore, NoRestore), reason=t.xfail[path]))
            params.append(pytest.param(path, t, id=f"{path}-{t.name}", marks=marks))
    return params


@pytest.mark.parametrize("test", _source_params())
def test_passes_in_a_pod(campaign: Campaign, test: ZdtmTest) -> None:
    got = campaign.baseline()[test.name]
    assert got.passed, f"{test.name} does not pass in a pod without a checkpoint:\n{got.detail}"


@pytest.mark.parametrize(("path", "test"), _restore_params())
def test_passes_after_restore(campaign: Campaign, path: str, test: ZdtmTest) -> None:
    source = campaign.baseline()[test.name]
    assert source.passed, f"{test.name} does not pass on its source, so its restore proves nothing"
    batch = next(b for b in campaign.batches() if test in b.tests)
    if batch.error is not None:
        raise NoRestore(batch.error)
    got = campaign.restored(path)
    if (path, batch.index) in campaign.errors:
        raise NoRestore(campaign.errors[(path, batch.index)])
    if not got[test.name].passed:
        raise FailedAfterRestore(f"{test.name} after a restore on the {path} path:\n{got[test.name].detail}")


def test_selection_is_ci_sized() -> None:
    """Kept for 2 cores: a few dozen tests, every skip and xfail with its reason."""
    assert 30 <= len(RUN) <= 45, len(RUN)
    assert all(t.skip.strip() for t in SELECTED if t.skip is not None)
    assert all(r.strip() for t in SELECTED for r in t.xfail.values())
