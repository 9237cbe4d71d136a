"""A test-only pause at a named step of a restore, so that a test can kill the agent exactly there.

Off unless ``REKINDLE_TEST_PAUSE`` is set (never in the chart or the image). With
``REKINDLE_TEST_PAUSE=<step>:<dir>``, the process reaching ``<step>`` creates
``<dir>/<step>.reached`` and waits (at most :data:`LIMIT` seconds) until ``<dir>/<step>.go``
exists. Steps: ``deleted`` (the writable layer's deletions done, no member written yet),
``member`` (before member ``overlay.PAUSE_AT_MEMBER``), ``applied`` (the layer applied, before
CRIU), ``criu`` (CRIU done, the tree stopped, before the fill), ``prewarm`` (a warm-up's first
chunk written, all of its threads held); several steps: ``<step>,<step>:<dir>``.
"""

from __future__ import annotations

import os
import time

ENV = "REKINDLE_TEST_PAUSE"
LIMIT = 120.0


def pause_for_test(step: str) -> None:
    spec = os.environ.get(ENV)
    if not spec or step not in spec.split(":", 1)[0].split(","):  # "criu,prewarm:<dir>": both
        return
    where = spec.split(":", 1)[1]
    open(os.path.join(where, step + ".reached"), "w").close()
    deadline = time.monotonic() + LIMIT
    while not os.path.exists(os.path.join(where, step + ".go")) and time.monotonic() < deadline:
        time.sleep(0.02)

