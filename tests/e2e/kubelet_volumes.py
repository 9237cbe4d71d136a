"""Secret and ConfigMap volumes laid out exactly as kubelet lays them out.

kubelet's AtomicWriter (kubernetes pkg/volume/util/atomic_writer.go) never puts a Secret's items
in the volume directory itself:

    <dir>/..2025_01_02_03_04_05.123456789/<item>   the real files, mode defaultMode (kubelet: 0644)
    <dir>/..data -> ..2025_01_02_03_04_05.123456789
    <dir>/<item> -> ..data/<item>                   (one link per first path component)

An update writes a new timestamped directory, points ``..data_tmp`` at it, renames that over
``..data`` (the atomic step) and removes the old directory. :func:`project` does the same, so a
test can both mount a fresh volume and rotate one under a running reader.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

DATA = "..data"
KUBELET_DEFAULT_MODE = 0o644  # a Secret volume's defaultMode when the pod spec sets none


def _timestamp_dir(volume: Path) -> Path:
    # Go's MkdirTemp(dir, "..2006_01_02_15_04_05.") appends a random number
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
    while True:
        ts = volume / f"{stamp}{secrets.randbelow(10**9)}"
        try:
            ts.mkdir(mode=0o700)
        except FileExistsError:
            continue
        ts.chmod(0o755)  # as kubelet does, whatever the umask
        return ts


def project(volume: Path, items: Mapping[str, bytes], mode: int = KUBELET_DEFAULT_MODE) -> Path:
    """Write ``items`` (relative path -> content) into ``volume`` as kubelet does; return the
    timestamped directory holding the real files. ``volume`` must exist."""
    for rel in items:
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or parts[0].startswith(".."):
            raise ValueError(f"kubelet refuses item path {rel!r}")
    try:
        old = os.readlink(volume / DATA)
    except FileNotFoundError:
        old = None
    ts = _timestamp_dir(volume)
    for rel, content in items.items():
        f = ts / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(content)
        f.chmod(mode)
    for first in sorted({rel.split("/")[0] for rel in items}):
        link = volume / first
        if not link.is_symlink():
            link.symlink_to(f"{DATA}/{first}")
    tmp = volume / "..data_tmp"
    tmp.symlink_to(ts.name)
    os.rename(tmp, volume / DATA)
    if old is not None:
        shutil.rmtree(volume / old)
    return ts
