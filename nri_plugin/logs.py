"""Logging set-up for the CLI: readable text for people, JSON lines for the DaemonSet.

Structured fields (``FIELDS``: pod, namespace, container, artifact, phase, seconds, event, ...)
reach a record in two ways, as in kopf's object loggers:
  - ``extra=`` on the call (``log.info("...", extra={"phase": "fill", "seconds": 1.2})``);
  - ``bound(**fields)`` / ``bind(**fields)``: a context variable that a filter copies into every
    record made in that context. The stub binds pod, namespace, container and event around each
    NRI handler, the jobs bind the artifact around each checkpoint/restore task, and thread-pool
    calls run in a copy of the caller's context, so the engine's own log lines carry them too.
JSON lines hold every field present; the text format stays one readable line (the messages
already name pod and container).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

FIELDS = ("namespace", "pod", "container", "container_id", "artifact", "event", "phase", "seconds",
          "outcome", "reason")

_fields: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("rekindle_log_fields", default={})


def bind(**fields: Any) -> contextvars.Token[Mapping[str, Any]]:
    """Add fields to every record of the current context (a task, or a ``Context.run``)."""
    return _fields.set({**_fields.get(), **{k: v for k, v in fields.items() if v not in (None, "")}})


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    token = bind(**fields)
    try:
        yield
    finally:
        _fields.reset(token)


def current() -> Mapping[str, Any]:
    return _fields.get()


class ContextFields(logging.Filter):
    """Copies the bound fields into each record (an explicit ``extra=`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _fields.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None and value != "":
                doc[key] = value
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(verbose: bool, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFields())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Frame traces are noisy even at debug; opt in with REKINDLE_TRACE_TRANSPORT=1.
    if not os.environ.get("REKINDLE_TRACE_TRANSPORT"):
        logging.getLogger("nri_plugin.transport").setLevel(logging.INFO)
    logging.getLogger("asyncio").setLevel(logging.WARNING)
    # The Kubernetes client logs every request body at debug: keys only, never payloads.
    logging.getLogger("kubernetes").setLevel(logging.INFO)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
