"""What a CRIU log says: its last error lines, and whether a run that exited 0 really succeeded.

Contract: every function takes the log's path and never raises for a missing or unreadable log
(the text says so instead); the caller decides what an error line means for its run.
"""

from __future__ import annotations

import re

# Error lines CRIU logs on every run of these nodes although nothing failed (no CAP_SYS_RESOURCE
# to raise its own RLIMIT_NOFILE).
HARMLESS_ERRORS = (re.compile(r"rlimit: Can't setup RLIMIT_NOFILE for self"),)


def log_errors(path: str, n: int = 8) -> str:
    """The last error lines of a CRIU log (else its last lines), without the harmless ones that
    would otherwise lead every failure reason."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        return f"(no log: {e})"
    errs = [ln for ln in lines if ("Error" in ln or "error" in ln.split(":", 1)[0])
            and not any(p.search(ln) for p in HARMLESS_ERRORS)]
    return " | ".join((errs or lines)[-n:]).strip()


def unexpected_errors(path: str) -> list[str]:
    """Error lines of a CRIU log beyond the known harmless ones. CRIU 4.2.1 exits 0 even when it
    could not read a shmem pages file ("Failed getting raw image fd"); the restored mapping then
    has wrong contents. A restore is only accepted with a clean log."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if "Error (" in ln]
    except OSError as exc:
        return [f"(no log: {exc})"]
    return [ln for ln in lines if not any(p.search(ln) for p in HARMLESS_ERRORS)]
