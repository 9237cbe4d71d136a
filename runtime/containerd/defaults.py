"""Where containerd and its NRI live on a node unless told otherwise: the one set of defaults the
engine's checks (``runtime.doctor``), the plugin and the node set-up (``nri_plugin.node``) share."""

from __future__ import annotations

from pathlib import Path

DEFAULT_CONFIG = Path("/etc/containerd/config.toml")
DEFAULT_SOCKET = "/var/run/nri/nri.sock"  # NRI's socket: the one default every part of Rekindle uses
NRI_PLUGIN = "io.containerd.nri.v1.nri"  # NRI's section in containerd's config
