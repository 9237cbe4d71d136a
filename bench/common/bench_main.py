"""What every restore bench's ``main`` does once its arguments are parsed."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


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
