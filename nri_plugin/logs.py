"""Logging set-up for the CLI: readable text for people, JSON lines for the DaemonSet."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup(verbose: bool, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Frame traces are noisy even at debug; opt in with REKINDLE_TRACE_TRANSPORT=1.
    import os
    if not os.environ.get("REKINDLE_TRACE_TRANSPORT"):
        logging.getLogger("nri_plugin.transport").setLevel(logging.INFO)
    logging.getLogger("asyncio").setLevel(logging.WARNING)
