"""The book of a mapped range's file: which of its pieces are written, verified, by whichever
restore came first (``runtime.pages.entry.EntryBuild`` makes one per entry being made; every
streamed restore of that version in this process shares it)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from runtime.pages.mapping import Span
from runtime.pages.source import PIECE


class MappedBook:
    """Which pieces of the mapped ranges' files are in their files, verified there: shared by
    every streamed restore of one version in this process that maps those files
    (``runtime.pages.entry.EntryBuild``). Whoever comes first writes a piece (under its lock
    here); every restore lets it go in its own tree. A piece is a 2 MiB-aligned window of its
    file: its index is its offset // 2 MiB."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self._locks = {s.name: [threading.Lock() for _ in range(-(-s.file_size // PIECE))] for s in spans}
        self._written: set[tuple[str, int]] = set()
        self._total = sum(len(locks) for locks in self._locks.values())

    def lock(self, name: str, index: int) -> threading.Lock:
        return self._locks[name][index]

    def written(self, name: str, index: int) -> bool:
        return (name, index) in self._written

    def mark(self, name: str, index: int) -> None:
        self._written.add((name, index))

    def whole(self) -> bool:
        """Every piece of every file written."""
        return len(self._written) == self._total
