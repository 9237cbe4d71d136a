"""Turn NRI on with a drop-in file that containerd's main config imports.

The main config often belongs to someone else (the distribution, the GPU Operator's toolkit,
node tooling); a drop-in keeps Rekindle's change in a file of its own, as the NVIDIA container
toolkit does with ``/etc/containerd/conf.d/99-nvidia.toml``.

Contract (:func:`apply_drop_in`):
- Refuses k3s and RKE2 nodes (:func:`nri_plugin.node.host.check_not_managed`), a version-1 or
  unknown config version, and a file imported AFTER the drop-in that has an NRI table of its own
  (it would override ours).
- Writes the drop-in (same config version as the main config: containerd refuses an import of a
  higher version) with the NRI table of :func:`nri_plugin.node.containerd_config.enable_nri`, seeded with every
  NRI key the main config and the files imported before the drop-in already set. containerd 1.7
  replaces a plugin's whole table with an imported one (2.x merges key by key), so the drop-in
  carries the operator's other NRI settings along.
- Adds the drop-in's own path to the main config's ``imports`` only when no entry covers it
  already (an exact path, or a glob such as ``conf.d/*.toml``); everything else in the main
  config is kept byte for byte. An absent main config is created with a version and the import.
- A file it changes is first copied to ``<file>.rekindle-backup-<UTC timestamp>``; writes are
  atomic; nothing is written when nothing changes or with ``dry_run``.
- Paths are node paths, opened through a :class:`~nri_plugin.node.host.HostView`. Only the main
  config's own ``imports`` are followed (not imports of imported files).
"""

from __future__ import annotations

import difflib
import glob
import logging
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import tomlkit
from tomlkit.items import Table

from nri_plugin.node import containerd_config
from nri_plugin.node.host import HostView, check_not_managed
from runtime.containerd import defaults
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

DROP_IN_NAME = "99-rekindle-nri.toml"
HEADER = (
    "Written by `rekindle nri-toggle`: turns containerd's NRI on for the Rekindle plugin.",
    "Imported by {config} (its `imports`). To revert: delete this file and that imports entry,",
    "then restart containerd.",
)
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class DropInResult:
    config: PurePosixPath
    drop_in: PurePosixPath
    version: int
    changed: bool  # the drop-in or the main config changed (or would, with dry_run)
    restart_needed: bool  # changed and written: containerd reads its config only at start
    import_added: bool
    config_created: bool
    backups: tuple[PurePosixPath, ...]
    diff: str


def default_drop_in(config: PurePosixPath | str) -> PurePosixPath:
    return PurePosixPath(config).parent / "conf.d" / DROP_IN_NAME


def _imports(doc: tomlkit.TOMLDocument, where: str) -> list[str]:
    raw = doc.get("imports", [])
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise ConfigError(f"{where}: 'imports' must be a list of strings")
    return [str(s) for s in raw]


def _resolve(entry: str, config: PurePosixPath) -> PurePosixPath:
    """An imports entry as containerd resolves it: relative to the main config's directory."""
    p = PurePosixPath(entry)
    return p if p.is_absolute() else config.parent / p


def _is_glob(p: PurePosixPath) -> bool:
    return bool(_GLOB_CHARS & set(str(p)))


def _matches(pattern: PurePosixPath, path: PurePosixPath) -> bool:
    # Go's filepath.Match: '*' never crosses '/'; PurePath.match with an absolute pattern is whole-path.
    return len(pattern.parts) == len(path.parts) and path.match(str(pattern))


def covered(imports: list[PurePosixPath], drop_in: PurePosixPath) -> bool:
    return any(p == drop_in or (_is_glob(p) and _matches(p, drop_in)) for p in imports)


def import_order(view: HostView, imports: list[PurePosixPath], drop_in: PurePosixPath) -> list[PurePosixPath]:
    """The files containerd loads after the main config, in order, once the drop-in exists."""
    order: list[PurePosixPath] = []
    for entry in imports:
        if _is_glob(entry):
            found = {view.host_path(s) for s in glob.glob(str(view.see(entry)))}
            if _matches(entry, drop_in):
                found.add(drop_in)
            files = sorted(found, key=str)
        else:
            files = [entry]
        order.extend(f for f in files if f not in order)
    return order


def _nri_table(doc: tomlkit.TOMLDocument, where: str) -> dict[str, Any] | None:
    plugins = doc.get("plugins")
    if plugins is None:
        return None
    if not isinstance(plugins, (Table, dict)):
        raise ConfigError(f"{where}: 'plugins' is not a table")
    nri = plugins.get(defaults.NRI_PLUGIN)
    if nri is None:
        return None
    if not isinstance(nri, (Table, dict)):
        raise ConfigError(f"{where}: plugins.{defaults.NRI_PLUGIN} is not a table")
    return dict(nri.unwrap() if hasattr(nri, "unwrap") else nri)


