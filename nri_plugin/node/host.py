"""The node's filesystem as the NRI toggle sees it, and containerd installs it must not touch.

Contract:
- :class:`HostView` maps a path on the node (absolute, as containerd sees it) to where this
  process can open it: ``root`` is ``/`` on the node itself, and ``/proc/1/root`` in a privileged
  pod with the host's pid namespace (the chart's init container), which needs no hostPath mount
  and creates nothing on the node. :meth:`HostView.host_path` maps back.
- :meth:`HostView.check` fails with a ConfigError when the view cannot be read (``/proc/1/root``
  needs a privileged process in the host's pid namespace).
- :func:`check_not_managed` raises :class:`~runtime.errors.ManagedContainerd` on k3s and RKE2
  nodes: their agents write containerd's config from a template at every start and ignore
  ``/etc/containerd``, so the toggle must not write anything there; the message says what to do
  instead. A node is k3s or RKE2 when the agent's containerd config dir exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from runtime.errors import ConfigError, ManagedContainerd


@dataclass(frozen=True)
class HostView:
    root: Path = Path("/")

    def see(self, host_path: PurePosixPath | str) -> Path:
        """Where this process opens the node's ``host_path``."""
        p = PurePosixPath(host_path)
        if not p.is_absolute():
            if self.root == Path("/"):
                return Path(p)
            raise ConfigError(f"{p}: a node path must be absolute when the node is seen through {self.root}")
        return self.root / p.relative_to("/")

    def check(self) -> None:
        """Raise ConfigError unless the node's root can be read through this view."""
        try:
            os.listdir(self.root)
        except OSError as e:
            raise ConfigError(f"cannot read the node's files through {self.root}: {e.strerror} (from a pod, "
                              "run privileged and in the host's PID namespace)") from None

    def host_path(self, seen: Path | str) -> PurePosixPath:
        """The node path of a path this process opened through :meth:`see`."""
        rel = os.path.relpath(os.path.abspath(seen), os.path.abspath(self.root))
        if rel == ".":
            return PurePosixPath("/")
        if rel.startswith(".."):
            raise ConfigError(f"{seen} is outside the node's root {self.root}")
        return PurePosixPath("/") / rel


@dataclass(frozen=True)
class _Managed:
    name: str
    config_dir: str
    restart: str  # how to restart its containerd, server then agent


MANAGED = (
    _Managed("k3s", "/var/lib/rancher/k3s/agent/etc/containerd",
             "systemctl restart k3s (k3s-agent on agent nodes)"),
    _Managed("RKE2", "/var/lib/rancher/rke2/agent/etc/containerd",
             "systemctl restart rke2-server (rke2-agent on agent nodes)"),
)


def managed_by(view: HostView) -> _Managed | None:
    for m in MANAGED:
        if view.see(m.config_dir).is_dir():
            return m
    return None


def advice(m: _Managed, socket_path: str) -> str:
    return (
        f"this node's containerd is run by {m.name}, which writes {m.config_dir}/config.toml from a template "
        f"at every start and does not read /etc/containerd: Rekindle will not edit it. Turn NRI on in "
        f"{m.config_dir}/config.toml.tmpl (config-v3.toml.tmpl where {m.name} runs containerd 2.x, which has "
        f"NRI on by default): first line {{{{ template \"base\" . }}}}, then "
        f"[plugins.\"io.containerd.nri.v1.nri\"] with disable = false, disable_connections = false and "
        f"socket_path = \"{socket_path}\"; restart one node at a time ({m.restart}); install the chart with "
        f"nri.patchConfig=false")


def check_not_managed(view: HostView, socket_path: str) -> None:
    view.check()
    m = managed_by(view)
    if m is not None:
        raise ManagedContainerd(m.name, m.config_dir, advice(m, socket_path))
