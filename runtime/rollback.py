"""Rollback protection: the newest generation of each artifact name this node has restored.

Every publish of a name gets a larger generation (``runtime.store.volume``), recorded in the signed
manifest. Anyone who can write the store can point a name back at an older, still validly
signed version; a node refuses to restore a generation older than the newest it has restored
for that name. One small file per name under ``<state>/generations/<namespace>/<name>``.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from runtime.errors import ArtifactRejected


class GenerationBook:
    _lock = threading.Lock()  # concurrent restores of one name must not lower the record

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir) / "generations"

    def newest(self, namespace: str, name: str) -> int:
        try:
            return int((self.root / namespace / name).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def check(self, namespace: str, name: str, generation: int) -> None:
        newest = self.newest(namespace, name)
        if generation < newest:
            raise ArtifactRejected(f"{namespace}/{name}", f"generation {generation} is older than "
                                   f"generation {newest} this node already restored (rollback)")

    def record(self, namespace: str, name: str, generation: int) -> None:
        with self._lock:
            if generation <= self.newest(namespace, name):
                return
            d = self.root / namespace
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = d / f".{name}.{secrets.token_hex(4)}"
            tmp.write_text(f"{generation}\n")
            os.replace(tmp, d / name)
