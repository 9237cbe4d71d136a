"""A node cache entry that streamed restores make as they run, from its reservation to its end.

The cache (``runtime.pages.nodecache``) reserves the entry's key and its unfinished directory;
restores of the version share it (:class:`Share`): their serves write its map files piece by
piece (``runtime.pages.stream``), the first restore done with every piece written holds it for
the writer, and the writer (``nri_plugin.cache``) adds the rest and seals it. Who may do what
next is the :class:`State` here, changed only through :class:`EntryBuild`'s methods under its
own lock; a change the state does not allow raises :class:`EntryStateError`.

::

    OPENING --open--> BUILDING --leave, whole--> WHOLE --claim--> WRITING --seal--> SEALED
       |                 |                         |                 |
       +-----------------+------- abandon ---------+-----------------+--> ABANDONED

The first restore to leave with every piece written takes it to WHOLE (:attr:`Left.HANDED`: it
hands it to the writer, whose :meth:`EntryBuild.claim` says whether it is the writer's now); the
last to leave ``BUILDING`` without abandons it. ``abandon`` from ``SEALED`` or ``ABANDONED``
does nothing (whoever owned it last may always call it).
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable, Sequence

from runtime.pages.book import MappedBook
from runtime.pages.mapping import Span


class State(enum.Enum):
    OPENING = "opening"  # reserved; its map files are being made (joiners wait)
    BUILDING = "building"  # its files made: restores share it and their serves write its pieces
    WHOLE = "whole"  # a restore ended with every piece written and holds it for the writer
    WRITING = "writing"  # the writer took it: it adds the rest and seals it
    SEALED = "sealed"  # renamed into place, complete
    ABANDONED = "abandoned"  # removed: never made whole, or not finished


ENDED = frozenset({State.SEALED, State.ABANDONED})


class Left(enum.Enum):
    """What a restore's :meth:`Share.leave` made of the entry."""

    STAYS = "stays"  # others still make it, or it was handed over (or ended) already
    HANDED = "handed"  # this restore holds it now: it hands it to the writer or abandons it
    ABANDONED = "abandoned"  # this restore was the last, none had it whole: removed


class EntryStateError(RuntimeError):
    """A change the entry's state does not allow (a bug in its caller)."""


