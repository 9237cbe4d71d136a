"""What every restore bench's ``main`` does once its arguments are parsed."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from bench.common import model


def add_rig_arguments(ap: argparse.ArgumentParser, out_dir: str, warm_help: str) -> None:
    """The restore rig's arguments (``bench.common.restore_rig``): the model, the plugin's work
    dir, where the results go, and how long to wait for a cold start and a warm one."""
    ap.add_argument("--model-dir", type=Path, default=model.DEFAULT_DIR)
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--work", type=Path, default=None, help="plugin state + store (default: disk if room)")
    ap.add_argument("--out-dir", type=Path, default=Path(out_dir))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cold-timeout", type=float, default=400.0)
    ap.add_argument("--warm-timeout", type=float, default=300.0, help=warm_help)


def prepare(args: argparse.Namespace, prog: str, json_name: str) -> bool:
    """Logging on, ``--out-dir`` made, ``--json`` defaulted into it, and a SIGTERM (a hack/
    script's timeout) turned into an exit, so the pods, the plugin and the sandbox the bench
    started are still cleaned up. False (and why, on stderr) when not root: containerd and CRIU
    need it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.json = args.json or args.out_dir / json_name
    if os.geteuid() != 0:
        print(f"{prog}: run as root (containerd, CRIU)", file=sys.stderr)
        return False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return True
