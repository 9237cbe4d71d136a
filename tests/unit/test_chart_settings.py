"""The plugin's tunables as typed `settings` keys of the chart: each one reaches the plugin's
flags (parsed by the plugin's own parser), the defaults are the plugin's own, and values the
plugin would refuse, or that mean something else, are refused at render time (values.schema.json
and templates/validate.yaml). extraEnv and resources are checked by the schema too."""

from __future__ import annotations

import copy

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")
pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is in the test extra (see docs/install.md)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

from nri_plugin.config import MapRanges  # noqa: E402
from runtime.route import RestorePath  # noqa: E402
from tests.unit.chart_render import RenderError, by_kind, render  # noqa: E402

K8S_VERSION = "1.33"
NAMESPACE = "kube-system"
# The plugin reads these at parse time as the defaults of their flags.
PLUGIN_ENV = ("REKINDLE_RESTORE_PATH", "REKINDLE_FILL_THREADS", "REKINDLE_BULK_MIN_RUN", "REKINDLE_PREFETCH",
              "REKINDLE_RESTORE_TIMEOUT", "REKINDLE_CACHE_DIR", "REKINDLE_CACHE_BYTES", "REKINDLE_CACHE_ENTRIES",
              "REKINDLE_CACHE_TMPFS", "REKINDLE_MAP", "REKINDLE_MAX_PARALLEL")


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def default_render() -> dict:
    return render(namespace=NAMESPACE)


def _plugin(r: dict) -> dict:
    (ds,) = by_kind(r["objects"], "DaemonSet")
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "rekindle"]
    return c


def _parsed(r: dict):
    """(argparse namespace, Settings) of the rendered command, by the plugin's own parser."""
    from nri_plugin.cli import _settings, build_parser
    args = build_parser().parse_args(_plugin(r)["args"])
    return args, _settings(args)


def _flat(settings, name: str):
    """A setting by its flag's flat name (config.FLAT: the group it lives in)."""
    from nri_plugin.config import FLAT
    if name in FLAT:
        group, key = FLAT[name]
        return getattr(getattr(settings, group), key)
    return getattr(settings, name)


TUNED = ["restore_path", "fill_threads", "max_layer_bytes", "bulk_min_run", "capture_timeout", "prefetch",
         "probes_per_pod", "probes_per_node", "cache_dir", "cache_bytes", "cache_entries", "map_ranges"]


def test_defaults_are_the_plugins_own(default_render):
    from nri_plugin.cli import _settings, build_parser
    args, rendered = _parsed(default_render)
    bare = build_parser().parse_args(["plugin"])
    plain = _settings(bare)
    assert {k: _flat(rendered, k) for k in TUNED} == {k: _flat(plain, k) for k in TUNED}
    assert args.max_parallel == bare.max_parallel
    assert rendered.restore.timeout == plain.restore.timeout == 1800


def test_the_chart_mounts_the_cache_tmpfs_by_default(default_render):
    """The one default that is not the plugin's: on a GPU node the mapped ranges want 2 MiB pages."""
    _, rendered = _parsed(default_render)
    assert rendered.cache.tmpfs is True
    r = render({"settings": {"cache": {"tmpfs": False}}}, namespace=NAMESPACE)
    assert "--cache-tmpfs" not in _plugin(r)["args"]
    assert _parsed(r)[1].cache.tmpfs is False


