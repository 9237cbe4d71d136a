"""The plugin's settings: one dataclass, every field defaulted, ``validate()`` lists every problem.

Settings come from CLI flags (the DaemonSet passes them); a bad setting stops the plugin at
start-up with all problems listed at once, while a bad annotation only affects its own pod.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.containerd.defaults import DEFAULT_CONFIG, DEFAULT_SOCKET
from runtime.errors import ConfigError

from .policy import parse_decimal

DEFAULT_STATE_DIR = "/var/lib/rekindle"


def _default_init_candidates() -> list[str]:
    here = Path(__file__).resolve().parent.parent
    return [
        os.environ.get("REKINDLE_INIT", ""),
        "/usr/local/lib/rekindle/rekindle-init",
        str(here / "build" / "rekindle-init"),
    ]


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
    restore_timeout: int = 1800     # default of the rekindle.dev/restore-timeout annotation
    restore_path: str = "auto"      # auto (runtime.route decides), stream (served while it runs), bulk (filled beside CRIU first) or stock (CRIU restores all)
    prefetch: bool = True           # read a restore's artifact ahead from RunPodSandbox on
    max_layer_bytes: int = 8 << 30  # cap on a captured writable layer (and on one applied)
    bulk_min_run: int = 4096        # page runs at least this long move beside CRIU at a checkpoint
    fill_threads: int = 0           # threads filling bulk pages at a restore; 0: one per core, up to 16 (stream: 12)
    cuda_parallel: int = 0          # CUDA driver sequences at once (runtime.gpu.cuda); 0: as max_parallel
    cache_dir: str = ""             # the node cache (runtime.pages.nodecache); "": <state_dir>/cache
    cache_bytes: int = -1           # its byte bound; 0: no cache; -1: a quarter of the node's memory
    cache_entries: int = 8          # its entry bound
    cache_tmpfs: bool = False       # mount a huge=always tmpfs there (in the plugin's mount namespace)
    map_ranges: str = "driver"      # what a restore from the cache maps: driver, all or none (runtime.pages.mapping)
    prewarm: tuple[str, ...] = ()   # namespace/name of artifacts whose cache entry is written as published
    prewarm_interval: float = 30.0  # seconds between looks at the marked names (nri_plugin.prewarm); 0: none
    capture_timeout: int = 600      # seconds a checkpoint may spend capturing the writable layer
    checkpoint_thp: str = "keep"    # keep, or always: the node's THP mode during a CUDA checkpoint (runtime.thp)
    probes_per_pod: int = 1         # ready-probes of one pod at once (its checkpoint sources)
    probes_per_node: int = 16       # ready-probes of the whole node at once
    metrics_port: int = 9464        # /metrics, /readyz, /healthz; 0: no HTTP endpoint at all
    metrics_address: str = "0.0.0.0"
    events: bool = False            # report outcomes to Kubernetes (Events, pod condition)
    kubeconfig: str = ""            # with events: a kubeconfig file instead of the service account
    node_name: str = ""             # the Kubernetes node (the chart: $NODE_NAME from spec.nodeName)
    containerd_config: str = str(DEFAULT_CONFIG)  # read by `rekindle doctor` only

    @property
    def key_path(self) -> Path:
        return Path(self.hmac_key_file or os.path.join(self.state_dir, "hmac.key"))

    @property
    def thp_record(self) -> str:
        """The THP mode found before a CUDA checkpoint switched it (runtime.thp)."""
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
        problems = []
        if len(self.idx) != 2 or parse_decimal(self.idx) is None:
            problems.append(f"--idx must be two digits, got {self.idx!r}")
        if not self.name or not all(c.isalnum() or c in "_.+-" for c in self.name):
            problems.append(f"--name must match [a-zA-Z0-9_.+-]+, got {self.name!r}")
        for label, path in (("--state-dir", self.state_dir), ("--store", self.store),
                            ("--containerd-state", self.containerd_state)):
            if not os.path.isabs(path):
                problems.append(f"{label} must be an absolute path, got {path!r}")
        if not 1 <= self.restore_timeout <= 86400:
            problems.append(f"--restore-timeout must be 1..86400 seconds, got {self.restore_timeout}")
        if not 0 <= self.cuda_parallel <= 64:
            problems.append(f"--cuda-parallel must be 0..64 (0: as --max-parallel), got {self.cuda_parallel}")
        if self.checkpoint_thp not in ("keep", "always"):
            problems.append(f"--checkpoint-thp must be keep or always, got {self.checkpoint_thp!r}")
        if self.map_ranges not in ("driver", "all", "none"):
            problems.append(f"--map-ranges must be driver, all or none, got {self.map_ranges!r}")
        if self.cache_bytes < -1 or not 1 <= self.cache_entries <= 1024:
            problems.append("--cache-bytes must be -1 or more and --cache-entries 1..1024")
        from .prewarm_state import parse_names
        try:
            parse_names(self.prewarm)
        except ValueError as exc:
            problems.append(f"--prewarm: {exc}")
        if not (self.prewarm_interval == 0 or 1 <= self.prewarm_interval <= 86400):
            problems.append(f"--prewarm-interval must be 0 (off) or 1..86400 seconds, got {self.prewarm_interval}")
        if not 0 <= self.fill_threads <= 1024:
            problems.append(f"--fill-threads must be 0..1024 (0: one per core, up to 16), got {self.fill_threads}")
        if self.restore_path not in ("auto", "bulk", "stock", "stream"):
            problems.append(f"--restore-path must be auto, bulk, stock or stream, got {self.restore_path!r}")
        for label, value in (("--max-probes-per-pod", self.probes_per_pod), ("--max-probes", self.probes_per_node)):
            if not 1 <= value <= 1024:
                problems.append(f"{label} must be 1..1024, got {value}")
        if not 0 <= self.metrics_port <= 65535:
            problems.append(f"--metrics-port must be 0..65535 (0: off), got {self.metrics_port}")
        if self.events and not self.node_name:
            problems.append("--events needs the node's name: --node-name or $NODE_NAME "
                            "(the chart sets it from spec.nodeName)")
        if self.kubeconfig and not self.events:
            problems.append("--kubeconfig is only used with --events")
        if self.init_source() is None:
            problems.append("no rekindle-init binary found (build it with `make`, or pass --init-binary)")
        return problems

    def check(self) -> None:
        problems = self.validate()
        if problems:
            raise ConfigError("invalid settings:\n  " + "\n  ".join(problems))
