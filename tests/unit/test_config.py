"""Plugin settings and CLI numbers: ASCII digits only, every problem listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.cli import _settings, build_parser
from nri_plugin.config import CheckpointThp, MapRanges, Settings, serve_threads_from
from runtime.errors import ConfigError
from runtime.route import RestorePath

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fields, problem", [
    ({"idx": "\u0665\u0660"}, "--idx"),
    ({"idx": "\u00b2\u00b2"}, "--idx"),
    ({"probes_per_pod": 0}, "--max-probes-per-pod"),
    ({"probes_per_node": 0}, "--max-probes"),
], ids=["idx-arabic-indic", "idx-superscript", "probes-per-pod-0", "probes-per-node-0"])
def test_settings_validate_names_the_bad_setting(fields, problem):
    problems = Settings.from_flags({"init_binary": "/bin/true", **fields}).validate()
    assert any(p.startswith(problem + " ") for p in problems), problems


def test_default_settings_are_valid():
    assert Settings(init_binary="/bin/true").validate() == []


@pytest.mark.parametrize("flag", ["--restore-timeout", "--max-parallel", "--max-probes", "--max-probes-per-pod"])
@pytest.mark.parametrize("value", ["\u0661\u0662", "\u00b2", " 12", "1_0", "-1"],
                         ids=["arabic-indic", "superscript", "space", "underscore", "negative"])
def test_cli_numbers_are_ascii_digits_only(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plugin", f"{flag}={value}"])
    assert exc.value.code == 2
    assert "not a whole number" in capsys.readouterr().err


def test_max_parallel_zero_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plugin", "--max-parallel", "0"])
    assert exc.value.code == 2


def test_restore_timeout_from_the_environment_goes_through_the_same_check(monkeypatch, capsys):
    monkeypatch.setenv("REKINDLE_RESTORE_TIMEOUT", "\u0661\u0662")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plugin"])
    monkeypatch.setenv("REKINDLE_RESTORE_TIMEOUT", "120")
    args = build_parser().parse_args(["plugin", "--max-probes", "4"])
    assert (args.restore_timeout, args.probes_per_node, args.probes_per_pod) == (120, 4, 1)


@pytest.mark.parametrize("fields, problem", [
    ({"name": "bad name"}, "--name"),
    ({"state_dir": "relative/state"}, "--state-dir"),
    ({"store": "store"}, "--store"),
    ({"containerd_state": "run/containerd"}, "--containerd-state"),
    ({"restore_timeout": 0}, "--restore-timeout"),
    ({"restore_timeout": 86401}, "--restore-timeout"),
    ({"restore_path": "fast"}, "--restore-path"),
    ({"fill_threads": 1025}, "--fill-threads"),
    ({"serve_threads": 1025}, "--serve-threads"),
    ({"map_ranges": "some"}, "--map-ranges"),
    ({"checkpoint_thp": "never"}, "--checkpoint-thp"),
    ({"probes_per_node": 1025}, "--max-probes"),
    ({"metrics_port": 65536}, "--metrics-port"),
    ({"events": True}, "--events"),
    ({"kubeconfig": "/etc/kube.conf"}, "--kubeconfig"),
    ({"init_binary": "/nonexistent/rekindle-init"}, "no rekindle-init"),
], ids=["name", "state-dir", "store", "containerd-state", "timeout-0", "timeout-over-a-day", "restore-path", "fill-threads",
        "serve-threads", "map-ranges", "checkpoint-thp",
        "probes-over-1024", "port", "events-without-node", "kubeconfig-without-events", "no-init"])
def test_each_bad_setting_is_named(fields, problem):
    settings = Settings.from_flags({"init_binary": "/bin/true", **fields})
    assert [p for p in settings.validate() if p.startswith(problem)], settings.validate()


def test_every_problem_is_listed_at_once():
    bad = Settings.from_flags(dict(init_binary="/bin/true", idx="5", state_dir="state", restore_path="fast",
                                   metrics_port=70000))
    problems = bad.validate()
    assert len(problems) == 4, problems
    with pytest.raises(ConfigError) as exc:
        bad.check()
    assert all(p in str(exc.value) for p in problems)


def test_events_with_a_node_name_and_a_kubeconfig_are_valid():
    ok = Settings.from_flags(dict(init_binary="/bin/true", events=True, node_name="gpu-node-1",
                                  kubeconfig="/etc/kube.conf"))
    assert ok.validate() == []
    ok.check()


def test_the_flags_flat_names_land_in_their_groups_and_enums_are_parsed():
    s = Settings.from_flags(dict(restore_timeout=60, restore_path="stream", fill_threads=4, serve_threads=0,
                                 warm_rest=True, cache_bytes=0, map_ranges="all", checkpoint_thp="always",
                                 probes_per_pod=2, metrics_port=0, events=True, node_name="n", command="plugin"))
    assert (s.restore.timeout, s.restore.path, s.restore.fill_threads, s.restore.serve_threads,
            s.restore.warm_rest) == (60, RestorePath.STREAM, 4, 0, True)
    assert (s.cache.bytes, s.cache.map_ranges, s.checkpoint.thp) == (0, MapRanges.ALL, CheckpointThp.ALWAYS)
    assert (s.probes.per_pod, s.report.metrics_port, s.report.events, s.report.node_name) == (2, 0, True, "n")
    assert Settings.from_flags({}) == Settings()


def test_a_bad_enum_value_is_a_problem_and_the_default_is_kept():
    s = Settings.from_flags(dict(init_binary="/bin/true", restore_path="fast"))
    assert s.restore.path is RestorePath.AUTO
    assert s.validate() == ["--restore-path must be auto, bulk, stock or stream, got 'fast'"]


def test_the_stream_settings_are_read_from_the_environment_by_the_cli_only(monkeypatch):
    for raw, want in [("8", 8), ("0", 0), ("1025", None), ("x", None), ("", None)]:
        monkeypatch.setenv("REKINDLE_STREAM_THREADS", raw)
        assert serve_threads_from(os.environ) == want
    monkeypatch.setenv("REKINDLE_STREAM_THREADS", "3")
    monkeypatch.setenv("REKINDLE_STREAM_WARM_REST", "1")
    s = _settings(build_parser().parse_args(["plugin", "--fill-threads", "5"]))
    assert (s.restore.fill_threads, s.restore.serve_threads, s.restore.warm_rest) == (5, 3, True)
    s = _settings(build_parser().parse_args(["plugin", "--serve-threads", "7"]))
    assert s.restore.serve_threads == 7
    monkeypatch.delenv("REKINDLE_STREAM_THREADS")
    monkeypatch.delenv("REKINDLE_STREAM_WARM_REST")
    s = _settings(build_parser().parse_args(["plugin"]))
    assert (s.restore.serve_threads, s.restore.warm_rest) == (None, False)


def test_runtime_reads_no_stream_setting_from_the_environment():
    source = (REPO / "runtime" / "pages" / "stream.py").read_text() + (REPO / "runtime" / "restore.py").read_text()
    assert "REKINDLE_STREAM" not in source


def test_the_map_ranges_choice_names_the_page_machinerys_modes():
    from nri_plugin.cache import map_mode
    from runtime.pages.mapping import MapMode
    assert [m.value for m in MapRanges] == [m.value for m in MapMode]
    for m in MapRanges:
        assert map_mode(Settings.from_flags({"map_ranges": m.value})) is MapMode(m.value)


def test_reading_the_settings_loads_no_page_machinery():
    out = subprocess.run([sys.executable, "-c", "import sys, nri_plugin.config, nri_plugin.cli; "
                          "print(sorted(m for m in sys.modules if m.startswith('runtime.pages')))"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
