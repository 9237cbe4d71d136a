"""Image ids by image name for the CreateContainer pre-check, kept a few seconds.

The pre-check of a restore compares the artifact's image id (content digest) with the one
containerd resolves the target's image name to. Asked for every pod, that is one CRI
ImageStatus round trip inside the handler each, to a containerd busy creating those very pods
(50 restores created at once on 2 cores: p99 138 ms of the handler's budget). ``ImageIds`` keeps
an id it found for ``ttl`` seconds. Only the pre-check uses it: a tag re-pointed within ``ttl``
can at worst make the pre-check wrong, and both ways are safe (a false mismatch starts the pod
cold; a false match is refused by the restore, which looks the id up afresh before CRIU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ImageIds:
    def __init__(self, lookup: Callable[[str], str], ttl: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._known: dict[str, tuple[float, str]] = {}

    def __call__(self, image: str) -> str:
        now = self._clock()
        with self._lock:
            hit = self._known.get(image)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        found = self._lookup(image)
        if found:  # an unknown id is asked again next time
            with self._lock:
                self._known[image] = (now, found)
                for name in [n for n, (t, _) in self._known.items() if now - t >= self._ttl]:
                    del self._known[name]
        return found
