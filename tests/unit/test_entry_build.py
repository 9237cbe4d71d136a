"""runtime.pages.entry: the node cache entry streamed restores make, as a state machine (every
legal change, the illegal ones refused, restores and the writer racing from threads)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.pages import entry
from runtime.pages.entry import EntryBuild, EntryStateError, Left, Share, State
from runtime.pages.mapping import Span

SPANS = (Span(1, 0x7F0000200000, 4 << 20, 0), Span(1, 0x7F0000A00000, 2 << 20, 4 << 20))


class _Made:
    """An entry in a tmp dir, and what its discard saw."""

    def __init__(self, tmp_path: Path) -> None:
        self.discarded: list[EntryBuild] = []
        self.build = EntryBuild("k" * 32, ".tmp-k", SPANS, self.discarded.append)
        self.fds: list[int] = []
        for sp in SPANS:
            path = tmp_path / sp.name
            out = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            ro = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.fds += [out, ro]
            self.build.add_file(sp.name, out, ro)

    def closed(self) -> bool:
        return all(not _open(fd) for fd in self.fds)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def made(tmp_path: Path) -> _Made:
    return _Made(tmp_path)


def _opened(made: _Made) -> Share:
    share = made.build.open()
    assert made.build.state is State.BUILDING and made.build.users == 1 and share.first
    return share


def test_a_new_entry_is_opening_and_its_first_share_opens_it(made: _Made) -> None:
    assert made.build.state is State.OPENING and made.build.users == 0
    share = _opened(made)
    assert set(share.outs) == set(share.ros) == {sp.name for sp in SPANS}
    assert all(fd not in made.fds and _open(fd) for fd in (*share.outs.values(), *share.ros.values()))
    assert os.fstat(share.out(SPANS[0].name)).st_ino == os.fstat(share.ro(SPANS[0].name)).st_ino


def test_the_whole_way_to_sealed(made: _Made) -> None:
    first = _opened(made)
    later = made.build.join(wait=0)
    assert later is not None and not later.first and made.build.users == 2
    assert first.leave(True) is Left.HANDED and made.build.state is State.WHOLE
    assert made.build.join(wait=0) is None  # nobody joins an entry handed over
    assert later.leave(True) is Left.STAYS and made.build.users == 0  # the first whole one has it
    assert made.build.claim() and made.build.state is State.WRITING
    assert not made.build.abandon_unclaimed() and made.build.state is State.WRITING
    made.build.seal()
    assert made.build.state is State.SEALED and made.closed() and made.discarded == []
    assert not made.build.abandon() and made.build.state is State.SEALED  # the writer's last word: a no-op


def test_the_last_to_leave_without_it_whole_abandons_it(made: _Made) -> None:
    first = _opened(made)
    later = made.build.join(wait=0)
    assert later is not None
    assert first.leave(False) is Left.STAYS and made.build.state is State.BUILDING
    assert later.leave(False) is Left.ABANDONED and made.build.state is State.ABANDONED
    assert made.discarded == [made.build] and made.closed()
    assert made.build.join(wait=0) is None and not made.build.claim()


def test_a_share_leaves_once_and_keeps_its_fds_until_then(made: _Made) -> None:
    share = _opened(made)
    fds = [*share.outs.values(), *share.ros.values()]
    assert share.leave(False) is Left.ABANDONED
    assert share.leave(True) is Left.STAYS and made.discarded == [made.build]
    assert not any(_open(fd) for fd in fds) and share.outs == share.ros == {}


def test_a_share_outlives_the_entry_it_was_handed_with(made: _Made) -> None:
    first = _opened(made)
    later = made.build.join(wait=0)
    assert later is not None and first.leave(True) is Left.HANDED
    assert made.build.abandon_unclaimed() and made.build.state is State.ABANDONED  # the writer did not take it
    assert _open(later.out(SPANS[0].name))  # its restore keeps what it maps
    assert later.leave(False) is Left.STAYS and made.discarded == [made.build]


@pytest.mark.parametrize("state", [State.OPENING, State.BUILDING, State.WHOLE, State.WRITING])
def test_abandon_ends_it_from_every_state_before_the_end(made: _Made, state: State) -> None:
    _to(made, state)
    assert made.build.abandon() and made.build.state is State.ABANDONED
    assert made.discarded == [made.build] and made.closed()
    assert not made.build.abandon() and made.discarded == [made.build]  # once


def test_an_entry_abandoned_while_opening_turns_joiners_away_at_once(made: _Made) -> None:
    assert made.build.join(wait=0) is None  # not open yet
    made.build.abandon()
    assert made.build.join(wait=30) is None
    with pytest.raises(EntryStateError):
        made.build.open()


def test_a_joiner_waits_until_the_entry_is_open(made: _Made) -> None:
    got: list[Share | None] = []
    joiner = threading.Thread(target=lambda: got.append(made.build.join(wait=30)))
    joiner.start()
    first = _opened(made)
    joiner.join(10)
    assert len(got) == 1 and got[0] is not None and made.build.users == 2
    assert got[0].leave(False) is Left.STAYS and first.leave(True) is Left.HANDED


def test_an_entry_whose_first_share_cannot_be_made_is_abandoned(made: _Made,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fds(fd: int) -> int:
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(entry.os, "dup", no_fds)
    with pytest.raises(OSError):
        made.build.open()
    assert made.build.state is State.ABANDONED and made.discarded == [made.build] and made.closed()
    assert made.build.join(wait=0) is None


def test_a_joiner_whose_share_cannot_be_made_is_not_counted(made: _Made, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _opened(made)
    monkeypatch.setattr(entry.os, "dup", lambda fd: (_ for _ in ()).throw(OSError(24, "Too many open files")))
    with pytest.raises(OSError):
        made.build.join(wait=0)
    monkeypatch.undo()
    assert made.build.users == 1 and first.leave(False) is Left.ABANDONED


def _to(made: _Made, state: State) -> None:
    """``made``'s entry brought to ``state`` the legal way."""
    if state is State.OPENING:
        return
    share = made.build.open()
    if state is State.BUILDING:
        return
    if state is State.ABANDONED:
        share.leave(False)
        return
    share.leave(True)
    if state is State.WHOLE:
        return
    made.build.claim()
    if state is State.SEALED:
        made.build.seal()


