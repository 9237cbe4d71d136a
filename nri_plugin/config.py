"""The plugin's settings: small frozen dataclasses grouped by what the code uses, every field
defaulted, ``validate()`` lists every problem.

Settings come from CLI flags (the DaemonSet passes them), and from the environment only here
and in the CLI (a flag's default, or a measurement setting without a flag): the engine below
reads none. :meth:`Settings.from_flags` turns the flags' flat names into the groups and parses
the enums at this boundary; a value that names no choice is kept as a problem. A bad setting
stops the plugin at start-up with all problems listed at once, while a bad annotation only
affects its own pod.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runtime.containerd.defaults import DEFAULT_CONFIG, DEFAULT_SOCKET
from runtime.errors import ConfigError
from runtime.route import RestorePath

from .policy import parse_decimal
from .prewarm_state import parse_names

DEFAULT_STATE_DIR = "/var/lib/rekindle"

# Measurement settings of the streamed path, read here only (runtime.pages.stream reads none).
STREAM_THREADS_ENV = "REKINDLE_STREAM_THREADS"   # --serve-threads' default
WARM_REST_ENV = "REKINDLE_STREAM_WARM_REST"      # 1: RestoreSettings.warm_rest


def _default_init_candidates() -> list[str]:
    here = Path(__file__).resolve().parent.parent
    return [
        os.environ.get("REKINDLE_INIT", ""),
        "/usr/local/lib/rekindle/rekindle-init",
        str(here / "build" / "rekindle-init"),
    ]


def serve_threads_from(environ: Mapping[str, str]) -> int | None:
    """``$REKINDLE_STREAM_THREADS`` when it is a number of 0..1024; None (the serve's default)
    otherwise, a bad value ignored as it always was."""
    raw = environ.get(STREAM_THREADS_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) <= 1024 else None


def warm_rest_from(environ: Mapping[str, str]) -> bool:
    return environ.get(WARM_REST_ENV, "") == "1"


class MapRanges(enum.Enum):
    """What a restore from the node cache maps, named as ``runtime.pages.mapping.MapMode``
    names it (``cache.map_mode`` turns one into the other): kept here so that reading the
    settings does not load the page machinery, which every CLI command would pay at start-up."""

    NONE = "none"
    DRIVER = "driver"
    ALL = "all"


class CheckpointThp(enum.Enum):
    """The node's transparent huge page mode during a CUDA checkpoint (runtime.proc.thp)."""

    KEEP = "keep"
    ALWAYS = "always"  # node-wide for those seconds: the driver's host copy comes in huge pages


@dataclass(frozen=True)
class RestoreSettings:
    timeout: int = 1800              # default of the rekindle.dev/restore-timeout annotation
    # auto (runtime.route decides), stream (served while it runs), bulk (filled beside CRIU
    # first) or stock (CRIU restores all)
    path: RestorePath = RestorePath.AUTO
    prefetch: bool = True            # read a restore's artifact ahead from RunPodSandbox on
    fill_threads: int = 0            # threads filling bulk pages; 0: one per core, up to 16
    # the streamed path's install threads (--serve-threads, $REKINDLE_STREAM_THREADS); None:
    # fill_threads where set (what --fill-threads has always meant there), else 12
    serve_threads: int | None = None
    warm_rest: bool = False          # $REKINDLE_STREAM_WARM_REST=1 (runtime.restore.RestoreRequest)


@dataclass(frozen=True)
class CacheSettings:
    dir: str = ""                    # the node cache (runtime.pages.nodecache); "": <state_dir>/cache
    bytes: int = -1                  # its byte bound; 0: no cache; -1: a quarter of the node's memory
    entries: int = 8                 # its entry bound
    tmpfs: bool = False              # mount a huge=always tmpfs there (in the plugin's mount namespace)
    map_ranges: MapRanges = MapRanges.DRIVER  # what a restore from the cache maps (runtime.pages.mapping)
    prewarm: tuple[str, ...] = ()    # namespace/name of artifacts whose cache entry is written as published
    prewarm_interval: float = 30.0   # seconds between looks at the marked names (nri_plugin.prewarm); 0: none


@dataclass(frozen=True)
class CheckpointSettings:
    bulk_min_run: int = 4096         # page runs at least this long move beside CRIU at a checkpoint
    capture_timeout: int = 600       # seconds a checkpoint may spend capturing the writable layer
    thp: CheckpointThp = CheckpointThp.KEEP


@dataclass(frozen=True)
class ProbeSettings:
    per_pod: int = 1                 # ready-probes of one pod at once (its checkpoint sources)
    per_node: int = 16               # ready-probes of the whole node at once


@dataclass(frozen=True)
class ReportSettings:
    metrics_port: int = 9464         # /metrics, /readyz, /healthz; 0: no HTTP endpoint at all
    metrics_address: str = "0.0.0.0"
    events: bool = False             # report outcomes to Kubernetes (Events, pod condition)
    kubeconfig: str = ""             # with events: a kubeconfig file instead of the service account
    node_name: str = ""              # the Kubernetes node (the chart: $NODE_NAME from spec.nodeName)


# A flag's flat name (its argparse dest) -> (group, field); the rest are Settings' own fields.
FLAT: dict[str, tuple[str, str]] = {
    "restore_timeout": ("restore", "timeout"), "restore_path": ("restore", "path"),
    "prefetch": ("restore", "prefetch"), "fill_threads": ("restore", "fill_threads"),
    "serve_threads": ("restore", "serve_threads"), "warm_rest": ("restore", "warm_rest"),
    "cache_dir": ("cache", "dir"), "cache_bytes": ("cache", "bytes"), "cache_entries": ("cache", "entries"),
    "cache_tmpfs": ("cache", "tmpfs"), "map_ranges": ("cache", "map_ranges"), "prewarm": ("cache", "prewarm"),
    "prewarm_interval": ("cache", "prewarm_interval"),
    "bulk_min_run": ("checkpoint", "bulk_min_run"), "capture_timeout": ("checkpoint", "capture_timeout"),
    "checkpoint_thp": ("checkpoint", "thp"),
    "probes_per_pod": ("probes", "per_pod"), "probes_per_node": ("probes", "per_node"),
    "metrics_port": ("report", "metrics_port"), "metrics_address": ("report", "metrics_address"),
    "events": ("report", "events"), "kubeconfig": ("report", "kubeconfig"), "node_name": ("report", "node_name"),
}

# The enums parsed at the boundary: flat name -> (type, the flag's problem when a value names none)
_ENUMS: dict[str, tuple[type[enum.Enum], str]] = {
    "restore_path": (RestorePath, "--restore-path must be auto, bulk, stock or stream"),
    "map_ranges": (MapRanges, "--map-ranges must be driver, all or none"),
    "checkpoint_thp": (CheckpointThp, "--checkpoint-thp must be keep or always"),
}


@dataclass(frozen=True)
class Settings:
    name: str = "rekindle"
    idx: str = "50"
    socket_path: str = DEFAULT_SOCKET
    state_dir: str = DEFAULT_STATE_DIR
    store: str = DEFAULT_STATE_DIR + "/store"
    hmac_key_file: str = ""          # default: <state_dir>/hmac.key
    create_key: bool = False         # create the key when absent (`rekindle plugin --create-key` only)
    containerd_socket: str = "/run/containerd/containerd.sock"
    containerd_state: str = "/run/containerd"
    containerd_namespace: str = "k8s.io"
    init_binary: str = ""            # where to install the init from; default: first that exists
    max_layer_bytes: int = 8 << 30   # cap on a captured writable layer (and on one applied)
    cuda_parallel: int = 0           # CUDA driver sequences at once (runtime.gpu.cuda); 0: as max_parallel
    containerd_config: str = str(DEFAULT_CONFIG)  # read by `rekindle doctor` only
    restore: RestoreSettings = field(default_factory=RestoreSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    probes: ProbeSettings = field(default_factory=ProbeSettings)
    report: ReportSettings = field(default_factory=ReportSettings)
    # values the flags gave that name no choice of an enum (kept for validate(); the default used)
    unparsed: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def from_flags(cls, flags: Mapping[str, object]) -> Settings:
        """The settings of flat, flag-named values (a command's parsed flags; names that are no
        setting are ignored, a setting without a value keeps its default). Enum values come as
        their strings; one that names no choice is a problem :meth:`validate` lists."""
        top = {f.name for f in dataclasses.fields(cls)} - set(_GROUPS) - {"unparsed"}
        own: dict[str, object] = {}
        groups: dict[str, dict[str, object]] = {g: {} for g in _GROUPS}
        unparsed: list[str] = []
        for name, value in flags.items():
            if name in _ENUMS and isinstance(value, str):
                kind, problem = _ENUMS[name]
                try:
                    value = kind(value)
                except ValueError:
                    unparsed.append(f"{problem}, got {value!r}")
                    continue
            if name in FLAT:
                group, key = FLAT[name]
                groups[group][key] = value
            elif name in top:
                own[name] = value
        return cls(**own, **{g: _GROUPS[g](**v) for g, v in groups.items()},  # type: ignore[arg-type]
                   unparsed=tuple(unparsed))

    @property
    def key_path(self) -> Path:
        return Path(self.hmac_key_file or os.path.join(self.state_dir, "hmac.key"))

    @property
    def thp_record(self) -> str:
        """The THP mode found before a CUDA checkpoint switched it (runtime.proc.thp)."""
        return os.path.join(self.state_dir, "thp-mode-found")

    @property
    def bin_dir(self) -> Path:
        return Path(self.state_dir) / "bin"

    @property
    def installed_init(self) -> Path:
        return self.bin_dir / "rekindle-init"

    def init_source(self) -> str | None:
        candidates = [self.init_binary] if self.init_binary else _default_init_candidates()
        return next((c for c in candidates if c and os.access(c, os.X_OK)), None)

    def validate(self) -> list[str]:
        problems = list(self.unparsed)
        if len(self.idx) != 2 or parse_decimal(self.idx) is None:
            problems.append(f"--idx must be two digits, got {self.idx!r}")
        if not self.name or not all(c.isalnum() or c in "_.+-" for c in self.name):
            problems.append(f"--name must match [a-zA-Z0-9_.+-]+, got {self.name!r}")
        for label, path in (("--state-dir", self.state_dir), ("--store", self.store),
                            ("--containerd-state", self.containerd_state)):
            if not os.path.isabs(path):
                problems.append(f"{label} must be an absolute path, got {path!r}")
        restore, cache, report = self.restore, self.cache, self.report
        if not 1 <= restore.timeout <= 86400:
            problems.append(f"--restore-timeout must be 1..86400 seconds, got {restore.timeout}")
        if not 0 <= self.cuda_parallel <= 64:
            problems.append(f"--cuda-parallel must be 0..64 (0: as --max-parallel), got {self.cuda_parallel}")
        if cache.bytes < -1 or not 1 <= cache.entries <= 1024:
            problems.append("--cache-bytes must be -1 or more and --cache-entries 1..1024")
        try:
            parse_names(cache.prewarm)
        except ValueError as exc:
            problems.append(f"--prewarm: {exc}")
        if not (cache.prewarm_interval == 0 or 1 <= cache.prewarm_interval <= 86400):
            problems.append(f"--prewarm-interval must be 0 (off) or 1..86400 seconds, got {cache.prewarm_interval}")
        if not 0 <= restore.fill_threads <= 1024:
            problems.append(f"--fill-threads must be 0..1024 (0: one per core, up to 16), got {restore.fill_threads}")
        if restore.serve_threads is not None and not 0 <= restore.serve_threads <= 1024:
            problems.append(f"--serve-threads must be 0..1024 (0: faults only), got {restore.serve_threads}")
        for label, value in (("--max-probes-per-pod", self.probes.per_pod), ("--max-probes", self.probes.per_node)):
            if not 1 <= value <= 1024:
                problems.append(f"{label} must be 1..1024, got {value}")
        if not 0 <= report.metrics_port <= 65535:
            problems.append(f"--metrics-port must be 0..65535 (0: off), got {report.metrics_port}")
        if report.events and not report.node_name:
            problems.append("--events needs the node's name: --node-name or $NODE_NAME "
                            "(the chart sets it from spec.nodeName)")
        if report.kubeconfig and not report.events:
            problems.append("--kubeconfig is only used with --events")
        if self.init_source() is None:
            problems.append("no rekindle-init binary found (build it with `make`, or pass --init-binary)")
        return problems

    def check(self) -> None:
        problems = self.validate()
        if problems:
            raise ConfigError("invalid settings:\n  " + "\n  ".join(problems))


_GROUPS: dict[str, type] = {"restore": RestoreSettings, "cache": CacheSettings, "checkpoint": CheckpointSettings,
                            "probes": ProbeSettings, "report": ReportSettings}
