"""Annotation policy tables."""

from __future__ import annotations

import pytest

from nri_plugin.policy import AfterCheckpoint, Intent, ProbeKind, Role, decide
from runtime.errors import AnnotationError

CK = "rekindle.dev/checkpoint"
RS = "rekindle.dev/restore"
DC = "kubectl.kubernetes.io/default-container"


@pytest.mark.parametrize(
    "annotations, container, role, artifact",
    [
        ({}, "app", None, None),
        ({"other.io/x": "1"}, "app", None, None),
        ({CK: "qwen-7b"}, "app", Role.CHECKPOINT, "qwen-7b"),
        ({RS: "qwen-7b.v2"}, "app", Role.RESTORE, "qwen-7b.v2"),
        ({RS: "m", "rekindle.dev/container": "app"}, "app", Role.RESTORE, "m"),
        ({RS: "m", "rekindle.dev/container": "app"}, "sidecar", None, None),
        ({RS: "m", DC: "app"}, "app", Role.RESTORE, "m"),
        ({RS: "m", DC: "app"}, "istio-proxy", None, None),
        ({CK: "m", DC: "app", "rekindle.dev/container": "sidecar"}, "sidecar", Role.CHECKPOINT, "m"),
        ({CK: "m", DC: "app", "rekindle.dev/container": "sidecar"}, "app", None, None),
        ({DC: "app"}, "app", None, None),
    ],
    ids=["none", "foreign-keys", "checkpoint", "restore", "container-match", "container-other",
         "default-container-match", "default-container-other", "rekindle-container-wins",
         "rekindle-container-wins-other", "default-container-alone"],
)
def test_decide_picks_role_and_artifact(annotations, container, role, artifact):
    intent = decide(annotations, container)
    assert (intent.role if intent else None, intent.artifact if intent else None) == (role, artifact)