class EntryBuild:
    """One entry being made: its key, unfinished directory ``tmp`` and mapped ``spans``, the
    book of its map files' pieces (which are written, verified), their fds, and its state.
    ``discard(self)`` removes what it left on disk and frees its key; it runs once, when it
    is abandoned."""

    def __init__(self, key: str, tmp: str, spans: Sequence[Span],
                 discard: Callable[[EntryBuild], None]) -> None:
        self.key, self.tmp = key, tmp
        self.spans = tuple(spans)
        self.book = MappedBook(self.spans)
        self._discard = discard
        self._outs: dict[str, int] = {}  # the map files, read-write (each share has its own dups)
        self._ros: dict[str, int] = {}  # and read-only (what CRIU is handed)
        self._state = State.OPENING
        self._users = 0
        self._ready = threading.Event()  # out of OPENING: whoever waits to join may look
        self._lock = threading.Lock()

    @property
    def state(self) -> State:
        return self._state

    @property
    def users(self) -> int:
        return self._users

    def _refuse(self, what: str) -> EntryStateError:
        return EntryStateError(f"node cache entry {self.key}: {what} when {self._state.value}")

    def add_file(self, name: str, out: int, ro: int) -> None:
        """Map file ``name``, made: ``out`` read-write, ``ro`` read-only; both closed by this
        object from here on."""
        with self._lock:
            if self._state is not State.OPENING:
                raise self._refuse(f"file {name} added")
            self._outs[name], self._ros[name] = out, ro

    def open(self) -> Share:
        """Its files are made: OPENING -> BUILDING, and the first restore's share."""
        with self._lock:
            if self._state is not State.OPENING:
                raise self._refuse("opened")
            try:
                share = self._share(first=True)
            except OSError:
                self._end()
                raise
            finally:
                self._ready.set()
            self._state = State.BUILDING
            self._users = 1
            return share

    def join(self, wait: float = 30.0) -> Share | None:
        """A later restore's share, once its files are made; None once it was handed over or
        ended (or its files took longer than ``wait``)."""
        if not self._ready.wait(wait):
            return None
        with self._lock:
            if self._state is not State.BUILDING:
                return None
            self._users += 1
            try:
                return self._share(first=False)
            except OSError:
                self._users -= 1
                raise

    def _share(self, first: bool) -> Share:
        # under the lock: the fds are not closed while they are duplicated
        share = Share(self, first)
        try:
            for name, fd in self._outs.items():
                share.outs[name] = os.dup(fd)
            for name, fd in self._ros.items():
                share.ros[name] = os.dup(fd)
        except OSError:
            share.close_fds()
            raise
        return share

    def _left(self, whole: bool) -> Left:
        with self._lock:
            if self._users <= 0:
                raise self._refuse("left by a restore it does not have")
            self._users -= 1
            if self._state is not State.BUILDING:
                return Left.STAYS
            if whole:
                self._state = State.WHOLE
                return Left.HANDED
            if self._users > 0:
                return Left.STAYS
            # the last one, none with it whole: ended before any other restore may join
            self._end()
            return Left.ABANDONED

    def claim(self) -> bool:
        """The writer takes it (WHOLE -> WRITING): True when it is the writer's now, False when
        it was abandoned already."""
        with self._lock:
            if self._state is State.ABANDONED:
                return False
            if self._state is not State.WHOLE:
                raise self._refuse("claimed by the writer")
            self._state = State.WRITING
            return True

    def seal(self) -> None:
        """The writer renamed it into place complete (WRITING -> SEALED)."""
        with self._lock:
            if self._state is not State.WRITING:
                raise self._refuse("sealed")
            self._state = State.SEALED
            self._close_fds()

    def abandon(self) -> bool:
        """Remove the unfinished entry (no restore of it got every piece written, or the one that
        did could not hand it over, or the writer could not finish it); its restores keep what
        they map. False when it had ended already (a no-op)."""
        with self._lock:
            if self._state in ENDED:
                return False
            self._end()
            return True

    def abandon_unclaimed(self) -> bool:
        """Abandon it if it is still WHOLE: handed over by a restore, but the writer did not take
        it. False when the writer has it (or it ended)."""
        with self._lock:
            if self._state is not State.WHOLE:
                return False
            self._end()
            return True

    def _end(self) -> None:
        # under the lock: -> ABANDONED, its fds closed, whoever waits to join it gets nothing, and
        # what it left on disk removed (other calls on it wait for that, then find it ended)
        self._state = State.ABANDONED
        self._ready.set()
        self._close_fds()
        self._discard(self)

    def _close_fds(self) -> None:
        for fd in (*self._outs.values(), *self._ros.values()):
            os.close(fd)
        self._outs.clear()
        self._ros.clear()


class Share:
    """One restore's part in an :class:`EntryBuild`: its own fds of the map files (the serve
    writes through :meth:`out`, CRIU maps :meth:`ro`), and :meth:`leave` when it is done."""

    def __init__(self, build: EntryBuild, first: bool) -> None:
        self.build, self.first = build, first
        self.outs: dict[str, int] = {}
        self.ros: dict[str, int] = {}
        self._left = False

    def out(self, name: str) -> int:
        return self.outs[name]

    def ro(self, name: str) -> int:
        return self.ros[name]

    def close_fds(self) -> None:
        for fd in (*self.outs.values(), *self.ros.values()):
            os.close(fd)
        self.outs.clear()
        self.ros.clear()

    def leave(self, whole: bool) -> Left:
        """This restore is done (``whole``: it ended with every piece written). Only the first
        leave counts; a later one is :attr:`Left.STAYS`."""
        if self._left:
            return Left.STAYS
        self._left = True
        self.close_fds()
        return self.build._left(whole)