ILLEGAL: list[tuple[State, str, Callable[[EntryBuild], object]]] = [
    *[(s, "open", EntryBuild.open) for s in (State.BUILDING, State.WHOLE, State.WRITING, State.SEALED,
                                               State.ABANDONED)],
    *[(s, "add_file", lambda b: b.add_file("x", -1, -1)) for s in (State.BUILDING, State.WHOLE, State.WRITING,
                                                                      State.SEALED, State.ABANDONED)],
    *[(s, "claim", EntryBuild.claim) for s in (State.OPENING, State.BUILDING, State.WRITING, State.SEALED)],
    *[(s, "seal", EntryBuild.seal) for s in (State.OPENING, State.BUILDING, State.WHOLE, State.SEALED,
                                               State.ABANDONED)],
]


@pytest.mark.parametrize("state, name, change", ILLEGAL, ids=[f"{n}-from-{s.value}" for s, n, _c in ILLEGAL])
def test_a_change_the_state_does_not_allow_is_refused(made: _Made, state: State, name: str,
                                                      change: Callable[[EntryBuild], object]) -> None:
    _to(made, state)
    discarded = list(made.discarded)
    with pytest.raises(EntryStateError, match=state.value):
        change(made.build)
    assert made.build.state is state and made.discarded == discarded


@pytest.mark.parametrize("state", [State.OPENING, State.BUILDING, State.WRITING, State.SEALED, State.ABANDONED])
def test_only_a_whole_entry_is_abandoned_as_unclaimed(made: _Made, state: State) -> None:
    _to(made, state)
    assert not made.build.abandon_unclaimed() and made.build.state is state


def test_a_leave_the_entry_never_counted_is_refused(made: _Made) -> None:
    assert _opened(made).leave(True) is Left.HANDED
    with pytest.raises(EntryStateError):
        Share(made.build, first=False).leave(False)
    assert made.build.state is State.WHOLE and made.build.users == 0


THREADS = 16


def _race(fn: Callable[[int], object]) -> list[object]:
    """``fn(i)`` from THREADS threads released at once; their results (or exceptions)."""
    start = threading.Barrier(THREADS)
    out: list[object] = [None] * THREADS

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - collected for the test to count
            out[i] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return out


def _shares(made: _Made) -> list[Share]:
    shares = [made.build.open()]
    for _ in range(THREADS - 1):
        s = made.build.join(wait=0)
        assert s is not None
        shares.append(s)
    return shares


@pytest.mark.parametrize("round_", range(5))
def test_of_restores_leaving_whole_at_once_exactly_one_holds_it(made: _Made, round_: int) -> None:
    shares = _shares(made)
    got = _race(lambda i: shares[i].leave(True))
    assert got.count(Left.HANDED) == 1 and got.count(Left.STAYS) == THREADS - 1
    assert made.build.state is State.WHOLE and made.build.users == 0 and made.discarded == []


@pytest.mark.parametrize("round_", range(5))
def test_of_restores_leaving_broken_at_once_exactly_the_last_abandons_it(made: _Made, round_: int) -> None:
    shares = _shares(made)
    got = _race(lambda i: shares[i].leave(False))
    assert got.count(Left.ABANDONED) == 1 and got.count(Left.STAYS) == THREADS - 1
    assert made.build.state is State.ABANDONED and made.discarded == [made.build] and made.closed()


@pytest.mark.parametrize("round_", range(5))
def test_of_leaves_mixed_at_once_the_whole_one_holds_it_and_nothing_is_abandoned(made: _Made, round_: int) -> None:
    # the broken ones never leave it without a restore: the whole one counts until it leaves
    shares = _shares(made)
    got = _race(lambda i: shares[i].leave(i == THREADS // 2))
    assert got[THREADS // 2] is Left.HANDED and got.count(Left.STAYS) == THREADS - 1
    assert made.build.state is State.WHOLE and made.discarded == []


def test_of_joins_and_a_hand_over_at_once_no_joiner_gets_a_handed_entry(made: _Made) -> None:
    first = made.build.open()

    def go(i: int) -> object:
        if i == 0:
            return first.leave(True)
        share = made.build.join(wait=0)
        return share if share is None else share.leave(False)
    got = _race(go)
    assert got[0] is Left.HANDED and made.build.state is State.WHOLE and made.build.users == 0
    assert all(g in (None, Left.STAYS) for g in got[1:]) and made.discarded == []


def test_of_claims_and_abandons_at_once_one_wins(made: _Made) -> None:
    _to(made, State.WHOLE)
    got = _race(lambda i: made.build.claim() if i % 2 else made.build.abandon_unclaimed())
    assert sum(1 for g in got if g is True) == 1
    if made.build.state is State.WRITING:  # claimed: the other claims were refused, no abandon acted
        assert made.discarded == []
        assert all(g is False or isinstance(g, EntryStateError) for g in got if g is not True)
    else:  # abandoned first: every claim said so
        assert made.build.state is State.ABANDONED and made.discarded == [made.build]
        assert all(g is False for g in got if g is not True)