@pytest.mark.parametrize(
    "annotations, bad_key",
    [
        ({CK: "../etc"}, CK),
        ({CK: "Upper"}, CK),
        ({CK: ""}, CK),
        ({CK: "a" * 64}, CK),
        ({RS: ".."}, RS),
        ({RS: "qwen-7b\n"}, RS),
        ({CK: "qwen-7b\n"}, CK),
        ({RS: "a", "rekindle.dev/container": "app\n"}, "rekindle.dev/container"),
        ({CK: "a", RS: "b"}, RS),
        ({"rekindle.dev/restor": "x"}, "rekindle.dev/restor"),
        ({"rekindle.dev/ready-probe": "file"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "ftp://x:1"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "http://:0/"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "tcp://:80/path"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/after-checkpoint": "pause"}, "rekindle.dev/after-checkpoint"),
        ({RS: "a", "rekindle.dev/restore-timeout": "0"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "-5"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "99999999"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/after-checkpoint": "exit"}, "rekindle.dev/after-checkpoint"),
        ({RS: "a", "rekindle.dev/container": "Bad_Name"}, "rekindle.dev/container"),
        ({RS: "a", "rekindle.dev/restore-timeout": "\u00b2"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "\u0661\u0662"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "\uff13\uff10"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": " 12"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "1_0"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "+5"}, "rekindle.dev/restore-timeout"),
        ({RS: "a", "rekindle.dev/restore-timeout": "9" * 5000}, "rekindle.dev/restore-timeout"),
        ({CK: "a", "rekindle.dev/ready-probe": "http://:\u0668\u0660/"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "http://:8_0/"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "http://:" + "9" * 5000 + "/"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "http://[::1/"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "http://example.com:80/"}, "rekindle.dev/ready-probe"),
        ({CK: "a", "rekindle.dev/ready-probe": "tcp://\u0661.2.3.4:80"}, "rekindle.dev/ready-probe"),
        ({RS: "a", DC: "Bad_Name"}, DC),
        ({CK: "a", "rekindle.dev/overwrite": "yes"}, "rekindle.dev/overwrite"),
        ({RS: "a", "rekindle.dev/overwrite": "true"}, "rekindle.dev/overwrite"),
    ],
    ids=["traversal", "uppercase", "empty", "too-long", "dotdot", "restore-trailing-newline",
         "checkpoint-trailing-newline", "container-trailing-newline", "both-roles", "typo-key",
         "probe-alone", "probe-scheme", "probe-port-0", "tcp-path", "after-bad", "timeout-0",
         "timeout-negative", "timeout-huge", "after-on-restore", "container-bad",
         "timeout-superscript", "timeout-arabic-indic", "timeout-fullwidth", "timeout-space",
         "timeout-underscore", "timeout-plus", "timeout-5000-digits", "port-arabic-indic",
         "port-underscore", "port-5000-digits", "probe-unclosed-bracket", "probe-host-name",
         "probe-host-arabic-indic", "default-container-bad", "overwrite-not-bool", "overwrite-on-restore"],
)
def test_decide_rejects_malformed_annotations_naming_the_key(annotations, bad_key):
    with pytest.raises(AnnotationError) as err:
        decide(annotations, "app")
    assert err.value.key == bad_key


def test_decide_parses_probe_after_and_timeout():
    intent = decide({CK: "m", "rekindle.dev/ready-probe": "http://:8080/healthz",
                     "rekindle.dev/after-checkpoint": "exit"}, "app")
    assert intent == Intent(Role.CHECKPOINT, "m", intent.ready_probe, AfterCheckpoint.EXIT)
    assert (intent.ready_probe.kind, intent.ready_probe.host, intent.ready_probe.port,
            intent.ready_probe.path) == (ProbeKind.HTTP, "127.0.0.1", 8080, "/healthz")
    assert decide({RS: "m", "rekindle.dev/restore-timeout": "30"}, "a").restore_timeout == 30


@pytest.mark.parametrize(
    "value, host, port",
    [("http://:8080/", "127.0.0.1", 8080), ("http://localhost:81/x", "127.0.0.1", 81),
     ("tcp://10.0.0.7:9000", "10.0.0.7", 9000), ("http://[::1]:8000/", "::1", 8000)],
    ids=["empty-host", "localhost", "ipv4", "ipv6"],
)
def test_probe_hosts_are_addresses(value, host, port):
    probe = decide({CK: "m", "rekindle.dev/ready-probe": value}, "app").ready_probe
    assert (probe.host, probe.port) == (host, port)


def test_node_default_restore_timeout_applies_unless_annotated():
    assert decide({RS: "m"}, "a", default_timeout=90).restore_timeout == 90
    assert decide({RS: "m", "rekindle.dev/restore-timeout": "30"}, "a", default_timeout=90).restore_timeout == 30


@pytest.mark.parametrize("annotations, container, named, overwrite", [
    ({CK: "m"}, "app", False, False),
    ({CK: "m", "rekindle.dev/container": "app"}, "app", True, False),
    ({CK: "m", DC: "app"}, "app", True, False),
    ({CK: "m", "rekindle.dev/overwrite": "true"}, "app", False, True),
    ({CK: "m", "rekindle.dev/overwrite": "false"}, "app", False, False),
], ids=["unnamed", "named-by-rekindle", "named-by-kubectl-default", "overwrite", "no-overwrite"])
def test_intent_says_whether_the_container_was_named_and_whether_to_overwrite(annotations, container, named,
                                                                              overwrite):
    intent = decide(annotations, container)
    assert (intent.named, intent.overwrite) == (named, overwrite)


@pytest.mark.parametrize("value, cap, want", [
    ("1048576", 8 << 30, 1 << 20), ("512Mi", 8 << 30, 512 << 20), ("2Gi", 8 << 30, 2 << 30),
    (None, 4 << 30, 4 << 30),
], ids=["bytes", "mebibytes", "gibibytes", "node-default"])
def test_max_layer_size_is_the_annotation_within_the_nodes_cap(value, cap, want):
    ann = {CK: "a", **({"rekindle.dev/max-layer-size": value} if value else {})}
    assert decide(ann, "app", layer_cap=cap).max_layer_bytes == want


@pytest.mark.parametrize("value, cap", [
    ("9Gi", 8 << 30), ("1.5Gi", 8 << 30), ("1G", 8 << 30), ("-1", 8 << 30), ("\u0661Mi", 8 << 30), ("0", 8 << 30),
], ids=["over-the-cap", "fraction", "decimal-unit", "negative", "arabic-digit", "zero"])
def test_max_layer_size_refuses_what_the_node_does_not_allow(value, cap):
    with pytest.raises(AnnotationError) as err:
        decide({CK: "a", "rekindle.dev/max-layer-size": value}, "app", layer_cap=cap)
    assert err.value.key == "rekindle.dev/max-layer-size"


def test_max_layer_size_applies_to_sources_only():
    with pytest.raises(AnnotationError, match="checkpoint sources only"):
        decide({RS: "a", "rekindle.dev/max-layer-size": "1Mi"}, "app")


# ---------------------------------------------------------------- rekindle.dev/on-restore-failure
@pytest.mark.parametrize("value, want, closed", [
    (None, "cold-start", False), ("cold-start", "cold-start", False), ("fail", "fail", True),
])
def test_on_restore_failure_defaults_to_cold_start(value, want, closed):
    ann = {"rekindle.dev/restore": "a"}
    if value is not None:
        ann["rekindle.dev/on-restore-failure"] = value
    intent = decide(ann, "c")
    assert intent is not None and intent.on_failure.value == want and intent.fails_closed is closed


@pytest.mark.parametrize("value", ["", "Fail", "FAIL", "fail ", " fail", "closed", "true", "cold_start",
                                   "fail\n", "ｆａｉｌ"])
def test_on_restore_failure_is_parsed_strictly(value):
    with pytest.raises(AnnotationError) as exc:
        decide({"rekindle.dev/restore": "a", "rekindle.dev/on-restore-failure": value}, "c")
    assert exc.value.key == "rekindle.dev/on-restore-failure"


def test_on_restore_failure_applies_to_restore_pods_only():
    with pytest.raises(AnnotationError) as exc:
        decide({"rekindle.dev/checkpoint": "a", "rekindle.dev/on-restore-failure": "fail"}, "c")
    assert exc.value.key == "rekindle.dev/on-restore-failure" and "restore pods only" in str(exc.value)


def test_on_restore_failure_follows_the_named_container():
    ann = {"rekindle.dev/restore": "a", "rekindle.dev/container": "server",
           "rekindle.dev/on-restore-failure": "fail"}
    assert decide(ann, "sidecar") is None
    intent = decide(ann, "server")
    assert intent is not None and intent.fails_closed


def test_prewarm_marks_a_source_and_nothing_else() -> None:
    intent = decide({"rekindle.dev/checkpoint": "llm", "rekindle.dev/prewarm": "true"}, "app")
    assert intent is not None and intent.prewarm is True
    intent = decide({"rekindle.dev/checkpoint": "llm"}, "app")
    assert intent is not None and intent.prewarm is False
    with pytest.raises(AnnotationError, match="must be true or false"):
        decide({"rekindle.dev/checkpoint": "llm", "rekindle.dev/prewarm": "yes"}, "app")
    with pytest.raises(AnnotationError, match="applies to checkpoint sources only"):
        decide({"rekindle.dev/restore": "llm", "rekindle.dev/prewarm": "true"}, "app")


@pytest.mark.parametrize("value", ["driver", "all", "none"])
def test_map_ranges_is_a_sources_choice_of_the_node_caches_modes(value: str) -> None:
    intent = decide({"rekindle.dev/checkpoint": "llm", "rekindle.dev/map-ranges": value}, "app")
    assert intent is not None and intent.map_ranges == value


def test_map_ranges_defaults_to_the_node_and_is_parsed_strictly() -> None:
    intent = decide({"rekindle.dev/checkpoint": "llm"}, "app")
    assert intent is not None and intent.map_ranges == ""
    for bad in ("", "ALL", "every", "all "):
        with pytest.raises(AnnotationError, match="must be one of driver, all, none"):
            decide({"rekindle.dev/checkpoint": "llm", "rekindle.dev/map-ranges": bad}, "app")
    with pytest.raises(AnnotationError, match="applies to checkpoint sources only"):
        decide({"rekindle.dev/restore": "llm", "rekindle.dev/map-ranges": "all"}, "app")
