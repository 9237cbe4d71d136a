"""The ``rekindle`` command: the NRI plugin and the node operator's tools.

Subcommands: plugin, checkpoint, restore, artifacts (list|inspect|delete|prune), status, doctor,
nri-toggle, cuda-checkpoint. Every command that prints takes ``-o text|json|yaml`` (``--json`` is
``-o json``), except cuda-checkpoint, which keeps NVIDIA's flags and prints one word, and
nri-toggle (text or JSON). YAML is the JSON document in YAML (``nri_plugin.yamlout``).
Exit codes: 0 success, 1 failure, 2 usage error. An error is one line on stderr
(``rekindle: error: ...``; a usage error also shows the usage); with ``-o json`` (``yaml``) it is
one JSON (YAML) object on stdout instead, ``{"error": "...", "exit_code": N}``, so that a script
reading stdout always gets a document.

``checkpoint`` and ``restore`` show their live progress (phase, bytes, rate) on one line of stderr
while it is a terminal, and nothing when it is not. ``status --watch`` prints the table again each
time it changes, polling every ``--interval`` seconds, until Ctrl-C (exit 0).
Log lines: warnings and errors only, except for ``plugin`` (info); ``-v`` (or
``$REKINDLE_LOG_LEVEL=debug``) shows every level and adds tracebacks.

``restore`` checks before it touches anything, cheapest first: its arguments, the key, the
artifact (present, signed), then the target (a container the plugin prepared, whose init waits
in restore mode: ``restore_target``); only then does it start the engine (CUDA, containerd),
which checks the node, the image and privileges as the plugin does.

The HMAC key: every command uses the plugin's key, ``--hmac-key-file``, else
``$REKINDLE_HMAC_KEY_FILE`` (the chart sets it in the plugin's pod), else ``<state-dir>/hmac.key``.
Only ``plugin --create-key`` may create it; anywhere else a missing key is one error line.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, TextIO

from runtime.errors import KeyMissing, RekindleError

from . import logs

if TYPE_CHECKING:
    from runtime.status import Progress
    from runtime.store import ArtifactStore

    from .config import Settings

log = logging.getLogger("rekindle")

KEY_ENV = "REKINDLE_HMAC_KEY_FILE"  # the chart sets it in the plugin's pod, so every command finds the key
# containerd's identifier rule (its "identifiers" package); CRI ids are 64 hex digits.
CONTAINER_ID = re.compile(r"[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*")
MAX_CONTAINER_ID = 76
WATCH_MIN, WATCH_MAX = 0.1, 60.0  # status --watch poll interval bounds, seconds


class UsageError(SystemExit):
    """A bad command line: ``prog`` is the (sub)command, ``usage`` its usage text. A SystemExit
    with status 2, as argparse's own, for callers of ``build_parser`` other than main()."""

    def __init__(self, prog: str, message: str, usage: str = "") -> None:
        super().__init__(2)
        self.prog = prog
        self.message = message
        self.usage = usage


# Set by main(): usage errors are raised for it to report (JSON under -o json); any other caller
# of build_parser() gets argparse's own behaviour (usage and error on stderr, exit 2).
_RAISE_USAGE: contextvars.ContextVar[bool] = contextvars.ContextVar("rekindle_raise_usage", default=False)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors main() reports itself. Subparsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        if not _RAISE_USAGE.get():
            super().error(message)
        raise UsageError(self.prog, message, usage=self.format_usage())


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format")


def _paths(p: argparse.ArgumentParser) -> None:
    from .config import Settings
    d = Settings()
    p.add_argument("--state-dir", default=d.state_dir, help="Rekindle state dir (default: %(default)s)")
    p.add_argument("--store", default=d.store, help="artifact store root (default: %(default)s)")
    p.add_argument("--hmac-key-file", default=os.environ.get(KEY_ENV, ""),
                   help=f"the plugin's manifest signing key (default: ${KEY_ENV}, else <state-dir>/hmac.key)")
    p.add_argument("--containerd-state", default=d.containerd_state,
                   help="containerd state dir holding task bundles (default: %(default)s)")
    p.add_argument("--containerd-socket", default=d.containerd_socket, help="containerd socket (default: %(default)s)")


def _thp_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-thp", choices=("keep", "always"),
                   default=os.environ.get("REKINDLE_CHECKPOINT_THP", "keep"),
                   help="the node's transparent huge page mode during a CUDA checkpoint: keep it, or "
                        "always (node-wide for those seconds: the driver's host copy then comes in huge "
                        "pages, and the checkpoint is faster) ($REKINDLE_CHECKPOINT_THP, else keep)")


