"""Plugin settings and CLI numbers: ASCII digits only, every problem listed."""

from __future__ import annotations

import pytest

from nri_plugin.cli import build_parser
from nri_plugin.config import Settings
from runtime.errors import ConfigError


@pytest.mark.parametrize("fields, problem", [
    ({"idx": "\u0665\u0660"}, "--idx"),
    ({"idx": "\u00b2\u00b2"}, "--idx"),
    ({"probes_per_pod": 0}, "--max-probes-per-pod"),
    ({"probes_per_node": 0}, "--max-probes"),
], ids=["idx-arabic-indic", "idx-superscript", "probes-per-pod-0", "probes-per-node-0"])
def test_settings_validate_names_the_bad_setting(fields, problem):
    problems = Settings(init_binary="/bin/true", **fields).validate()
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
    ({"probes_per_node": 1025}, "--max-probes"),
    ({"metrics_port": 65536}, "--metrics-port"),
    ({"events": True}, "--events"),
    ({"kubeconfig": "/etc/kube.conf"}, "--kubeconfig"),
    ({"init_binary": "/nonexistent/rekindle-init"}, "no rekindle-init"),
], ids=["name", "state-dir", "store", "containerd-state", "timeout-0", "timeout-over-a-day", "restore-path", "fill-threads",
        "probes-over-1024", "port", "events-without-node", "kubeconfig-without-events", "no-init"])
def test_each_bad_setting_is_named(fields, problem):
    settings = Settings(**{"init_binary": "/bin/true", **fields})
    assert [p for p in settings.validate() if p.startswith(problem)], settings.validate()


def test_every_problem_is_listed_at_once():
    bad = Settings(init_binary="/bin/true", idx="5", state_dir="state", restore_path="fast", metrics_port=70000)
    problems = bad.validate()
    assert len(problems) == 4, problems
    with pytest.raises(ConfigError) as exc:
        bad.check()
    assert all(p in str(exc.value) for p in problems)


def test_events_with_a_node_name_and_a_kubeconfig_are_valid():
    ok = Settings(init_binary="/bin/true", events=True, node_name="gpu-node-1", kubeconfig="/etc/kube.conf")
    assert ok.validate() == []
    ok.check()