# values, the Settings field (or "max_parallel", the flag), what the plugin gets, the flag rendered
EACH_SETTING = [
    ({"restorePath": "stock"}, "restore_path", RestorePath.STOCK, ("--restore-path", "stock")),
    ({"fillThreads": 12}, "fill_threads", 12, ("--fill-threads", "12")),
    ({"maxParallel": 4}, "max_parallel", 4, ("--max-parallel", "4")),
    ({"maxLayerSize": "16Gi"}, "max_layer_bytes", 16 << 30, ("--max-layer-bytes", "16Gi")),
    ({"maxLayerSize": "1048576"}, "max_layer_bytes", 1 << 20, ("--max-layer-bytes", "1048576")),
    ({"bulkMinRun": "2Mi"}, "bulk_min_run", 2 << 20, ("--bulk-min-run", "2Mi")),
    ({"captureTimeoutSeconds": 900}, "capture_timeout", 900, ("--capture-timeout", "900")),
    ({"prefetch": False}, "prefetch", False, ("--no-prefetch",)),
    ({"probes": {"perPod": 3}}, "probes_per_pod", 3, ("--max-probes-per-pod", "3")),
    ({"probes": {"perNode": 64}}, "probes_per_node", 64, ("--max-probes", "64")),
    ({"cache": {"bytes": "2Gi"}}, "cache_bytes", 2 << 30, ("--cache-bytes", "2Gi")),
    ({"cache": {"bytes": "0"}}, "cache_bytes", 0, ("--cache-bytes", "0")),
    ({"cache": {"bytes": 0}}, "cache_bytes", 0, ("--cache-bytes", "0")),
    ({"cache": {"bytes": "auto"}}, "cache_bytes", -1, ("--cache-bytes", "auto")),
    ({"cache": {"entries": 64}}, "cache_entries", 64, ("--cache-entries", "64")),
    ({"cache": {"tmpfs": True}}, "cache_tmpfs", True, ("--cache-tmpfs",)),
    ({"cache": {"mapRanges": "all"}}, "map_ranges", MapRanges.ALL, ("--map-ranges", "all")),
    ({"cache": {"mapRanges": "none"}}, "map_ranges", MapRanges.NONE, ("--map-ranges", "none")),
    ({"prewarm": {"artifacts": ["team-a/llm", "team-b/asr.v2"]}}, "prewarm", ("team-a/llm", "team-b/asr.v2"),
     ("--prewarm", "team-a/llm,team-b/asr.v2")),
    ({"prewarm": {"intervalSeconds": 0}}, "prewarm_interval", 0.0, ("--prewarm-interval", "0")),
]


@pytest.mark.parametrize("values, field, want, flag", EACH_SETTING,
                         ids=[f"{f}={w}" for _, f, w, _ in EACH_SETTING])
def test_each_setting_reaches_the_plugin(values, field, want, flag):
    r = render({"settings": values}, namespace=NAMESPACE)
    args, settings = _parsed(r)
    got = args.max_parallel if field == "max_parallel" else _flat(settings, field)
    assert got == want
    rendered = _plugin(r)["args"]
    i = rendered.index(flag[0])
    assert tuple(rendered[i:i + len(flag)]) == flag
    assert settings.validate() == [] or all("rekindle-init" in p for p in settings.validate())
    for obj in r["objects"]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_prefetch_on_renders_no_flag(default_render):
    assert "--no-prefetch" not in _plugin(default_render)["args"]