FORMATS = ("text", "json", "yaml")


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=FORMATS, default="text", help="output format")
    p.add_argument("--json", dest="output", action="store_const", const="json", help="same as -o json")


def _json(args: argparse.Namespace) -> bool:
    """Whether the output is a document (JSON or YAML) rather than text."""
    return getattr(args, "output", "text") in ("json", "yaml")


def _render(fmt: str, doc: object, *, indent: int | None = 2, sort_keys: bool = False) -> str:
    if fmt == "yaml":
        from .yamlout import dumps
        return dumps(json.loads(json.dumps(doc, sort_keys=sort_keys))).rstrip("\n")
    return json.dumps(doc, indent=indent, sort_keys=sort_keys)


def _safe(text: str) -> str:
    """``text`` with every control or format character (C0, DEL, C1, bidi overrides) spelled
    ``\\xNN`` / ``\\uNNNN``: store names, owner records and reasons come from the shared store
    or a tenant, and none may move the operator's cursor, retitle the terminal or hide text."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else
                   (f"\\x{ord(ch):02x}" if ord(ch) <= 0xFF else f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF
                    else f"\\U{ord(ch):08x}") for ch in text)


def _say(text: str, file: TextIO | None = None) -> None:
    """A line of text output, made safe for a terminal (``_safe``)."""
    print(_safe(text), file=file)


def _emit(args: argparse.Namespace, doc: object, *, indent: int | None = 2, sort_keys: bool = False) -> None:
    """Print ``doc`` as -o asks: JSON or YAML."""
    print(_render(getattr(args, "output", "json"), doc, indent=indent, sort_keys=sort_keys))


def _cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=os.environ.get("REKINDLE_CACHE_DIR", ""),
                   help="the node cache of verified artifact copies ($REKINDLE_CACHE_DIR, else <state-dir>/cache)")
    p.add_argument("--cache-bytes", type=_cache_bytes, default=os.environ.get("REKINDLE_CACHE_BYTES", "auto"),
                   help="its byte bound: 0 turns it off ($REKINDLE_CACHE_BYTES, else auto: a quarter of the "
                        "node's memory)")
    p.add_argument("--cache-entries", type=_positive, default=os.environ.get("REKINDLE_CACHE_ENTRIES", "8"),
                   help="its entry bound ($REKINDLE_CACHE_ENTRIES, else 8)")
    p.add_argument("--cache-tmpfs", action="store_true", default=os.environ.get("REKINDLE_CACHE_TMPFS", "0") == "1",
                   help="mount a huge=always tmpfs at the cache dir in the plugin's mount namespace "
                        "($REKINDLE_CACHE_TMPFS=1)")


def _names_list(text: str) -> tuple[str, ...]:
    from .prewarm_state import parse_names
    try:
        return tuple(f"{ns}/{n}" for ns, n in parse_names(x for x in text.split(",") if x.strip()))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prewarm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prewarm", type=_names_list, default=os.environ.get("REKINDLE_PREWARM", ""),
                   help="namespace/name,... of artifacts whose node cache entry is written as soon as a version "
                        "is published, besides those whose source pod had rekindle.dev/prewarm ($REKINDLE_PREWARM)")
    p.add_argument("--prewarm-interval", type=float, default=os.environ.get("REKINDLE_PREWARM_INTERVAL", "30"),
                   help="seconds between looks at the store for newly published marked versions; 0: no "
                        "pre-warming ($REKINDLE_PREWARM_INTERVAL, else 30)")


def _restore_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("--restore-path", choices=("auto", "bulk", "stock", "stream"),
                   default=os.environ.get("REKINDLE_RESTORE_PATH", "auto"),
                   help="auto: stream where it pays off (a CUDA tree, or a CPU-only one of 512 MiB or more on "
                        "a node not busy with other restores), else bulk (runtime.route); stream: the tree runs "
                        "right after CRIU and the large page runs are served through userfaultfd, each piece "
                        "verified first (bulk where the node cannot); bulk: they are filled beside CRIU on many "
                        "threads first; stock: CRIU restores every page ($REKINDLE_RESTORE_PATH, else auto)")


def _stream_flags(p: argparse.ArgumentParser) -> None:
    """The streamed path's settings (read from the environment here, never by the engine)."""
    from .config import STREAM_THREADS_ENV, serve_threads_from, warm_rest_from
    p.add_argument("--serve-threads", type=_decimal, default=serve_threads_from(os.environ),
                   help=f"threads that install a streamed restore's bulk pages (${STREAM_THREADS_ENV}, else "
                        "--fill-threads when set, which has always sized both, else 12; 0 serves faults only, "
                        "a measurement setting)")
    p.set_defaults(warm_rest=warm_rest_from(os.environ))  # $REKINDLE_STREAM_WARM_REST=1: no flag, a measurement


