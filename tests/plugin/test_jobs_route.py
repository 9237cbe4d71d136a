"""A restored container's status record says which route its pages came back by (the one the
restore wrote into its timings.json), so the demo, the bench and a user read it instead of
inferring it. Real processes stand in for the containers' inits."""

from __future__ import annotations

import json
import subprocess

from nri_plugin.policy import Role
from runtime import control
from runtime.status import Phase
from tests.plugin.test_jobs_cold_start import Engine, _run


class RoutedEngine(Engine):
    def __init__(self, timings_json: str | None) -> None:
        super().__init__(source_cold_start=60.0)
        self.timings_json = timings_json

    def restore(self, work):  # type: ignore[no-untyped-def]
        if self.timings_json is not None:
            work.control.write(control.TIMINGS, self.timings_json)
        return super().restore(work)


def test_the_restored_status_records_the_route_the_restore_took(tmp_path):
    route = {"path": "stream", "kind": "stream-build", "reason": "a CUDA tree streams"}
    engine = RoutedEngine(json.dumps({"restore": {"criu_restore": 0.04}, "route": route}))
    st, _ = _run(tmp_path, Role.RESTORE, engine, subprocess.Popen(["sleep", "30"]))
    assert st.phase is Phase.RESTORED
    assert st.route == "stream-build: stream (a CUDA tree streams)"
    assert json.loads(st.to_json())["route"] == st.route


def test_a_restore_whose_timings_are_missing_or_malformed_still_restores_without_a_route(tmp_path):
    for i, text in enumerate((None, "{not json", json.dumps(["route"]), json.dumps({"route": "bulk"}))):
        st, _ = _run(tmp_path / str(i), Role.RESTORE, RoutedEngine(text), subprocess.Popen(["sleep", "30"]))
        assert st.phase is Phase.RESTORED and st.route == "", text
