"""How many ready-probes run at once: at most ``per_pod`` for one pod, ``per_node`` in all.

A probe targets something a tenant controls, so one tenant's slow targets must not take every
probe slot, nor anything else: a probe over a cap waits on the event loop for its turn
(asyncio semaphores, first come first served) and holds no thread while it waits. The pod's
slot is taken before the node's, so a pod waiting for itself never keeps a node slot from
another pod. Each container's own probes are sequential already (one wait-ready loop each).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

DEFAULT_PER_POD = 1
DEFAULT_PER_NODE = 16


class ProbeSlots:
    def __init__(self, per_pod: int = DEFAULT_PER_POD, per_node: int = DEFAULT_PER_NODE) -> None:
        if per_pod < 1 or per_node < 1:
            raise ValueError("probe caps must be at least 1")
        self.per_pod = per_pod
        self._node = asyncio.Semaphore(per_node)
        self._pods: dict[str, tuple[asyncio.Semaphore, int]] = {}  # pod uid -> (slots, users)

    @asynccontextmanager
    async def slot(self, pod_uid: str) -> AsyncIterator[None]:
        sem, users = self._pods.get(pod_uid) or (asyncio.Semaphore(self.per_pod), 0)
        self._pods[pod_uid] = (sem, users + 1)
        try:
            async with sem, self._node:
                yield
        finally:
            sem, users = self._pods[pod_uid]
            if users == 1:
                del self._pods[pod_uid]  # forget pods nobody probes any more
            else:
                self._pods[pod_uid] = (sem, users - 1)
