"""Turn NRI on in a containerd config file, keeping everything else as it was.

Contract:
- :func:`enable_nri` is a pure transform of config text: it sets, in the NRI plugin table
  (``[plugins."io.containerd.nri.v1.nri"]``, the same URI for config v2 and v3),
  ``disable = false``, ``disable_connections = false`` and ``socket_path``, and fills the other
  NRI keys with containerd's defaults only where absent. Comments, order and every other
  setting are kept (tomlkit). Returns ``(new_text, changed)``; running it on its own output
  changes nothing.
- Config versions follow containerd's rules: ``version = 2`` (containerd 1.x), ``version = 3``
  (2.0 - 2.2) and ``version = 4`` (2.3 on, whose servers moved into plugins; the NRI table is
  where v3 has it) are handled; a missing ``version`` means 1 unless the file is empty, and
  version 1 is refused (:class:`~runtime.errors.ConfigError`, asking to migrate first).
- :func:`apply` is read -> transform -> write: the file is backed up to
  ``<path>.rekindle-backup-<UTC timestamp>`` and replaced atomically, only when something
  changes; an absent file is created with minimal content for the installed containerd. The
  path is a node path seen through a :class:`~nri_plugin.node.host.HostView`; k3s and RKE2 nodes
  are refused. The drop-in alternative is :mod:`nri_plugin.node.dropin`, the command line
  ``rekindle nri-toggle`` is :mod:`nri_plugin.node.toggle`.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomlkit
import tomlkit.exceptions
from tomlkit.items import Table

from nri_plugin.node.host import HostView, check_not_managed
from runtime.containerd.defaults import DEFAULT_CONFIG, DEFAULT_SOCKET, NRI_PLUGIN
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = (2, 3, 4)

# containerd's NRI defaults (nri 0.6.1 .. 0.8), written only where the file has no value.
NRI_DEFAULTS = {
    "plugin_path": "/opt/nri/plugins",
    "plugin_config_path": "/etc/nri/conf.d",
    "plugin_registration_timeout": "5s",
    "plugin_request_timeout": "2s",
}


@dataclass(frozen=True)
class ToggleResult:
    path: Path
    version: int
    changed: bool
    restart_needed: bool
    backup_path: Path | None
    created: bool = False
    diff: str = ""


def _parse(text: str, source: str = "config") -> tomlkit.TOMLDocument:
    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None


def _is_blank(doc: tomlkit.TOMLDocument) -> bool:
    return all(k is None for k, _ in doc.body)


def config_version(doc: tomlkit.TOMLDocument) -> int:
    """The config version containerd would see (a missing key means 1)."""
    v = doc.get("version", 1)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"containerd config: version must be an integer, got {v!r}")
    return int(v)


def minimal_config(version: int) -> str:
    """A minimal valid config of the given version (what an absent file is created from)."""
    return f"version = {version}\n"


def enable_nri(text: str, socket_path: str = DEFAULT_SOCKET, *, empty_version: int = 2) -> tuple[str, bool]:
    """Return (text with NRI on, whether anything changed). See the module docstring."""
    doc = _parse(text)
    if _is_blank(doc):  # empty or comments only: containerd runs on defaults
        doc.add("version", empty_version)
    version = config_version(doc)
    if version == 1:
        raise ConfigError("containerd config version 1 (no 'version' key, or version = 1) is not supported: "
                          "migrate it first with `containerd config migrate` (containerd >= 1.7)")
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(f"containerd config version {version} is not supported (know {SUPPORTED_VERSIONS})")

    plugins = doc.get("plugins")
    if plugins is None:
        plugins = tomlkit.table(is_super_table=True)
        doc.add("plugins", plugins)
    elif not isinstance(plugins, (Table, dict)):
        raise ConfigError("containerd config: 'plugins' is not a table")
    nri = plugins.get(NRI_PLUGIN)
    if nri is None:
        nri = tomlkit.table()
        plugins[NRI_PLUGIN] = nri
    elif not isinstance(nri, (Table, dict)):
        raise ConfigError(f"containerd config: plugins.{NRI_PLUGIN} is not a table")

    wanted = {"disable": False, "disable_connections": False, "socket_path": socket_path}
    for key, value in wanted.items():
        current = nri.get(key)
        if current is not None and hasattr(current, "unwrap"):
            current = current.unwrap()
        if current != value or type(current) is not type(value):  # 0 == False must not pass
            nri[key] = value
    for key, value in NRI_DEFAULTS.items():
        if key not in nri:
            nri[key] = value
    new_text = tomlkit.dumps(doc)
    return new_text, new_text != text


def _installed_config_version(containerd: str = "containerd") -> int:
    """What `containerd config default` of the installed containerd writes: 4 from 2.3 on, 3 for
    2.0 - 2.2, else 2."""
    try:
        out = subprocess.run([containerd, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 2
    m = re.search(r"\s v?(\d+)\.(\d+)", out)
    if not m or int(m.group(1)) < 2:
        return 2
    return 4 if (int(m.group(1)), int(m.group(2))) >= (2, 3) else 3


def _write_atomic(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _backup(path: Path) -> Path:
    """Copy path to <path>.rekindle-backup-<UTC timestamp> (metadata kept) and return the copy."""
    backup = path.with_name(f"{path.name}.rekindle-backup-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    shutil.copy2(path, backup)
    return backup


def apply(path: Path | str = DEFAULT_CONFIG, socket_path: str = DEFAULT_SOCKET, dry_run: bool = False,
          *, new_file_version: int | None = None, view: HostView = HostView()) -> ToggleResult:
    """Enable NRI in the config file at path (read -> enable_nri -> backup + write when changed).

    path is a node path, opened through view; k3s and RKE2 nodes are refused."""
    check_not_managed(view, socket_path)
    host = Path(path)
    path = view.see(str(path))
    created = not path.exists()
    if created:
        old, mode = "", 0o644
    else:
        try:
            old = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read {host}: {e}") from None
        mode = path.stat().st_mode & 0o7777
    try:
        blank = _is_blank(_parse(old))
        version = (new_file_version or _installed_config_version()) if blank else 0
        new, changed = enable_nri(minimal_config(version) if created else old, socket_path, empty_version=version)
    except ConfigError as e:
        raise ConfigError(f"{host}: {e}") from None
    changed = changed or created
    final_version = config_version(_parse(new))
    diff = "".join(difflib.unified_diff(
        [] if created else old.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile=str(host) if not created else "/dev/null", tofile=str(host)))
    backup = None
    if changed and not dry_run:
        if not created:
            backup = Path(view.host_path(_backup(path)))
        _write_atomic(path, new, mode)
        log.info("enabled NRI in %s (socket %s)%s", host, socket_path, f", backup {backup}" if backup else "")
    return ToggleResult(path=host, version=final_version, changed=changed, restart_needed=changed and not dry_run,
                        backup_path=backup, created=created, diff=diff)
