"""A bench's result document: the machine's facts it records, and writing it (after every step,
so a run cut short keeps what it measured)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def host(python: bool = False) -> dict[str, Any]:
    """The kernel's release and the CPU count (and this Python's version, with ``python``)."""
    facts: dict[str, Any] = {"kernel": platform.release(), "cpus": os.cpu_count()}
    if python:
        facts["python"] = platform.python_version()
    return facts


def criu_version(binary: str | None = None, env: dict[str, str] | None = None) -> str:
    """The first line of ``criu --version`` (``binary``, else ``$REKINDLE_CRIU``, else criu on PATH)."""
    binary = binary or os.environ.get("REKINDLE_CRIU", "criu")
    return subprocess.run([binary, "--version"], capture_output=True, text=True, env=env).stdout.split("\n")[0].strip()


def gpu_lines() -> list[str]:
    """nvidia-smi's ``name, driver_version`` line per GPU (none without a driver)."""
    return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()


def gpus() -> list[dict[str, str]]:
    """:func:`gpu_lines` as ``{"name", "driver"}`` objects."""
    return [parse_gpu_line(line) for line in gpu_lines()]


def parse_gpu_line(line: str) -> dict[str, str]:
    return {"name": line.split(",")[0].strip(), "driver": line.split(",")[-1].strip()}


def write_json(path: Path, doc: Any, sort_keys: bool = False) -> None:
    """``doc`` as indented JSON at ``path`` (its directory made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=sort_keys) + "\n")