BAD_SETTINGS = [
    ("restorePath fast", {"settings": {"restorePath": "fast"}}, "/settings/restorePath"),
    ("fillThreads -1", {"settings": {"fillThreads": -1}}, "/settings/fillThreads"),
    ("fillThreads 1025", {"settings": {"fillThreads": 1025}}, "/settings/fillThreads"),
    ("fillThreads a string", {"settings": {"fillThreads": "4"}}, "/settings/fillThreads"),
    ("maxParallel 0", {"settings": {"maxParallel": 0}}, "/settings/maxParallel"),
    ("maxParallel 65", {"settings": {"maxParallel": 65}}, "/settings/maxParallel"),
    ("maxLayerSize 8GB", {"settings": {"maxLayerSize": "8GB"}}, "/settings/maxLayerSize"),
    ("maxLayerSize 0", {"settings": {"maxLayerSize": "0"}}, "/settings/maxLayerSize"),
    ("maxLayerSize a number (Helm prints it as 8.589934592e+09)", {"settings": {"maxLayerSize": 8589934592}},
     "/settings/maxLayerSize"),
    ("bulkMinRun 4k", {"settings": {"bulkMinRun": "4k"}}, "/settings/bulkMinRun"),
    ("captureTimeoutSeconds 0", {"settings": {"captureTimeoutSeconds": 0}}, "/settings/captureTimeoutSeconds"),
    ("prefetch no", {"settings": {"prefetch": "no"}}, "/settings/prefetch"),
    ("probes.perPod 0", {"settings": {"probes": {"perPod": 0}}}, "/settings/probes/perPod"),
    ("probes.perNode 1025", {"settings": {"probes": {"perNode": 1025}}}, "/settings/probes/perNode"),
    ("probes unknown key", {"settings": {"probes": {"perCluster": 2}}}, "perCluster"),
    ("cache.bytes lots", {"settings": {"cache": {"bytes": "lots"}}}, "/settings/cache/bytes"),
    ("cache.bytes 32GB", {"settings": {"cache": {"bytes": "32GB"}}}, "/settings/cache/bytes"),
    ("cache.bytes -1", {"settings": {"cache": {"bytes": "-1"}}}, "/settings/cache/bytes"),
    ("cache.bytes a number", {"settings": {"cache": {"bytes": 34359738368}}}, "/settings/cache/bytes"),
    ("cache.entries 0", {"settings": {"cache": {"entries": 0}}}, "/settings/cache/entries"),
    ("cache.entries 1025", {"settings": {"cache": {"entries": 1025}}}, "/settings/cache/entries"),
    ("cache.tmpfs yes", {"settings": {"cache": {"tmpfs": "yes"}}}, "/settings/cache/tmpfs"),
    ("cache.mapRanges some", {"settings": {"cache": {"mapRanges": "some"}}}, "/settings/cache/mapRanges"),
    ("cache unknown key", {"settings": {"cache": {"dir": "/cache"}}}, "dir"),
    ("settings unknown key", {"settings": {"fillThread": 4}}, "fillThread"),
    ("extraEnv without a name", {"extraEnv": [{"value": "x"}]}, "/extraEnv/0"),
    ("extraEnv value not a string", {"extraEnv": [{"name": "N", "value": 1}]}, "/extraEnv/0/value"),
    ("extraEnv value and valueFrom", {"extraEnv": [{"name": "N", "value": "1",
                                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
     "/extraEnv/0"),
    ("extraEnv unknown key", {"extraEnv": [{"name": "N", "valu": "1"}]}, "valu"),
    ("extraEnv name with =", {"extraEnv": [{"name": "A=B", "value": "1"}]}, "/extraEnv/0/name"),
    ("extraEnv valueFrom unknown source", {"extraEnv": [{"name": "N", "valueFrom": {"vaultRef": {}}}]},
     "vaultRef"),
    ("resources cpu lots", {"resources": {"requests": {"cpu": "lots"}}}, "/resources/requests/cpu"),
    ("resources memory 4 GB", {"resources": {"limits": {"memory": "4 GB"}}}, "/resources/limits/memory"),
    ("resources negative", {"resources": {"requests": {"memory": -1}}}, "/resources/requests/memory"),
    ("resources limit (singular)", {"resources": {"limit": {"memory": "4Gi"}}}, "limit"),
]


@pytest.mark.parametrize("values, where", [(v, w) for _, v, w in BAD_SETTINGS], ids=[n for n, _, _ in BAD_SETTINGS])
def test_schema_refuses(values, where):
    with pytest.raises(RenderError, match="schema") as exc:
        render(copy.deepcopy(values), namespace=NAMESPACE)
    assert where in str(exc.value)


@pytest.mark.parametrize("values, words", [
    ({"extraEnv": [{"name": "REKINDLE_FILL_THREADS", "value": "8"}]},
     "extraEnv: REKINDLE_FILL_THREADS is set by settings.fillThreads"),
    ({"extraEnv": [{"name": "REKINDLE_HMAC_KEY_FILE", "value": "/k"}]},
     "extraEnv: REKINDLE_HMAC_KEY_FILE is set by the chart"),
    ({"extraArgs": ["--fill-threads=8"]}, "extraArgs: --fill-threads is rendered from settings.fillThreads"),
    ({"extraArgs": ["--no-prefetch"]}, "extraArgs: --no-prefetch is rendered from settings.prefetch"),
    ({"extraEnv": [{"name": "REKINDLE_CACHE_BYTES", "value": "1Gi"}]},
     "extraEnv: REKINDLE_CACHE_BYTES is set by settings.cache.bytes"),
    ({"extraEnv": [{"name": "REKINDLE_CACHE_ENTRIES", "value": "2"}]},
     "extraEnv: REKINDLE_CACHE_ENTRIES is set by settings.cache.entries"),
    ({"extraEnv": [{"name": "REKINDLE_CACHE_TMPFS", "value": "1"}]},
     "extraEnv: REKINDLE_CACHE_TMPFS is set by settings.cache.tmpfs"),
    ({"extraEnv": [{"name": "REKINDLE_MAP", "value": "all"}]}, "extraEnv: REKINDLE_MAP is set by settings.cache.mapRanges"),
    ({"extraEnv": [{"name": "REKINDLE_MAX_PARALLEL", "value": "8"}]},
     "extraEnv: REKINDLE_MAX_PARALLEL is set by settings.maxParallel"),
    ({"extraArgs": ["--cache-bytes=1Gi"]}, "extraArgs: --cache-bytes is rendered from settings.cache.bytes"),
    ({"extraArgs": ["--cache-entries", "2"]}, "extraArgs: --cache-entries is rendered from settings.cache.entries"),
    ({"extraArgs": ["--cache-tmpfs"]}, "extraArgs: --cache-tmpfs is rendered from settings.cache.tmpfs"),
    ({"extraArgs": ["--map-ranges=all"]}, "extraArgs: --map-ranges is rendered from settings.cache.mapRanges"),
    ({"extraArgs": ["--prewarm=a/b"]}, "extraArgs: --prewarm is rendered from settings.prewarm.artifacts"),
], ids=["env-owned-by-a-setting", "env-set-by-the-chart", "flag-with-value", "bare-flag", "env-cache-bytes",
        "env-cache-entries", "env-cache-tmpfs", "env-map", "env-max-parallel", "flag-cache-bytes", "flag-cache-entries",
        "flag-cache-tmpfs", "flag-map-ranges", "flag-prewarm"])
def test_what_a_setting_owns_is_refused_elsewhere(values, words):
    with pytest.raises(RenderError) as exc:
        render(values, namespace=NAMESPACE)
    assert words in str(exc.value)


def test_extra_env_resources_and_args_pass_through():
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
           {"name": "GOMAXPROCS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]
    resources = {"requests": {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": "10Gi"},
                 "limits": {"memory": "8Gi", "hugepages-2Mi": "1Gi", "cpu": 2}}
    r = render({"extraEnv": env, "resources": resources, "extraArgs": ["--init-binary=/opt/init"]},
               namespace=NAMESPACE)
    c = _plugin(r)
    assert c["env"][-2:] == env
    assert c["resources"]["requests"] == resources["requests"]
    assert c["resources"]["limits"]["hugepages-2Mi"] == "1Gi"
    assert c["args"][-1] == "--init-binary=/opt/init"
    for obj in r["objects"]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# cache.bytes, the plugin container's memory limit, whether the render goes through. The tmpfs's
# pages are charged to that container and cannot be reclaimed: a cache the limit cannot hold
# would have the kernel kill the plugin (or its CRIU) when an entry fills it.
CACHE_UNDER_LIMIT = [
    ("8Gi", "4Gi", False),
    ("4Gi", "4Gi", False),  # nothing left for the plugin and CRIU
    ("3Gi", "4Gi", True),
    ("8Gi", "8589934592", False),
    ("8Gi", 8589934592, False),  # a number: Helm reads it as a float
    ("7Gi", "8G", True),
    ("10Gi", "9.5Gi", False),
    ("9Gi", "9.5Gi", True),
    ("1Ti", "1e12", False),
    ("1Ti", "1.2e12", True),
    ("1048576", "2Mi", True),
    ("2097152", "2048Ki", False),
]


@pytest.mark.parametrize("cache_bytes, limit, ok", CACHE_UNDER_LIMIT,
                         ids=[f"{b}-under-{m!r}-{'ok' if ok else 'refused'}" for b, m, ok in CACHE_UNDER_LIMIT])
def test_a_tmpfs_cache_must_fit_under_the_memory_limit(cache_bytes, limit, ok):
    values = {"settings": {"cache": {"bytes": cache_bytes}}, "resources": {"limits": {"memory": limit}}}
    if ok:
        args, _ = _parsed(render(values, namespace=NAMESPACE))
        assert args.cache_tmpfs
        return
    with pytest.raises(RenderError) as exc:
        render(values, namespace=NAMESPACE)
    assert f"settings.cache.bytes {cache_bytes} with settings.cache.tmpfs" in str(exc.value)
    assert "resources.limits.memory" in str(exc.value)


@pytest.mark.parametrize("values", [
    {"settings": {"cache": {"bytes": "64Gi", "tmpfs": False}}},  # page cache of a disk: reclaimable
    {"settings": {"cache": {"bytes": "64Gi"}}, "resources": {"limits": {"memory": None}}},
], ids=["no-tmpfs", "no-memory-limit"])
def test_a_large_cache_without_tmpfs_or_limit_renders(values):
    args, settings = _parsed(render(values, namespace=NAMESPACE))
    assert settings.cache.bytes == 64 << 30


def test_notes_say_when_the_auto_cache_outgrows_the_memory_limit(default_render):
    notes = default_render["notes"]
    assert "settings.cache.bytes auto" in notes and "resources.limits.memory 4Gi" in notes
    for values in ({"settings": {"cache": {"bytes": "2Gi"}}}, {"settings": {"cache": {"tmpfs": False}}},
                   {"settings": {"cache": {"bytes": "0"}}}, {"resources": {"limits": {"memory": None}}}):
        assert "resources.limits.memory" not in render(values, namespace=NAMESPACE)["notes"], values
