"""Which way a restore puts the bulk pages back: decided once, from facts, by a pure function.

A route is a :class:`RestorePath` (what the restore runs) and a :class:`RouteKind` (what it
does with the node cache), with the reason it was chosen; the restore records it in the
container's ``timings.json`` (``route``). :func:`choose` takes the requested path and the facts
known once the artifact is staged (what this node can do, whether a complete node-cache entry
maps the ranges, the bytes left to serve, whether the tree maps the CUDA driver's host copy,
how many other restores run on the node); a later step may only fall back (:meth:`Route.instead`)
or say which entry a stream feeds (:meth:`Route.feeding`).

Streaming wins where the tree can run before all its pages are in: a CUDA tree, whose driver
reads its host copy while it arrives, and a large CPU-only tree. It loses on small and on
concurrent CPU-only restores, where its fixed costs dominate: 64 MiB among 40 pods, median 2.90 s
streamed against 0.73 s bulk; five 256 MiB at once 3.84 s against 0.88 s; its start 0.36-0.60 s
alone and 1.10-1.35 s under load; CRIU's restore with the lazy-pages hand-off 0.73 s against
0.30 s (2-core CPU machine). A 1.4 GiB in-memory database answered first at 1.1-1.4 s streamed
against 2.8 s bulk, so a tree of more than :data:`STREAM_MIN_BYTES` streams when the node is not
busy with others.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RestorePath(enum.Enum):
    """How the bulk pages are put back, as asked (the product's default is ``AUTO``:
    nri_plugin.config); :func:`choose` turns it into the path a restore runs."""

    AUTO = "auto"    # the rule of :func:`choose` decides
    BULK = "bulk"    # filled beside CRIU on many threads, before the tree runs
    STOCK = "stock"  # CRIU restores every page itself (one thread), for comparison
    STREAM = "stream"  # resumed after CRIU, bulk pages served through userfaultfd (runtime.pages.stream)


class RouteKind(enum.Enum):
    MAPPED = "mapped"              # a complete node cache entry: its ranges mapped, the rest filled
    STREAM_BUILD = "stream-build"  # streamed, the node cache entry made as it runs
    STREAM_JOIN = "stream-join"    # streamed, sharing the entry another restore is making
    STREAM = "stream"              # streamed by copy
    BULK = "bulk"
    STOCK = "stock"


# A CPU-only tree with fewer bulk bytes than this is filled, not streamed (see the module's note).
STREAM_MIN_BYTES = 512 << 20
# Other restores running on the node from which a CPU-only tree is filled, not streamed.
BUSY_RESTORES = 2


@dataclass(frozen=True)
class RouteFacts:
    node_cannot_stream: str | None  # why this node cannot stream at all (None: it can)
    mapped_entry: bool  # a complete node cache entry maps this version's ranges
    warm_rest: bool  # a mapped restore serves the rest while the tree runs (a measurement setting)
    cuda_host_copy: bool  # the tree maps the CUDA driver's host copy of device memory
    serve_bytes: int  # bulk bytes left to put back (less what is mapped)
    concurrent: int  # other restores running on the node when this one began


@dataclass(frozen=True)
class Route:
    path: RestorePath
    kind: RouteKind
    reason: str

    def instead(self, path: RestorePath, why: str) -> Route:
        """A later step found the chosen path cannot run: fall back (never to stream)."""
        kind = RouteKind.MAPPED if self.kind is RouteKind.MAPPED else RouteKind(path.value)
        return Route(path, kind, f"{why} (was: {self.reason})")

    def feeding(self, first: bool) -> Route:
        """The stream makes the version's node cache entry (``first``) or joins the one being made."""
        kind = RouteKind.STREAM_BUILD if first else RouteKind.STREAM_JOIN
        return Route(self.path, kind, self.reason)

    def record(self) -> dict[str, str]:
        return {"path": self.path.value, "kind": self.kind.value, "reason": self.reason}


def choose(requested: RestorePath, facts: RouteFacts) -> Route:
    """The route of one restore (see the module's note for the rule and what it rests on)."""
    if requested is RestorePath.STOCK:
        return Route(RestorePath.STOCK, RouteKind.STOCK, "asked for (CRIU restores every page)")
    streams = requested in (RestorePath.STREAM, RestorePath.AUTO)
    if facts.mapped_entry and not (streams and facts.warm_rest):
        return Route(RestorePath.BULK, RouteKind.MAPPED, "a complete node cache entry: ranges mapped, the rest filled")
    if requested is RestorePath.BULK:
        return Route(RestorePath.BULK, RouteKind.BULK, "asked for")
    if facts.node_cannot_stream is not None:
        return Route(RestorePath.BULK, RouteKind.BULK, f"this node cannot stream: {facts.node_cannot_stream}")
    if facts.mapped_entry:
        return Route(RestorePath.STREAM, RouteKind.MAPPED, "a complete node cache entry: ranges mapped, "
                     "the rest served while the tree runs")
    if requested is RestorePath.STREAM:
        return Route(RestorePath.STREAM, RouteKind.STREAM, "asked for")
    if facts.cuda_host_copy:
        return Route(RestorePath.STREAM, RouteKind.STREAM, "the CUDA driver reads its host copy as it arrives")
    if facts.serve_bytes < STREAM_MIN_BYTES:
        return Route(RestorePath.BULK, RouteKind.BULK, f"{facts.serve_bytes >> 20} MiB of pages, below the "
                     f"{STREAM_MIN_BYTES >> 20} MiB where streaming pays off without CUDA")
    if facts.concurrent >= BUSY_RESTORES:
        return Route(RestorePath.BULK, RouteKind.BULK, f"{facts.concurrent} other restores running: "
                     "a stream's fixed costs grow with the node's load")
    return Route(RestorePath.STREAM, RouteKind.STREAM, f"{facts.serve_bytes >> 20} MiB of pages: "
                 "the tree runs while they arrive")
