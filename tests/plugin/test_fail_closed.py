"""rekindle.dev/on-restore-failure: fail: a restore that cannot be never leaves the container
unadjusted (which is a cold start); the init is put in place with restore-failed written, so
the container exits with the reason. A restarted container of such a pod tries again."""

from __future__ import annotations

import asyncio
import os

from nri_plugin.outcomes import OutcomeKind, outcome_of
from runtime.status import ContainerStatus, Phase

from .test_handlers import CountingSpecs, _create, _req, make_plugin  # noqa: F401 - fixture

CLOSED = {"rekindle.dev/restore": "nothing-here", "rekindle.dev/on-restore-failure": "fail"}


def _ctl(plugin) -> str:
    return plugin.settings.state_dir + "/control/0b6c-uid/app"


def test_a_failed_precheck_puts_the_init_in_place_to_fail_nri_0_10(make_plugin):
    plugin = make_plugin("2.2.1")
    pod, ctr = _req(CLOSED)
    adj = _create(plugin, pod, ctr).adjust
    assert list(adj.args) == ["/.rekindle/bin/rekindle-init", "--mode", "restore", "--control", "/rekindle",
                              "--timeout", "1800", "--on-failure", "fail", "--", "/srv", "--port", "80"]
    assert "nothing-here" in open(f"{_ctl(plugin)}/restore-failed").read()
    st = plugin.status.read("default", "web", "app")
    assert st.phase is Phase.RESTORE_FAILED and "nothing-here" in st.reason
    asyncio.run(plugin.post_start_container(pod, ctr))  # NoEngine: a job would raise
    assert plugin.status.read("default", "web", "app").phase is Phase.RESTORE_FAILED


def test_a_failed_precheck_swaps_the_spec_to_fail_nri_0_6(make_plugin):
    plugin = make_plugin()
    plugin.specs = specs = CountingSpecs()
    pod, ctr = _req(CLOSED)
    _create(plugin, pod, ctr)
    plugin.post_create_container(pod, ctr)
    args = specs.updated[ctr.id]["process"]["args"]
    assert args[0] == "/.rekindle/bin/rekindle-init" and args[args.index("--on-failure") + 1] == "fail"
    asyncio.run(plugin.post_start_container(pod, ctr))
    assert plugin.status.read("default", "web", "app").phase is Phase.RESTORE_FAILED


def test_cold_start_pods_keep_todays_args(make_plugin):
    plugin = make_plugin("2.2.1")
    pod, ctr = _req({"rekindle.dev/restore": "nothing-here"})
    assert not _create(plugin, pod, ctr).HasField("adjust")
    assert plugin.status.read("default", "web", "app").phase is Phase.COLD_START


def test_a_restarted_container_of_a_failing_closed_pod_tries_again(make_plugin):
    """No fail-once for a pod that fails closed: the previous failure is not a reason to run cold."""
    plugin = make_plugin("2.2.1")
    pod, ctr = _req(CLOSED)
    plugin.status.write(ContainerStatus(namespace="default", pod="web", container="app", role="restore",
                                        artifact="nothing-here", phase=Phase.RESTORE_FAILED, reason="x",
                                        pod_uid=pod.uid))
    os.makedirs(_ctl(plugin), exist_ok=True)
    open(f"{_ctl(plugin)}/cold-start", "w").write("stale")
    adj = _create(plugin, pod, ctr).adjust
    assert "--on-failure" in list(adj.args)
    st = plugin.status.read("default", "web", "app")
    assert st.phase is Phase.RESTORE_FAILED and "already attempted" not in st.reason
    assert not os.path.exists(f"{_ctl(plugin)}/cold-start")


def test_the_outcome_is_a_failed_restore_not_a_cold_start():
    st = ContainerStatus(namespace="ns", pod="p", container="c", role="restore", artifact="a",
                         phase=Phase.RESTORE_FAILED, reason="incompatible: image differs", pod_uid="u")
    outcome = outcome_of(st)
    assert outcome is not None and outcome.kind is OutcomeKind.RESTORE_FAILED
    assert outcome.reason_class.value == "incompatible"
    assert "failed closed" in outcome.summary() and "did not run" in outcome.summary()
    import datetime

    from nri_plugin.events_k8s import condition_patch, reports_for
    now = datetime.datetime.now(datetime.timezone.utc)
    assert condition_patch(outcome, now)["status"]["conditions"][0]["status"] == "False"
    assert any("RestoreFailed" in str(r) for r in reports_for(outcome, "node", now))


def test_a_restore_failing_in_the_job_is_recorded_as_failed_closed(tmp_path):
    from nri_plugin.jobs import Jobs, Work
    from nri_plugin.policy import decide
    from runtime import control
    from runtime.errors import RekindleError
    from runtime.status import StatusBook

    class Failing:
        def restore(self, work):
            raise RekindleError("criu restore failed: boom")

    book = StatusBook(tmp_path / "state")
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.prepare()
    intent = decide(dict(CLOSED), "app")
    work = Work(intent=intent, control=ctl, container_id="c1", pid=0, namespace="default", pod="web",
                pod_uid="u", container="app", image="", netns="")

    async def go() -> None:
        jobs = Jobs(Failing(), book)  # type: ignore[arg-type]
        jobs.bind_loop(asyncio.get_running_loop())
        jobs.start(work)
        await asyncio.gather(*jobs._tasks.values())
    asyncio.run(go())
    st = book.read("default", "web", "app")
    assert st.phase is Phase.RESTORE_FAILED and "boom" in st.reason
    assert "boom" in (ctl.read("restore-failed") or "")
