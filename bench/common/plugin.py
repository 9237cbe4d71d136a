"""The plugin's side of a restore bench: the engine's figures for a restore, the plugin
restarted with a run's settings, its node cache's entries."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from bench.common.workload import CONTAINER
from devtools.cri import Pod
from runtime import control

CACHE_DIR = Path("cache") / "v1"  # under the plugin's state dir: one directory per entry


def read_timings(plugin: Any, pod: Pod) -> dict[str, Any] | None:
    """The engine's figures for the pod's restore (control dir's timings.json), None before it wrote them."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((Path(plugin.control_dir(pod.uid, CONTAINER)) / control.TIMINGS).read_text())
        return doc if isinstance(doc, dict) else None
    return None


def restart_plugin(plugin: Any, env: dict[str, str]) -> None:
    """Stop the plugin and start it again with ``env``, back once it synchronized with containerd."""
    plugin.stop()
    plugin.env = env
    plugin.start(wait=False)
    plugin.wait_log("synchronized:", count=plugin.log().count("synchronized:") + 1, timeout=60)


def cache_dir(plugin: Any) -> Path:
    """The plugin's node cache (in its state dir)."""
    return Path(plugin.state_dir) / CACHE_DIR


def cache_entries(plugin: Any) -> list[Path]:
    """The node cache's complete entries (those with an ``entry.json``), by name."""
    return sorted(p.parent for p in cache_dir(plugin).glob("*/entry.json"))
