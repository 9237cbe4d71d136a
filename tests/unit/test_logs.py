"""Log lines: JSON with structured fields from ``extra=`` and from the bound context (which
follows a task or a ``Context.run`` into a thread); text stays one readable line."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import threading

from nri_plugin import logs


def _logger(fmt: str):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.ContextFields())
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"test.logs.{fmt}")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log, stream


def test_json_lines_carry_bound_and_extra_fields():
    log, stream = _logger("json")
    with logs.bound(namespace="team-a", pod="qwen-0", container="server", artifact="qwen-7b"):
        log.info("phase %s: %.3fs", "fill", 1.25, extra={"phase": "fill", "seconds": 1.25})
        ctx = contextvars.copy_context()
    log.info("outside")
    t = threading.Thread(target=ctx.run, args=(log.info, "from a pool thread"))
    t.start()
    t.join()
    first, outside, threaded = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "phase fill: 1.250s"
    assert {k: first[k] for k in ("namespace", "pod", "container", "artifact", "phase", "seconds")} == {
        "namespace": "team-a", "pod": "qwen-0", "container": "server", "artifact": "qwen-7b",
        "phase": "fill", "seconds": 1.25}
    assert first["level"] == "info" and first["time"].endswith("Z")
    assert "pod" not in outside
    assert threaded["pod"] == "qwen-0" and threaded["artifact"] == "qwen-7b"


def test_text_format_stays_a_plain_line():
    log, stream = _logger("text")
    with logs.bound(pod="qwen-0"):
        log.info("restored %s", "x", extra={"seconds": 3.2})
    assert stream.getvalue() == "INFO restored x\n"