def _settings(args: argparse.Namespace) -> Settings:
    """The settings a command's flags give (a setting without a flag of this command keeps its
    default); the enums are parsed here (config.Settings.from_flags)."""
    from .config import Settings
    return Settings.from_flags(vars(args))


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    from .policy import parse_decimal
    num = parse_decimal(text[:-1])
    if text[-1:] not in units or num is None:
        raise argparse.ArgumentTypeError(f"want a number and s, m, h or d, e.g. 7d: {text!r}")
    return num * units[text[-1:]]


def _decimal(text: str) -> int:
    """argparse type: ASCII digits only (``int`` also takes '١٢', ' 12' and '1_0')."""
    from .policy import parse_decimal
    value = parse_decimal(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return value


def _size(text: str) -> int:
    from .policy import parse_size
    value = parse_size(text)
    if not value:
        raise argparse.ArgumentTypeError(f"want bytes, or a number with Ki, Mi, Gi or Ti: {text!r}")
    return value


def _cache_bytes(text: str) -> int:
    return -1 if text == "auto" else 0 if text == "0" else _size(text)


def _positive(text: str) -> int:
    value = _decimal(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .config import Settings
    parser = _Parser(
        prog="rekindle",
        description="Start GPU inference pods warm: checkpoint a loaded pod, restore new pods from it "
                    "(containerd NRI plugin + node tools).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plugin", help="run the NRI plugin (the DaemonSet's command)")
    _common(p); _paths(p)
    p.add_argument("--socket-path", default=Settings().socket_path, help="NRI socket (default: %(default)s)")
    p.add_argument("--name", default="rekindle", help="plugin name (default: %(default)s)")
    p.add_argument("--idx", default="50", help="plugin index, two digits (default: %(default)s)")
    p.add_argument("--init-binary", default="", help="rekindle-init to install into <state-dir>/bin")
    p.add_argument("--create-key", action="store_true",
                   help="create the HMAC key (32 random bytes, 0600) when it is absent; off under the chart, "
                        "whose Secret provides the key")
    p.add_argument("--max-parallel", type=_positive, default=os.environ.get("REKINDLE_MAX_PARALLEL", "2"),
                   help="checkpoints/restores at once ($REKINDLE_MAX_PARALLEL, else 2; a node restoring one pod "
                        "per GPU at once wants one per GPU)")
    p.add_argument("--max-probes-per-pod", dest="probes_per_pod", type=_decimal, default=1,
                   help="ready-probes of one pod at once (default: %(default)s)")
    p.add_argument("--max-probes", dest="probes_per_node", type=_decimal, default=16,
                   help="ready-probes of the node at once (default: %(default)s)")
    # A string default goes through ``type`` too: a bad $REKINDLE_RESTORE_TIMEOUT is a usage error.
    p.add_argument("--restore-timeout", type=_decimal, default=os.environ.get("REKINDLE_RESTORE_TIMEOUT", "1800"),
                   help="default rekindle.dev/restore-timeout, seconds ($REKINDLE_RESTORE_TIMEOUT, else 1800)")
    _restore_path(p)
    p.add_argument("--max-layer-bytes", type=_size, default=8 << 30,
                   help="cap on a checkpoint's writable layer (and on one a restore applies); "
                        "rekindle.dev/max-layer-size may lower it per pod (default: 8Gi)")
    p.add_argument("--bulk-min-run", type=_size, default=os.environ.get("REKINDLE_BULK_MIN_RUN", "4Ki"),
                   help="at a checkpoint, private anonymous page runs at least this long move beside "
                        "CRIU and are filled on many threads at a restore ($REKINDLE_BULK_MIN_RUN, else "
                        "4Ki: all of them)")
    p.add_argument("--fill-threads", type=_decimal, default=os.environ.get("REKINDLE_FILL_THREADS", "0"),
                   help="threads that fill a restore's bulk pages ($REKINDLE_FILL_THREADS, else 0: one "
                        "per core, up to 16); on the streamed path, the install threads unless "
                        "--serve-threads is given")
    _stream_flags(p)
    p.add_argument("--cuda-parallel", type=_decimal, default=os.environ.get("REKINDLE_CUDA_PARALLEL", "0"),
                   help="CUDA driver sequences (a restore's restore and unlock, a checkpoint's lock and "
                        "checkpoint) run at once, each on its own thread ($REKINDLE_CUDA_PARALLEL, else 0: as "
                        "many as --max-parallel; 1: one at a time)")
    _cache_flags(p)
    p.add_argument("--map-ranges", choices=("driver", "all", "none"), default=os.environ.get("REKINDLE_MAP", "driver"),
                   help="what a restore from the node cache maps instead of copying: driver (the CUDA "
                        "driver's host copy), all (every large private anonymous range: it then reads the "
                        "cached bytes back after MADV_DONTNEED, not zeros) or none ($REKINDLE_MAP, else driver)")
    _prewarm_flags(p)
    _thp_flag(p)
    p.add_argument("--capture-timeout", type=_positive, default=600,
                   help="seconds a checkpoint may spend capturing the writable layer (default: %(default)s)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   default=os.environ.get("REKINDLE_PREFETCH", "1") != "0",
                   help="do not read a restore's artifact ahead from RunPodSandbox on ($REKINDLE_PREFETCH=0)")
    p.add_argument("--metrics-port", type=_decimal, default=9464,
                   help="port of /metrics, /readyz and /healthz; 0 turns the endpoint off (default: %(default)s)")
    p.add_argument("--metrics-address", default="0.0.0.0", help="address to serve them on (default: %(default)s)")
    p.add_argument("--events", action="store_true",
                   help="report outcomes to Kubernetes: Events on the pod and the pod condition "
                        "rekindle.dev/Restored (in-cluster service account, or --kubeconfig)")
    p.add_argument("--kubeconfig", default="", help="with --events: a kubeconfig file instead of the service account")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="this node's Kubernetes name, for Events ($NODE_NAME)")
    p.set_defaults(func=cmd_plugin)

    p = sub.add_parser("checkpoint", help="checkpoint a running container (its init must be in source mode)")
    _common(p); _paths(p)
    p.add_argument("--container-id", required=True)
    p.add_argument("--namespace", required=True, help="Kubernetes namespace the artifact belongs to")
    p.add_argument("--name", required=True, help="artifact name")
    p.add_argument("--exit", action="store_true", help="stop the source workload afterwards")
    _thp_flag(p)
    _output(p)
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("restore", help="restore an artifact into a waiting container (init in restore mode)")
    _common(p); _paths(p)
    p.add_argument("--container-id", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True)
    _restore_path(p)
    _stream_flags(p)
    _output(p)
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("artifacts", help="list, inspect or delete artifacts in the store")
    asub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, helptext in (("list", "list artifacts (signatures checked)"),
                             ("inspect", "show an artifact's manifest"), ("delete", "delete an artifact"),
                             ("prune", "remove old artifacts, old versions and leftovers")):
        ap = asub.add_parser(action, help=helptext)
        _common(ap); _paths(ap)
        ap.add_argument("--namespace", default=None if action in ("list", "prune") else "default")
        if action == "list":
            _cache_flags(ap)  # what this node's cache holds
        if action in ("inspect", "delete"):
            ap.add_argument("name")
        if action == "inspect":
            ap.add_argument("--verify", action="store_true", help="also check every file's digest")
        if action == "list":
            ap.add_argument("--all", action="store_true",
                            help="also staging dirs, trash and unreferenced versions, with size and owner")
        if action == "delete":
            ap.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                            help="wait this long for restores reading it to finish (default: refuse)")
        if action == "prune":
            ap.add_argument("--older-than", type=_duration, default=None, metavar="AGE",
                            help="delete artifacts published longer ago than AGE (e.g. 7d, 12h)")
            ap.add_argument("--keep-last", type=int, default=None, metavar="N",
                            help="keep only the newest N versions of each name")
            ap.add_argument("--leftovers", action="store_true",
                            help="also sweep abandoned staging dirs, trash and unreferenced versions")
        _output(ap)
        ap.set_defaults(func=cmd_artifacts)

    p = sub.add_parser("status", help="what Rekindle did with each annotated container on this node, "
                                      "and the live progress of running checkpoints and restores")
    _common(p); _paths(p)
    _output(p)
    p.add_argument("-w", "--watch", action="store_true", help="print again on every change, until Ctrl-C")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="SECONDS",
                   help=f"with --watch: seconds between polls, {WATCH_MIN}..{WATCH_MAX} (default: %(default)s)")
    p.add_argument("--watch-count", type=_positive, default=0, help=argparse.SUPPRESS)  # polls, then stop (tests)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("doctor", help="check this node's prerequisites (connects to NRI and containerd)")
    _common(p); _paths(p)
    p.add_argument("--socket-path", default=Settings().socket_path, help="NRI socket (default: %(default)s)")
    p.add_argument("--containerd-config", default=Settings().containerd_config,
                   help="containerd's config file, checked for NRI (default: %(default)s)")
    _cache_flags(p)  # the plugin's, to report the cache it uses
    _output(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("nri-toggle", add_help=False,
                       help="switch NRI on in a containerd config (v2 for 1.7, v3 for 2.x)")
    p.set_defaults(func=cmd_passthrough, target="nri_plugin.node.toggle")

    p = sub.add_parser("cuda-checkpoint", add_help=False,
                       help="NVIDIA cuda-checkpoint compatible tool (driver API, no extra binary)")
    p.set_defaults(func=cmd_passthrough, target="nri_plugin.cuda_checkpoint")
    return parser


# ---------------------------------------------------------------------------- commands
def cmd_plugin(args: argparse.Namespace) -> int:
    from .agent import run_plugin
    settings = _settings(args)
    settings.check()
    if not settings.cuda_parallel:
        settings = dataclasses.replace(settings, cuda_parallel=args.max_parallel)
    return run_plugin(settings, max_parallel=args.max_parallel)


def _check_names(args: argparse.Namespace) -> None:
    """The arguments that name things, checked before anything is read or asked."""
    from runtime import names
    cmd = f"rekindle {args.command}"
    if not names.is_dns_label(args.namespace):
        raise UsageError(cmd, f"--namespace {args.namespace!r} is not a Kubernetes namespace name")
    if not names.is_artifact_name(args.name):
        raise UsageError(cmd, f"--name {args.name!r} is not an artifact name (lower-case letters, digits, "
                              "'-' and '.', at most 63)")
    if len(args.container_id) > MAX_CONTAINER_ID or not CONTAINER_ID.fullmatch(args.container_id):
        raise UsageError(cmd, f"--container-id {args.container_id!r} is not a containerd container id")


class TerminalProgress:
    """The engine's progress as one line on a terminal, rewritten in place (``\\r``, erase line);
    nothing at all when ``stream`` is not a terminal. Throttled by ``ProgressRecorder``, which
    also works out the rate; ``close`` ends the line."""

    INTERVAL = 0.2

    def __init__(self, stream: TextIO, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        from .progress import ProgressRecorder
        self.stream = stream
        self.live = bool(getattr(stream, "isatty", lambda: False)())
        self._wall = wall
        self._shown = False
        self._recorder = ProgressRecorder(self._show, interval=self.INTERVAL, clock=clock, wall=wall)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.live:
            self._recorder(phase, done, total)

    def _show(self, p: Progress) -> None:
        self.stream.write("\r\x1b[K" + _progress(p, now=self._wall()))
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from .agent import checkpoint_once
    _check_names(args)
    t0 = time.monotonic()
    live = TerminalProgress(sys.stderr)
    try:
        timings = checkpoint_once(_settings(args), args.container_id, args.namespace, args.name,
                                  exit_after=args.exit, progress=live if live.live else None)
    finally:
        live.close()
    total = time.monotonic() - t0
    if _json(args):
        _emit(args, {"namespace": args.namespace, "name": args.name, "seconds": round(total, 3),
                     "timings": timings})
        return 0
    print(f"published {args.namespace}/{args.name} in {total:.2f}s")
    for phase, secs in timings.items():
        print(f"  {phase:<24} {secs:8.2f}s")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from runtime.store import ArtifactStore

    from . import restore_target
    _check_names(args)
    settings = _settings(args)
    settings.check()
    with ArtifactStore(settings.store).open(args.namespace, args.name, _key(settings)):
        pass  # there, and signed with the plugin's key
    # Before anything touches the container: is it a target the plugin prepared?
    target = restore_target.check(settings.containerd_state, settings.state_dir, args.container_id)
    from .agent import restore_once  # the engine: CUDA, containerd, the node's facts
    t0 = time.monotonic()
    live = TerminalProgress(sys.stderr)
    try:
        timings = restore_once(settings, args.container_id, args.namespace, args.name, image=target.image,
                               progress=live if live.live else None)
    finally:
        live.close()
    total = time.monotonic() - t0
    if _json(args):
        _emit(args, {"namespace": args.namespace, "name": args.name, "container_id": args.container_id,
                     "seconds": round(total, 3), "timings": timings})
        return 0
    print(f"restored {args.namespace}/{args.name} into {args.container_id[:12]} in {total:.2f}s")
    for phase, secs in timings.items():
        print(f"  {phase:<24} {secs:8.2f}s")
    return 0


def _key(settings: Settings) -> bytes:
    """The plugin's key, read only: no command but ``plugin --create-key`` makes one."""
    from runtime.store import read_key
    return read_key(settings.key_path)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def cmd_artifacts(args: argparse.Namespace) -> int:
    from runtime.store import ArtifactStore
    from runtime.store import gc as store_gc
    settings = _settings(args)
    store = ArtifactStore(settings.store)
    if args.action == "list":
        return _list(store, _key(settings), args)
    if args.action == "delete":
        store.delete(args.namespace, args.name, wait=args.wait)
        if _json(args):
            _emit(args, {"deleted": f"{args.namespace}/{args.name}"}, indent=None)
        else:
            _say(f"deleted {args.namespace}/{args.name}")
        return 0
    if args.action == "prune":
        if args.older_than is None and args.keep_last is None and not args.leftovers:
            raise UsageError("rekindle artifacts prune", "say what to prune: --older-than, --keep-last or --leftovers")
        done = store_gc.prune(store, args.namespace, older_than=args.older_than, keep_last=args.keep_last)
        swept = store_gc.sweep(store, args.namespace) if args.leftovers else []
        if _json(args):
            _emit(args, {"removed": done, "swept": [f"{r.namespace}/{r.entry}" for r in swept]})
        else:
            for item in done:
                _say(f"removed {item}")
            for r in swept:
                _say(f"swept {r.kind} {r.namespace}/{r.entry} ({r.bytes / 2**20:.1f} MiB)")
            if not done and not swept:
                _say("nothing to prune")
        return 0
    with store.open(args.namespace, args.name, _key(settings)) as artifact:
        if args.verify:
            artifact.verify_files()
        doc = json.loads(artifact.manifest.to_json())
        m = artifact.manifest
    if _json(args):
        _emit(args, doc, sort_keys=True)
        return 0
    size = sum(f.size for f in m.files)
    _say(f"{m.namespace}/{m.name}  created {m.created_at}  generation {m.generation}  {len(m.files)} files, "
          f"{size / 2**20:.1f} MiB")
    _say(f"  source   {m.source.pod} ({m.source.container}), image {m.source.image}")
    _say(f"  node     {m.node.hostname} kernel {m.node.kernel} {m.node.arch}, CRIU {m.criu.version}")
    if m.cuda:
        _say(f"  cuda     driver {m.cuda.driver_version}, GPUs {', '.join(g.name for g in m.cuda.gpus)}")
    _say(f"  security uid {m.security.uid} caps {len(m.security.capabilities)} seccomp {m.security.seccomp}")
    if m.host_files is None:
        _say("  host     files from bind mounts not recorded (format 2): checked by size only")
    else:
        _say(f"  host     {len(m.host_files)} files from bind mounts, "
              f"{sum(h.size for h in m.host_files) / 2**20:.1f} MiB, checked by digest")
    _say("  timings  " + ", ".join(f"{k} {v:.2f}s" for k, v in m.timings.items()))
    _say("  verified: all file digests match" if args.verify else "  (signature ok; --verify checks digests)")
    return 0


def _cached(args: argparse.Namespace) -> dict[tuple[str, str], int]:
    """(label, version) -> bytes of each entry of this node's cache."""
    from runtime.pages.nodecache import NodeCache

    from .cache import cache_dir
    return {(e.label, e.version): e.bytes for e in NodeCache(cache_dir(_settings(args)), 1).entries()}


def _list(store: ArtifactStore, key: bytes, args: argparse.Namespace) -> int:
    rows = store.list(args.namespace, key=key)
    from runtime.store import gc as store_gc
    extra = store_gc.leftovers(store, args.namespace) if args.all else []
    cached = _cached(args)
    from .prewarm import describe, read_states
    warming = {str(p.get("artifact")): p for p in read_states(_settings(args).state_dir)}
    if _json(args):
        doc: list[dict[str, object]] = [
               {"namespace": r.namespace, "name": r.name, "ok": r.problem is None, "problem": r.problem,
                "version": r.version or None,
                "generation": r.manifest.generation if r.manifest else None,
                "created_at": r.manifest.created_at if r.manifest else None,
                "bytes": sum(f.size for f in r.manifest.files) if r.manifest else None,
                "stored_bytes": r.stored_bytes if r.manifest else None,
                "cached_bytes": cached.get((f"{r.namespace}/{r.name}", r.version or ""), 0),
                "prewarm": warming.get(f"{r.namespace}/{r.name}")}
               for r in rows]
        if args.all:
            doc += [{"namespace": x.namespace, "name": x.entry, "kind": x.kind, "bytes": x.bytes,
                     "age_seconds": round(x.age, 1),
                     "owner": (f"{x.owner.node} pid {x.owner.pid}" if x.owner else None)} for x in extra]
        _emit(args, doc)
        return 0
    for r in rows:
        if r.manifest is None:
            _say(f"{r.namespace}/{r.name}  BAD: {r.problem}")
        else:
            m = r.manifest
            # what it takes in the store (a bulk file's holes take nothing), else its files' sizes
            size = (r.stored_bytes or sum(f.size for f in m.files)) / 2**20
            here = cached.get((f"{r.namespace}/{r.name}", r.version or ""), 0)
            _say(f"{r.namespace}/{r.name}  {m.created_at}  {size:.1f} MiB  from {m.source.pod or '?'}"
                  f"  image {m.source.image or '?'}" + ("  cuda" if m.cuda else "")
                  + (f"  cached on this node ({here / 2**20:.1f} MiB)" if here else "")
                  + (f"  pre-warm: {describe(warming[r.namespace + '/' + r.name])}"
                     if r.namespace + "/" + r.name in warming else ""))
    for x in extra:
        owner = f"  owner {x.owner.node} pid {x.owner.pid}" if x.owner else ""
        _say(f"{x.namespace}/{x.entry}  {x.kind}  {x.bytes / 2**20:.1f} MiB  age {_age(x.age)}{owner}")
    if not rows and not extra:
        _say("no artifacts")
    return 0


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _progress(p: Progress, now: float | None = None) -> str:
    """``fill 3.1 GiB of 17.6 GiB (17%), 1.8 GiB/s, 2s`` for a running phase."""
    text = p.phase
    if p.bytes_total:
        text += f" {_bytes(p.bytes_done)} of {_bytes(p.bytes_total)} ({100 * p.bytes_done // p.bytes_total}%)"
    if p.rate:
        text += f", {_bytes(p.rate)}/s"
    if p.phase_started_at:
        text += f", {max((time.time() if now is None else now) - p.phase_started_at, 0):.0f}s"
    return text


def status_view(state_dir: str, fmt: str) -> str:
    """What ``rekindle status`` prints, as one string (no final newline)."""
    from runtime.status import StatusBook
    rows = StatusBook(state_dir).list()
    if fmt != "text":
        return _render(fmt, [json.loads(r.to_json()) for r in rows])
    from .prewarm import describe, read_states
    warming = [f"pre-warm {p.get('artifact')}  {describe(p)}" for p in read_states(state_dir)]
    if not rows:
        return "\n".join(_safe(line) for line in ["no annotated containers seen", *warming])
    lines = []
    for r in rows:
        timing = ", ".join(f"{k} {v:.2f}s" for k, v in r.timings.items())
        live = f"  <{_progress(r.progress)}>" if r.progress is not None and not r.phase.final else ""
        size = f"  {_bytes(r.bytes)}" if r.bytes else ""
        lines.append(f"{r.namespace}/{r.pod}:{r.container}  {r.role or '-'} {r.artifact or '-'}  {r.phase.value}"
                     + live + size + (f"  ({r.reason})" if r.reason else "") + (f"  [{timing}]" if timing else "")
                     + (f"  note: {r.note}" if r.note else ""))
    return "\n".join(_safe(line) for line in lines + warming)


def watch(view: Callable[[], str], out: TextIO, *, interval: float, count: int = 0,
          sleep: Callable[[float], None] = time.sleep, fmt: str = "text") -> int:
    """Print ``view()`` now and again each time it changes, polling every ``interval`` seconds;
    ``count`` > 0 stops after that many polls (tests). Ctrl-C ends it with status 0."""
    last: str | None = None
    polls = 0
    try:
        while True:
            text = view()
            if text != last:
                if last is not None and fmt == "yaml":
                    print("---", file=out)
                elif last is not None and fmt == "text":
                    print(file=out)
                print(text, file=out, flush=True)
                last = text
            polls += 1
            if count and polls >= count:
                return 0
            sleep(interval)
    except KeyboardInterrupt:
        return 0


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not WATCH_MIN <= value <= WATCH_MAX:  # also NaN
        raise argparse.ArgumentTypeError(f"want seconds in {WATCH_MIN}..{WATCH_MAX}: {text!r}")
    return value


def cmd_status(args: argparse.Namespace) -> int:
    fmt = getattr(args, "output", "text")
    if args.watch:
        return watch(lambda: status_view(args.state_dir, fmt), sys.stdout, interval=args.interval,
                     count=args.watch_count, fmt=fmt)
    print(status_view(args.state_dir, fmt))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from runtime.doctor import check_cache

    from .cache import cache_bytes, cache_dir
    from .preflight import run_checks
    settings = _settings(args)
    checks = [*run_checks(settings), check_cache(cache_dir(settings), cache_bytes(settings))]
    if _json(args):
        _emit(args, [c.__dict__ for c in checks])
    else:
        for c in checks:
            mark = "ok" if c.ok else ("FAIL" if c.required else "warn")
            _say(f"[{mark:>4}] {c.name}: {c.detail}")
    return 0 if all(c.ok or not c.required for c in checks) else 1


def cmd_passthrough(args: argparse.Namespace) -> int:
    import importlib
    mod = importlib.import_module(args.target)
    main: Callable[[list[str]], int] = mod.main
    return main(args.rest)


# ---------------------------------------------------------------------------- entry point
def _describe(exc: RekindleError, args: argparse.Namespace) -> str:
    """The one error line; a missing key says which key, and how to point at it."""
    if not isinstance(exc, KeyMissing):
        return str(exc)
    if args.command != "plugin":
        return f"no HMAC key at {exc.path} (the plugin's key; set --hmac-key-file or {KEY_ENV})"
    if args.create_key:
        return str(exc)
    return f"{exc} (pass --create-key to create one, or mount the chart's Secret there)"


def _wants_format(argv: Sequence[str]) -> str:
    """The output format the command line asks for, read before (and whether or not) it parses."""
    fmt = "text"
    for i, arg in enumerate(argv):
        if arg == "--json":
            fmt = "json"
        for name in ("json", "yaml"):
            if arg in (f"-o{name}", f"--output={name}") or (arg in ("-o", "--output") and argv[i + 1:i + 2] == [name]):
                fmt = name
    return fmt


def _fail(message: str, code: int, fmt: str, prog: str = "rekindle", usage: str = "") -> int:
    """The one error report: a JSON (YAML) object on stdout under -o json (yaml), else a line on stderr."""
    if fmt != "text":
        print(_render(fmt, {"error": message, "exit_code": code}, indent=None))
    else:
        _say(f"{usage}{prog}: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Pass-through subcommands own their flags (--help included) and their errors.
    if argv and argv[0] in ("nri-toggle", "cuda-checkpoint"):
        args = argparse.Namespace(func=cmd_passthrough, rest=argv[1:], verbose=False,
                                  target={"nri-toggle": "nri_plugin.node.toggle",
                                          "cuda-checkpoint": "nri_plugin.cuda_checkpoint"}[argv[0]])
        logs.setup(verbose=False, fmt="text")
        logging.getLogger().setLevel(logging.WARNING)
        return int(args.func(args) or 0)
    fmt = _wants_format(argv)
    token = _RAISE_USAGE.set(True)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _fail(exc.message, 2, fmt, exc.prog, exc.usage)
    finally:
        _RAISE_USAGE.reset(token)
    verbose = args.verbose or os.environ.get("REKINDLE_LOG_LEVEL", "").lower() == "debug"
    logs.setup(verbose=verbose, fmt=args.log_format)
    if not verbose and args.command != "plugin":
        logging.getLogger().setLevel(logging.WARNING)  # a tool's output is its result, not its progress
    fmt = getattr(args, "output", "text")
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        return _fail(exc.message, 2, fmt, exc.prog, exc.usage)
    except (RekindleError, OSError) as exc:
        if args.verbose:
            log.exception("failed")
        return _fail(_describe(exc, args) if isinstance(exc, RekindleError) else str(exc), 1, fmt)
    except KeyboardInterrupt:
        return 130
