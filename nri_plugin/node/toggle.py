"""``rekindle nri-toggle``: turn NRI on in containerd's config, in place or through a drop-in.

Contract:
- In place (default): :func:`nri_plugin.node.containerd_config.apply` edits ``--config`` itself.
- ``--drop-in [PATH]``: :func:`nri_plugin.node.dropin.apply_drop_in` writes PATH (default
  ``<config dir>/conf.d/99-rekindle-nri.toml``) and imports it from ``--config``.
- ``--host-root DIR``: every path is a node path, opened under DIR (``/proc/1/root`` in a
  privileged pod with the host's pid namespace). k3s and RKE2 nodes are refused with advice.
- ``--json`` prints one object: ``mode, path, drop_in, version, changed, restart_needed, backup,
  backups, import_added, nri_live`` (``nri_live``: a socket is at ``--socket-path`` now, so NRI
  is serving there and a restart is not needed to reach it).
- Exit 0 on success, 1 when the config cannot be changed (the reason on stderr), 2 on a usage
  error.
"""

from __future__ import annotations

import argparse
import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from nri_plugin.node import containerd_config, dropin
from nri_plugin.node.host import HostView
from runtime.containerd import defaults
from runtime.errors import ConfigError


def nri_live(view: HostView, socket_path: str) -> bool:
    try:
        return stat.S_ISSOCK(view.see(socket_path).stat().st_mode)
    except (OSError, ConfigError):
        return False


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rekindle nri-toggle",
                                 description="Enable NRI in containerd's config (keeps every other setting).")
    ap.add_argument("--config", default=str(defaults.DEFAULT_CONFIG),
                    help="containerd's main config file (default: %(default)s)")
    ap.add_argument("--socket-path", default=defaults.DEFAULT_SOCKET, help="NRI socket (default: %(default)s)")
    ap.add_argument("--drop-in", nargs="?", const="", default=None, metavar="PATH",
                    help="write NRI's table to a drop-in file imported by --config instead of editing --config "
                         f"(default PATH: <config dir>/conf.d/{dropin.DROP_IN_NAME})")
    ap.add_argument("--host-root", default="/",
                    help="where the node's filesystem is seen (e.g. /proc/1/root from a pod); default %(default)s")
    ap.add_argument("--dry-run", action="store_true", help="show the change, write nothing")
    ap.add_argument("--restart", action="store_true", help="systemctl restart containerd when a file changed")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text",
                    help="json: print the outcome as one JSON object")
    ap.add_argument("--json", dest="output", action="store_const", const="json", help="same as -o json")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    view = HostView(Path(args.host_root))
    if args.restart and view.root != Path("/"):
        ap.error("--restart works on the node itself only (without --host-root)")
    try:
        if args.drop_in is None:
            res = containerd_config.apply(args.config, args.socket_path, dry_run=args.dry_run, view=view)
            out: dict[str, Any] = {"mode": "in-place", "path": str(res.path), "drop_in": None, "version": res.version,
                   "changed": res.changed, "restart_needed": res.restart_needed,
                   "backups": [str(res.backup_path)] if res.backup_path else [], "import_added": False}
            diff = res.diff
        else:
            dres = dropin.apply_drop_in(args.config, args.drop_in or None, args.socket_path, dry_run=args.dry_run,
                                            view=view)
            out = {"mode": "drop-in", "path": str(dres.config), "drop_in": str(dres.drop_in),
                   "version": dres.version, "changed": dres.changed, "restart_needed": dres.restart_needed,
                   "backups": [str(b) for b in dres.backups], "import_added": dres.import_added}
            diff = dres.diff
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a write refused on the node: say which file, no traceback
        print(f"error: {e.filename or args.config}: {e.strerror}", file=sys.stderr)
        return 1
    out["backup"] = out["backups"][0] if out["backups"] else None
    out["nri_live"] = nri_live(view, args.socket_path)
    if args.output == "json":
        print(json.dumps(out))
        return 0
    where = out["drop_in"] or out["path"]
    if args.dry_run:
        print(diff if out["changed"] else f"{where}: NRI already enabled; nothing to do", end="" if out["changed"] else "\n")
        return 0
    if not out["changed"]:
        print(f"{where}: NRI already enabled (config version {out['version']}); nothing changed")
        return 0
    print(f"{where}: NRI enabled (config version {out['version']})"
          + (f"; imported from {out['path']}" if out["import_added"] else "")
          + (f"; backup at {', '.join(out['backups'])}" if out["backups"] else "; file created"))
    if args.restart and out["restart_needed"]:
        r = subprocess.run(["systemctl", "restart", "containerd"], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"error: systemctl restart containerd failed: {r.stderr.strip()}", file=sys.stderr)
            return 1
        print("containerd restarted")
    elif out["restart_needed"]:
        print("restart containerd for the change to take effect (or pass --restart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
