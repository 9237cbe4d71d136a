"""The zdtm tests the e2e suite runs through the plugin, read from selection.toml beside this file.

Each ``[[test]]`` table names one of CRIU's zdtm static tests and what it expects:

``name``      the test (test/zdtm/static/<name>.c; hack/build-zdtm.sh builds it)
``covers``    the kernel objects it checks, in words
``kind``      how zdtm's Makefile starts it: ``nofile`` (default), ``file`` (``--filename``),
              ``dir`` (``--dirname``), ``dirfile`` (both)
``args``      further options, as the Makefile gives them (``umask00``: ``--mask=0345``)
``timeout``   seconds it may take to check and exit after SIGTERM (default 30)
``alone``     run in a pod of its own (it makes its pod's whole checkpoint or restore fail)
``skip``      not run: why an unprivileged pod cannot run it (zdtm's .desc flags in words)
``xfail``     ``{bulk = "why", stock = "why", stream = "why"}``: known to fail after a restore on that path
              (strict: a pass fails the run, so the entry goes once it is fixed)

Every test not skipped must PASS in a pod without any checkpoint first; after a restore it must
PASS on every path unless ``xfail`` names the path.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SELECTION = HERE / "selection.toml"
PATHS = ("bulk", "stock", "stream")  # the plugin's restore paths (--restore-path / $REKINDLE_RESTORE_PATH)
KINDS = ("nofile", "file", "dir", "dirfile")
KEYS = {"name", "covers", "kind", "args", "timeout", "alone", "skip", "xfail"}


@dataclass(frozen=True)
class ZdtmTest:
    name: str
    covers: str
    kind: str = "nofile"
    args: tuple[str, ...] = ()
    timeout: float = 30.0
    alone: bool = False
    skip: str | None = None
    xfail: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """Options after --pidfile/--outfile, as zdtm's static/Makefile starts this test."""
        extra = {"nofile": [], "file": [f"--filename={self.name}.test"], "dir": [f"--dirname={self.name}.test"],
                 "dirfile": [f"--dirname={self.name}.dir.test", f"--filename={self.name}.test"]}[self.kind]
        return [*extra, *self.args]


def parse(doc: dict) -> list[ZdtmTest]:
    tests = []
    for i, t in enumerate(doc.get("test", [])):
        unknown = set(t) - KEYS
        if unknown or "name" not in t or "covers" not in t:
            raise ValueError(f"selection entry {i} ({t.get('name')!r}): unknown keys {sorted(unknown)} "
                             "or no name/covers")
        if t.get("kind", "nofile") not in KINDS:
            raise ValueError(f"{t['name']}: kind {t['kind']!r} is not one of {KINDS}")
        if set(t.get("xfail", {})) - set(PATHS):
            raise ValueError(f"{t['name']}: xfail names a path other than {PATHS}")
        if t.get("skip") is not None and t.get("xfail"):
            raise ValueError(f"{t['name']}: both skip and xfail")
        tests.append(ZdtmTest(name=t["name"], covers=t["covers"], kind=t.get("kind", "nofile"),
                              args=tuple(t.get("args", ())),
                              timeout=float(t.get("timeout", 30.0)), alone=bool(t.get("alone", False)), skip=t.get("skip"),
                              xfail=dict(t.get("xfail", {}))))
    names = [t.name for t in tests]
    if len(set(names)) != len(names):
        raise ValueError("a test is named twice in the selection")
    return tests


def load(path: Path = SELECTION) -> list[ZdtmTest]:
    with open(path, "rb") as f:
        return parse(tomllib.load(f))
