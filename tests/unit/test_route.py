"""The restore's route: one pure function over the facts a restore has once staged (runtime.route)."""

from __future__ import annotations

import pytest

from runtime.route import BUSY_RESTORES, STREAM_MIN_BYTES, RestorePath, Route, RouteFacts, RouteKind, choose

MIB = 1 << 20
A, S, B, K = RestorePath.AUTO, RestorePath.STREAM, RestorePath.BULK, RestorePath.STOCK


def facts(*, cannot: str | None = None, mapped: bool = False, warm_rest: bool = False, cuda: bool = False,
          mib: int = 4096, concurrent: int = 0) -> RouteFacts:
    return RouteFacts(cannot, mapped, warm_rest, cuda, mib * MIB, concurrent)


@pytest.mark.parametrize(("asked", "f", "path", "kind", "why"), [
    (K, facts(), K, RouteKind.STOCK, "asked"),
    (K, facts(mapped=True), K, RouteKind.STOCK, "asked"),
    # a complete entry: mapped, the rest filled (served only with the measurement setting)
    (A, facts(mapped=True), B, RouteKind.MAPPED, "node cache"),
    (S, facts(mapped=True), B, RouteKind.MAPPED, "node cache"),
    (B, facts(mapped=True, warm_rest=True), B, RouteKind.MAPPED, "node cache"),
    (S, facts(mapped=True, warm_rest=True), S, RouteKind.MAPPED, "served while"),
    (B, facts(cuda=True), B, RouteKind.BULK, "asked"),
    (A, facts(cannot="no uffd"), B, RouteKind.BULK, "no uffd"),
    (S, facts(cannot="no uffd", cuda=True), B, RouteKind.BULK, "no uffd"),
    (S, facts(mib=64, concurrent=9), S, RouteKind.STREAM, "asked"),
    # the rule, on auto
    (A, facts(cuda=True, mib=64, concurrent=9), S, RouteKind.STREAM, "CUDA"),
    (A, facts(mib=64), B, RouteKind.BULK, "64 MiB"),
    (A, facts(mib=STREAM_MIN_BYTES // MIB - 1), B, RouteKind.BULK, "below"),
    (A, facts(mib=STREAM_MIN_BYTES // MIB), S, RouteKind.STREAM, "arrive"),
    (A, facts(mib=1024, concurrent=BUSY_RESTORES - 1), S, RouteKind.STREAM, "arrive"),
    (A, facts(mib=1024, concurrent=BUSY_RESTORES), B, RouteKind.BULK, "other restores"),
], ids=lambda v: v.value if isinstance(v, (RestorePath, RouteKind)) else None)
def test_the_route_table(asked: RestorePath, f: RouteFacts, path: RestorePath, kind: RouteKind, why: str) -> None:
    got = choose(asked, f)
    assert (got.path, got.kind) == (path, kind), got
    assert why in got.reason, got


def test_a_later_step_only_falls_back_and_says_why() -> None:
    streamed = choose(A, facts(cuda=True))
    back = streamed.instead(B, "CRIU cannot hand these pages over")
    assert back.path is B and back.kind is RouteKind.BULK
    assert back.reason.startswith("CRIU cannot") and "was: the CUDA driver" in back.reason
    mapped = Route(S, RouteKind.MAPPED, "entry").instead(B, "no")
    assert mapped.kind is RouteKind.MAPPED  # still mapped from the entry, the rest filled now


def test_a_stream_that_feeds_the_node_cache_says_which_way() -> None:
    r = choose(A, facts(cuda=True))
    assert r.feeding(True).kind is RouteKind.STREAM_BUILD and r.feeding(False).kind is RouteKind.STREAM_JOIN
    assert r.feeding(True).record() == {"path": "stream", "kind": "stream-build", "reason": r.reason}
