#!/usr/bin/env python3
"""Run an inference engine under Rekindle: release its KV cache before the checkpoint, take it
back after a restore. Standard library only, so it runs in any engine image with python3.

    rekindle_hook.py run --engine vllm|sglang [--port P] [options] -- ENGINE COMMAND...
    rekindle_hook.py probe        # exit 0 once the engine serves (a readiness/startup probe)

Contract:
- ``run`` starts the engine command as its child and waits (``--ready-timeout``) until the
  engine's health endpoint answers 200. It forwards SIGTERM/SIGINT to the engine and exits with
  the engine's status (128+signal when signalled), except as said below.
- Source role (``$REKINDLE_CHECKPOINT`` is not empty: the chart's recipes set it from the pod's
  ``rekindle.dev/checkpoint`` annotation, so the same container spec serves as a restore target):
  quiesce the engine (vLLM: ``POST /sleep?level=1`` then ``POST /wake_up?tags=weights``, so only
  the KV cache stays released; SGLang: ``POST /release_memory_occupation`` with the tags to
  release, ``kv_cache`` by default), then write ``ready-for-checkpoint`` in the control dir
  (``$REKINDLE_CONTROL_DIR``, or Dynamo's names) and poll it every 100 ms until one of:
    ``restore-complete``  this process is the restored copy: resume the engine, serve;
    ``snapshot-complete`` the source after its checkpoint: with ``--after-checkpoint exit``
                          (default) stop the engine and exit 0 (a Job succeeds); with ``serve``
                          resume and serve (needs ``rekindle.dev/after-checkpoint: keep-running``);
    ``checkpoint-failed`` resume, then exit 1 after stopping the engine (the Job fails);
    the ``--checkpoint-timeout`` resume, then exit 1 likewise (no plugin, or no annotation).
  A quiesce the engine refuses (sleep mode not enabled) stops the engine and exits 2. A SIGTERM
  once ``snapshot-complete`` is there (``rekindle.dev/after-checkpoint: exit``) also exits 0.
  Waits count the time between polls, capped per step, so the time a process spent frozen
  between checkpoint and restore does not count.
- ``--release plugin``: the hook neither quiesces nor resumes; the pod's
  ``rekindle.dev/before-checkpoint`` and ``rekindle.dev/after-restore`` annotations have the
  plugin make those calls (a failed one refuses the checkpoint or fails the restore).
- Serve role (no ``$REKINDLE_CHECKPOINT``): nothing is released; the engine just runs.
- Once the engine serves (healthy and resumed), the file ``/tmp/rekindle-engine-serving``
  (``$REKINDLE_HOOK_MARKER``) is written; ``probe`` checks for it. It lives in the container's
  own filesystem, so a restarted container starts without it; the hook also removes it first
  thing. The source never has it while it is checkpointed.
- Files are written to a temp name in the same dir and renamed; control-dir reads never follow
  symlinks.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

CONTROL_ENV = ("REKINDLE_CONTROL_DIR", "SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR")
ROLE_ENV = "REKINDLE_CHECKPOINT"
READY = "ready-for-checkpoint"
SNAPSHOT_COMPLETE = "snapshot-complete"
CHECKPOINT_FAILED = "checkpoint-failed"
RESTORE_COMPLETE = "restore-complete"
# In the container's own filesystem, never a volume or the control dir: a restarted container
# must start without it, even while its restore is still running and the hook is not.
MARKER_ENV = "REKINDLE_HOOK_MARKER"
DEFAULT_MARKER = "/tmp/rekindle-engine-serving"
POLL = 0.1
# Waits add up the time between polls, each step capped: a process frozen by a checkpoint and
# restored later (maybe on a node whose clock is far ahead) does not count the frozen time.
MAX_STEP = 10.0


def log(msg: str) -> None:
    print(f"rekindle-hook: {msg}", file=sys.stderr, flush=True)


class HookError(Exception):
    pass


class Stopped(Exception):
    """The engine exited or the hook was told to stop while it waited."""


# --- the engine's HTTP API ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Http:
    base: str
    timeout: float = 600.0  # offloading tens of GB of weights to host memory takes a while

    def call(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> int:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                resp.read()
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def post(self, path: str, body: Optional[dict] = None) -> None:
        status = self.call("POST", path, body)
        if not 200 <= status < 300:
            raise HookError(f"POST {path} answered {status}")


@dataclass(frozen=True)
class Engine:
    name: str
    health: str = "/health"

    def quiesce(self, http: Http) -> None:
        raise NotImplementedError

    def resume(self, http: Http) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class VLLM(Engine):
    """Sleep mode: needs ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` on the server."""

    name: str = "vllm"
    keep_weights_on_gpu: bool = True

    def quiesce(self, http: Http) -> None:
        # Level 1 moves the weights to pinned host memory and drops the KV cache. The weights go
        # back to the GPU at once: the driver's checkpoint moves GPU memory faster than CRIU
        # restores host pages, and the artifact holds them once either way.
        http.post("/sleep?level=1")
        if self.keep_weights_on_gpu:
            http.post("/wake_up?tags=weights")

    def resume(self, http: Http) -> None:
        http.post("/wake_up")  # whatever still sleeps: the KV cache


@dataclass(frozen=True)
class SGLang(Engine):
    """Memory saver: needs ``--enable-memory-saver`` on the server."""

    name: str = "sglang"
    tags: tuple = ("kv_cache",)

    def quiesce(self, http: Http) -> None:
        http.post("/release_memory_occupation", {"tags": list(self.tags)})

    def resume(self, http: Http) -> None:
        http.post("/resume_memory_occupation", {"tags": list(self.tags)})


@dataclass(frozen=True)
class ByPlugin(Engine):
    """``--release plugin``: the plugin makes the calls (``rekindle.dev/before-checkpoint`` and
    ``rekindle.dev/after-restore`` on the pod); the hook only says when to checkpoint."""

    def quiesce(self, http: Http) -> None:
        pass

    def resume(self, http: Http) -> None:
        pass


# --- the control dir ---------------------------------------------------------------------------------

def control_dir(env: "os._Environ[str] | dict[str, str]" = os.environ) -> Optional[Path]:
    for name in CONTROL_ENV:
        if env.get(name):
            return Path(env[name])
    return None


def serving_marker(env: "os._Environ[str] | dict[str, str]" = os.environ) -> Path:
    return Path(env.get(MARKER_ENV) or DEFAULT_MARKER)


def write_file(path: Path, content: str) -> None:
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, content.encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)


class Outcome(enum.Enum):
    SERVING = "serving"            # serve role: nothing to wait for
    RESTORED = "restored"          # the restored copy, in a new pod
    CHECKPOINTED = "checkpointed"  # the source, after its artifact was published
    FAILED = "checkpoint-failed"
    TIMED_OUT = "timed-out"


@dataclass
class Lifecycle:
    engine: Engine
    http: Http
    control: Optional[Path]
    source: bool
    marker: Path
    ready_timeout: float = 3600.0
    checkpoint_timeout: float = 1800.0
    resume_after_checkpoint: bool = False
    stopped: Callable[[], bool] = lambda: False
    clock: Callable[[], float] = time.monotonic
    events: list = field(default_factory=list)  # what happened, for logs and tests

    def _wait(self, what: str, timeout: float, check: Callable[[], Optional[str]]) -> Optional[str]:
        waited, last = 0.0, self.clock()
        while True:
            found = check()  # before the stop check: an outcome that came with a SIGTERM counts
            if found is not None:
                return found
            if self.stopped():
                raise Stopped(what)
            now = self.clock()
            waited += min(max(now - last, 0.0), MAX_STEP)
            last = now
            if waited >= timeout:
                return None
            time.sleep(POLL)

    def _healthy(self) -> Optional[str]:
        try:
            return "ok" if self.http.call("GET", self.engine.health, timeout=5) == 200 else None
        except OSError:
            return None  # not listening yet

    def _outcome_file(self) -> Optional[str]:
        assert self.control is not None
        for name in (RESTORE_COMPLETE, SNAPSHOT_COMPLETE, CHECKPOINT_FAILED):
            if os.path.lexists(self.control / name):
                return name
        return None

    def _serve(self) -> None:
        write_file(self.marker, f"{self.engine.name}\n")
        self.events.append("serving")

    def run(self) -> Outcome:
        self.marker.unlink(missing_ok=True)
        if self._wait("engine start", self.ready_timeout, self._healthy) is None:
            raise HookError(f"{self.engine.name} not healthy at {self.http.base}{self.engine.health} "
                            f"after {self.ready_timeout:.0f}s")
        self.events.append("healthy")
        if not self.source:
            self._serve()
            return Outcome.SERVING
        if self.control is None:
            raise HookError(f"${ROLE_ENV} is set but no control dir (${CONTROL_ENV[0]}): is the Rekindle plugin "
                            "running on this node?")
        self.engine.quiesce(self.http)
        self.events.append("quiesced")
        write_file(self.control / READY, f"{self.engine.name}\n")
        self.events.append("ready")
        log(f"{self.engine.name} quiesced; {READY} written, waiting for the checkpoint")
        found = self._wait("checkpoint", self.checkpoint_timeout, self._outcome_file)
        outcome = {RESTORE_COMPLETE: Outcome.RESTORED, SNAPSHOT_COMPLETE: Outcome.CHECKPOINTED,
                   CHECKPOINT_FAILED: Outcome.FAILED, None: Outcome.TIMED_OUT}[found]
        self.events.append(outcome.value)
        if outcome is Outcome.CHECKPOINTED and not self.resume_after_checkpoint:
            return outcome  # the source ends; its CUDA state may still be checkpointed: do not touch
        self.engine.resume(self.http)
        self.events.append("resumed")
        self._serve()
        return outcome


# --- the supervisor ----------------------------------------------------------------------------------

def _stop_engine(proc: "subprocess.Popen[bytes]", grace: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def run(args: argparse.Namespace) -> int:
    engine: Engine = (ByPlugin(args.engine) if args.release == "plugin"
                      else VLLM(keep_weights_on_gpu=not args.release_weights) if args.engine == "vllm"
                      else SGLang(tags=tuple(args.release_tags.split(","))))
    got_signal: list = []
    proc = subprocess.Popen(args.command)

    def on_signal(sig: int, _frame: object) -> None:
        got_signal.append(sig)
        if proc.poll() is None:
            proc.send_signal(sig)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    life = Lifecycle(engine=engine, http=Http(f"http://{args.host}:{args.port}"), control=control_dir(),
                     source=bool(os.environ.get(ROLE_ENV)), marker=serving_marker(),
                     ready_timeout=args.ready_timeout, checkpoint_timeout=args.checkpoint_timeout,
                     resume_after_checkpoint=args.after_checkpoint == "serve",
                     stopped=lambda: bool(got_signal) or proc.poll() is not None)
    try:
        outcome = life.run()
    except Stopped as e:
        log(f"stopped while waiting for {e}")
        rc = _stop_engine(proc, args.stop_grace)
        checkpointed = life.control is not None and os.path.lexists(life.control / SNAPSHOT_COMPLETE)
        return 0 if checkpointed and args.after_checkpoint == "exit" else _status(rc)
    except (HookError, OSError) as e:
        log(f"error: {e}; stopping {engine.name}")
        _stop_engine(proc, args.stop_grace)
        return 2
    log(f"{engine.name}: {outcome.value}")
    if outcome is Outcome.CHECKPOINTED and args.after_checkpoint == "exit":
        _stop_engine(proc, args.stop_grace)
        return 0
    if outcome in (Outcome.FAILED, Outcome.TIMED_OUT):
        reason = ""
        if outcome is Outcome.FAILED and life.control is not None:
            try:
                reason = (life.control / CHECKPOINT_FAILED).read_text(errors="replace").strip()[:500]
            except OSError:
                pass
        log(f"no checkpoint ({outcome.value}{': ' + reason if reason else ''}); stopping {engine.name}")
        _stop_engine(proc, args.stop_grace)
        return 1
    return _status(proc.wait())


def probe(_args: argparse.Namespace) -> int:
    return 0 if serving_marker().exists() else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="rekindle_hook.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the engine command and drive it through checkpoint and restore")
    r.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds for the engine to get healthy")
    r.add_argument("--checkpoint-timeout", type=float, default=1800.0,
                   help="seconds a source waits for its checkpoint before it gives up")
    r.add_argument("--after-checkpoint", choices=["exit", "serve"], default="exit")
    r.add_argument("--release", choices=["hook", "plugin"], default="hook",
                   help="who releases and takes back the engine's memory: this hook, or the plugin through "
                        "the pod's rekindle.dev/before-checkpoint and after-restore annotations")
    r.add_argument("--release-weights", action="store_true",
                   help="vLLM: leave the weights in host memory too (level-1 sleep as is)")
    r.add_argument("--release-tags", default="kv_cache", help="SGLang: tags to release (comma-separated)")
    r.add_argument("--stop-grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- the engine's command")
    r.set_defaults(func=run)
    p = sub.add_parser("probe", help="exit 0 once the engine serves")
    p.set_defaults(func=probe)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        if args.command[:1] == ["--"]:
            args.command = args.command[1:]
        if not args.command:
            ap.error("run: the engine's command is missing (after --)")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