def _read(view: HostView, path: PurePosixPath) -> str | None:
    seen = view.see(path)
    try:
        return seen.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def drop_in_text(version: int, seed: dict[str, Any], socket_path: str, config: PurePosixPath) -> str:
    doc = tomlkit.document()
    for line in HEADER:
        doc.add(tomlkit.comment(line.format(config=config)))
    doc.add("version", version)
    if seed:
        plugins = tomlkit.table(is_super_table=True)
        nri = tomlkit.table()
        for key, value in seed.items():
            nri[key] = value
        plugins.add(defaults.NRI_PLUGIN, nri)
        doc.add("plugins", plugins)
    text, _ = containerd_config.enable_nri(tomlkit.dumps(doc), socket_path)
    return text


def _diff(old: str | None, new: str, path: PurePosixPath) -> str:
    return "".join(difflib.unified_diff(
        (old or "").splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile="/dev/null" if old is None else str(path), tofile=str(path)))


def apply_drop_in(config: PurePath | str = defaults.DEFAULT_CONFIG, drop_in: PurePath | str | None = None,
                  socket_path: str = defaults.DEFAULT_SOCKET, dry_run: bool = False, *,
                  view: HostView = HostView(), new_file_version: int | None = None) -> DropInResult:
    """Enable NRI through a drop-in (see the module docstring)."""
    config = PurePosixPath(config)
    drop = PurePosixPath(drop_in) if drop_in else default_drop_in(config)
    if view.root != Path("/") and not (config.is_absolute() and drop.is_absolute()):
        raise ConfigError("--config and --drop-in must be absolute node paths")
    check_not_managed(view, socket_path)

    old_main = _read(view, config)
    created = old_main is None
    main_doc = containerd_config._parse(old_main or "", str(config))
    if containerd_config._is_blank(main_doc):
        main_doc.add("version", new_file_version or containerd_config._installed_config_version())
    version = containerd_config.config_version(main_doc)
    if version not in containerd_config.SUPPORTED_VERSIONS:
        raise ConfigError(f"{config}: config version {version} is not supported"
                          + (": migrate it first with `containerd config migrate`" if version == 1 else ""))

    imports = [_resolve(e, config) for e in _imports(main_doc, str(config))]
    import_added = not covered(imports, drop)
    if import_added:
        entries = main_doc.get("imports")
        if entries is None:
            main_doc["imports"] = [str(drop)]
        else:
            entries.append(str(drop))
        imports.append(drop)

    order = import_order(view, imports, drop)
    at = order.index(drop)
    seed = _nri_table(main_doc, str(config)) or {}
    for path in order[:at]:
        text = _read(view, path)
        if text is not None:
            seed.update(_nri_table(containerd_config._parse(text, str(path)), str(path)) or {})
    for path in order[at + 1:]:
        text = _read(view, path)
        if text is not None and _nri_table(containerd_config._parse(text, str(path)), str(path)) is not None:
            raise ConfigError(f"{path} is imported after {drop} and has its own "
                              f"[plugins.\"{defaults.NRI_PLUGIN}\"] table, which would override Rekindle's: "
                              f"merge its NRI settings into {config} or remove them there, then run again")

    new_drop = drop_in_text(version, seed, socket_path, config)
    old_drop = _read(view, drop)
    new_main = tomlkit.dumps(main_doc) if (import_added or created) else old_main
    changes = [(p, old, new) for p, old, new in ((drop, old_drop, new_drop), (config, old_main, new_main))
               if new is not None and new != old]
    backups: list[PurePosixPath] = []
    if changes and not dry_run:
        # The drop-in first: the main config never names a file that is not there yet.
        for path, old, new in changes:
            seen = view.see(path)
            mode = seen.stat().st_mode & 0o7777 if old is not None else 0o644
            if old is not None:
                backups.append(view.host_path(containerd_config._backup(seen)))
            containerd_config._write_atomic(seen, new, mode)
        log.info("enabled NRI with drop-in %s (socket %s)%s", drop, socket_path,
                 f"; imported from {config}" if import_added else "")
    return DropInResult(config=config, drop_in=drop, version=version, changed=bool(changes),
                        restart_needed=bool(changes) and not dry_run, import_added=import_added,
                        config_created=created, backups=tuple(backups),
                        diff="".join(_diff(old, new, p) for p, old, new in changes))
