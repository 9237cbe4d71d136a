"""The NRI plugin stub: connection, registration, Configure/Synchronize, event dispatch.

A plugin is a plain object implementing only the handlers it needs (as in containerd/nri's Go
stub); the event mask is built from the handlers present and capped to what the runtime's NRI
version accepts. Handler names and signatures:

    configure(config: str, runtime: RuntimeInfo) -> None
    synchronize(pods, containers) -> list[ContainerUpdate]
    create_container(pod, container) -> CreateContainerResponse | Reply[CreateContainerResponse]
    update_container(pod, container, resources) -> list[ContainerUpdate]
    stop_container(pod, container) -> list[ContainerUpdate]
    run_pod_sandbox / stop_pod_sandbox / remove_pod_sandbox(pod) -> None
    post_create_container / start_container / post_start_container /
    post_update_container / remove_container(pod, container) -> None
    on_disconnect(error) -> None
    on_handler_error(handler: str, pod | None, container | None, exc) -> None   (optional hook)

Handlers may be plain functions (run in the stub's own small thread pool, never Python's
default executor) or coroutines.

Fail-open boundary: every reply is sent within the runtime's request timeout minus a safety
margin, and a handler can never turn into an error status (which would fail the pod). When a
handler raises, or overruns its budget (``HandlerOverrun``), the stub logs it with the pod and
container, answers with an empty reply (no adjustment: the container starts as it was asked
for), and then hands the exception to ``on_handler_error`` on the event loop, so the plugin
can record why and undo what it prepared. An overrun handler is not waited for: a sync one
still queued never runs, a running one finishes in its thread, a coroutine is cancelled.

Late results never take hold: a handler whose effects must match what the runtime was told
returns ``Reply(message, commit)``; the stub runs ``commit`` on the event loop only when it is
about to send that very message (no await between the two), never for an overrun, failed or
disconnected call. ``commit`` must be quick and must not block.

Lifecycle: ``run()`` connects (socket path, or the fd a runtime passes to a pre-launched plugin),
registers, serves until the runtime closes the connection, then reconnects with capped
exponential backoff (containerd restarts drop every plugin; NRI never reconnects on its own).
The runtime re-sends Configure and Synchronize after each registration.

Observers (``StubObserver``: readiness, metrics) hear the connection state (registered,
synchronized, lost) and each handler's time to reply and failure kind, on the event loop;
they must not block. Logs: each handler runs with its event, pod, namespace and container bound
to the log context (``nri_plugin.logs``), so every line it logs carries them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from runtime.containerd.defaults import DEFAULT_SOCKET
from runtime.errors import RekindleError

from . import logs
from .events import Event, RuntimeInfo, describe_mask, event_mask
from .handler_types import (
    CONFIGURE,
    DISCONNECT,
    HANDLER_ERROR,
    REQUEST_HANDLERS,
    SHUTDOWN,
    STATE_HANDLERS,
    SYNCHRONIZE,
    EventHandler,
    subscribed_events,
)
from .proto import nri_api_pb2 as api
from .transport.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxTrunk
from .transport.rpc_errors import Code, ConnectionClosed, LocalProtocolError, RpcError, TransportError
from .transport.ttrpc import MAX_MESSAGE, Handler, TtrpcClient, TtrpcServer

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_REQUEST_TIMEOUT = 2.0
# Time kept back from the runtime's deadline for serialisation, the socket and scheduling.
REPLY_MARGIN = 0.4
# A reply must fit one ttrpc message with its envelope (status, field tags).
MAX_REPLY = MAX_MESSAGE - 64
# Threads for sync handlers. Handlers are short; more threads would only hide a stall.
HANDLER_WORKERS = 4

M = TypeVar("M")


class StubObserver(Protocol):
    def connection(self, connected: bool, synchronized: bool) -> None: ...
    def handler(self, name: str, seconds: float, failure: str | None) -> None: ...


@dataclass(frozen=True, slots=True)
class Reply(Generic[M]):
    """A handler's reply whose side effects ``commit`` takes hold only if ``message`` is sent."""

    message: M
    commit: Callable[[], None]


class HandlerOverrun(Exception):
    """A handler did not finish within its budget; the runtime got an empty reply instead."""

    def __init__(self, handler: str, budget: float) -> None:
        super().__init__(f"{handler} overran its {budget:.2f}s budget")
        self.handler = handler
        self.budget = budget


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    idx: str

    def __post_init__(self) -> None:
        if len(self.idx) != 2 or not (self.idx.isascii() and self.idx.isdigit()):
            raise ValueError(f"plugin index must be two digits, got {self.idx!r}")
        if not self.name or not all(c.isalnum() or c in "_.+-" for c in self.name):
            raise ValueError(f"plugin name must match [a-zA-Z0-9_.+-]+, got {self.name!r}")


_PODDED = {"CreateContainer": api.CreateContainerRequest, "UpdateContainer": api.UpdateContainerRequest,
           "StopContainer": api.StopContainerRequest, "StateChange": api.StateChangeEvent}


def _log_served(method: str, payload: bytes, seconds: float) -> None:
    """One DEBUG line per request served: its time from decode to reply (the handler's share of
    the runtime's budget, event-loop queueing included) and its pod; bench/fault_drill.py reads
    them."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    pod = "-"
    try:
        msg = _PODDED[method].FromString(payload) if method in _PODDED else None
        if msg is not None:
            pod = f"{msg.pod.namespace}/{msg.pod.name}" if msg.pod.name else "-"
            if isinstance(msg, api.StateChangeEvent):
                method = f"StateChange({Event(msg.event).name})"
    except Exception:  # noqa: BLE001 - labels only
        pass
    log.debug("served %s %s in %.3f ms", method, pod, seconds * 1e3)


class Stub:
    def __init__(
        self,
        plugin: object,
        identity: Identity,
        *,
        socket_path: str = DEFAULT_SOCKET,
        preconnected_fd: int | None = None,
        max_backoff: float = 10.0,
        handler_workers: int = HANDLER_WORKERS,
        observers: Sequence[StubObserver] = (),
    ) -> None:
        self.plugin = plugin
        self.observers = list(observers)
        self.identity = identity
        self.socket_path = socket_path
        self.preconnected_fd = preconnected_fd
        self.max_backoff = max_backoff
        self.runtime: RuntimeInfo | None = None
        self.request_timeout = DEFAULT_REQUEST_TIMEOUT
        self.synchronized = asyncio.Event()
        self.connections = 0
        self._client: TtrpcClient | None = None
        self._sync_pods: list[Any] = []
        self._sync_containers: list[Any] = []
        self._stopping = False
        self._trunk: MuxTrunk | None = None
        self._handler_pool = ThreadPoolExecutor(handler_workers, thread_name_prefix="nri-handler")

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        """Serve, reconnecting with backoff, until ``stop()``."""
        backoff = 0.2
        try:
            while not self._stopping:
                try:
                    error = await self.serve_once()
                    log.warning("disconnected from the runtime: %s", error or "closed")
                    backoff = 0.2 if self.synchronized.is_set() else backoff
                except (OSError, TransportError) as exc:
                    log.info("cannot reach NRI at %s: %s (retrying in %.1fs)", self.socket_path, exc, backoff)
                if self.preconnected_fd is not None or self._stopping:
                    return  # a pre-launched plugin lives and dies with its socket
                self.synchronized.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
        finally:
            # Handlers still running in threads finish on their own; their results are dropped.
            self._handler_pool.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        self._stopping = True
        if self._trunk is not None:
            self._trunk.close(ConnectionClosed("plugin stopping"))

    async def serve_once(self) -> BaseException | None:
        """One connection: register, serve until it closes; returns why it closed."""
        reader, writer = await self._connect()
        trunk = MuxTrunk(reader, writer)
        self._trunk = trunk
        handlers = self._service_handlers()
        server = TtrpcServer(lambda b: trunk.send(PLUGIN_SERVICE_CONN, b), handlers, drain=trunk.drain,
                             observe=_log_served)
        client = TtrpcClient(lambda b: trunk.send(RUNTIME_SERVICE_CONN, b))
        trunk.route(PLUGIN_SERVICE_CONN, server.feed)
        trunk.route(RUNTIME_SERVICE_CONN, client.feed)
        reader_task = asyncio.create_task(trunk.run(), name="nri-mux-reader")
        self._client = client
        self.connections += 1
        try:
            # Serve conn 1 before registering: Configure may arrive before the reply.
            req = api.RegisterPluginRequest(plugin_name=self.identity.name, plugin_idx=self.identity.idx)
            await client.call(RUNTIME_SERVICE, "RegisterPlugin", req.SerializeToString(), timeout=2.0)
            log.info("registered as %s-%s", self.identity.idx, self.identity.name)
            self._notify_connection(True, self.synchronized.is_set())
            return await trunk.wait_closed()
        except RpcError as exc:
            trunk.close(exc)
            raise
        finally:
            client.close(trunk.error or ConnectionClosed("closed"))
            server.cancel()
            reader_task.cancel()
            await asyncio.gather(reader_task, return_exceptions=True)
            self._client = None
            self._trunk = None
            self._notify_connection(False, False)
            await self._call_plugin(DISCONNECT, trunk.error)

    def _notify_connection(self, connected: bool, synchronized: bool) -> None:
        for obs in self.observers:
            try:
                obs.connection(connected, synchronized)
            except Exception:  # noqa: BLE001 - an observer must not take the connection down
                log.exception("stub observer %s failed", type(obs).__name__)

    def _notify_handler(self, name: str, seconds: float, failure: str | None) -> None:
        for obs in self.observers:
            try:
                obs.handler(name, seconds, failure)
            except Exception:  # noqa: BLE001
                log.exception("stub observer %s failed", type(obs).__name__)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.preconnected_fd is not None:
            sock = socket.socket(fileno=self.preconnected_fd)
            return await asyncio.open_unix_connection(sock=sock)
        if not os.path.exists(self.socket_path):
            raise ConnectionClosed(f"no socket at {self.socket_path}")
        return await asyncio.open_unix_connection(self.socket_path)

    # ------------------------------------------------------------------ incoming
    def _service_handlers(self) -> dict[tuple[str, str], Handler]:
        table: dict[str, Handler] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "StateChange": self._state_change,
            "CreateContainer": self._create_container,
            "UpdateContainer": self._update_container,
            "StopContainer": self._stop_container,
        }
        return {(PLUGIN_SERVICE, meth): h for meth, h in table.items()}

    def _budget(self, deadline: float | None) -> float:
        limit = min(deadline, self.request_timeout) if deadline else self.request_timeout
        return max(limit - REPLY_MARGIN, 0.1)

    async def _call_plugin(self, handler: EventHandler[Any], *args: Any, budget: float | None = None,
                           pod: api.PodSandbox | None = None, ctr: api.Container | None = None,
                           encode: Callable[[Any], bytes] = lambda _: b"") -> bytes:
        """Run one plugin handler and encode its reply; if it is absent, raises, overruns
        ``budget`` seconds or returns something unsendable, ``encode(None)`` (the empty reply).
        Raises nothing but CancelledError: this is the fail-open boundary."""
        fn = handler.of(self.plugin)
        if fn is None:
            return encode(None)
        name = handler.name
        started = time.monotonic()
        failure: str | None = None
        # The handler's log lines carry its event, pod and container (in its thread or task).
        ctx = contextvars.copy_context()
        ctx.run(logs.bind, event=name, namespace=pod.namespace if pod is not None else None,
                pod=pod.name if pod is not None else None, container=ctr.name if ctr is not None else None,
                container_id=ctr.id if ctr is not None else None)
        try:
            if inspect.iscoroutinefunction(fn):
                call: asyncio.Future[Any] = asyncio.get_running_loop().create_task(fn(*args), context=ctx)
            else:
                call = asyncio.get_running_loop().run_in_executor(self._handler_pool, ctx.run,
                                                                  functools.partial(fn, *args))
            # asyncio.wait, not wait_for: a TimeoutError raised by the handler is not an overrun.
            done, _ = await asyncio.wait({call}, timeout=budget)
            if not done:
                call.cancel()  # a queued sync handler never starts; a running one is dropped
                raise HandlerOverrun(name, budget or 0.0)
            result = call.result()
            reply = result if isinstance(result, Reply) else None
            data = encode(reply.message if reply else result)
            if len(data) > MAX_REPLY:
                raise LocalProtocolError(f"reply of {len(data)} bytes exceeds {MAX_REPLY}")
            if reply is not None:
                trunk = self._trunk
                if trunk is None or trunk.closed or not trunk.has_room(len(data) + 64):
                    raise ConnectionClosed("the reply cannot be sent: connection closed or not read")
                ctx.run(reply.commit)  # the caller sends ``data`` without awaiting anything first
            return data
        except asyncio.CancelledError:
            failure = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - the fail-open boundary: any error is an empty reply
            failure = "overrun" if isinstance(exc, HandlerOverrun) else "error"
            self._failed(handler, pod, ctr, exc)
            return encode(None)
        finally:
            if handler is not DISCONNECT:
                self._notify_handler(name, time.monotonic() - started, failure)

    def _failed(self, handler: EventHandler[Any], pod: api.PodSandbox | None, ctr: api.Container | None,
                exc: Exception) -> None:
        """Log a failed or overrun handler, then tell the plugin once the empty reply is out."""
        name = handler.name
        where = f"{pod.namespace}/{pod.name}" if pod is not None else "-"
        if ctr is not None:
            where += f":{ctr.name}"
        if isinstance(exc, HandlerOverrun):
            log.error("%s: handler %s overran its %.2fs budget; replying without changes", where, name, exc.budget)
        else:
            log.error("%s: handler %s failed; replying without changes: %s: %s", where, name,
                      type(exc).__name__, exc, exc_info=not isinstance(exc, RekindleError))
        hook = HANDLER_ERROR.of(self.plugin)
        if hook is not None and handler is not DISCONNECT:
            # Scheduled, not called: the empty reply goes out first, in this same loop turn.
            asyncio.get_running_loop().call_soon(self._run_hook, hook, name, pod, ctr, exc)

    @staticmethod
    def _run_hook(hook: Callable[..., Any], name: str, pod: Any, ctr: Any, exc: Exception) -> None:
        try:
            hook(name, pod, ctr, exc)
        except Exception:  # noqa: BLE001 - a failing hook must not take the loop down
            log.exception("on_handler_error for %s failed", name)

    async def _configure(self, payload: bytes, deadline: float | None) -> bytes:
        req = api.ConfigureRequest.FromString(payload)
        has_timeouts = bool(req.request_timeout or req.registration_timeout)
        self.runtime = RuntimeInfo.from_configure(req.runtime_name, req.runtime_version, has_timeouts)
        if req.request_timeout:
            self.request_timeout = req.request_timeout / 1000.0
        mask = event_mask(subscribed_events(self.plugin)) & self.runtime.valid_events
        if not mask:
            raise RpcError(Code.FAILED_PRECONDITION, "plugin subscribes to no event")
        log.info("configured by %s; events %s", self.runtime, describe_mask(mask))
        return await self._call_plugin(CONFIGURE, req.config, self.runtime, budget=self._budget(deadline),
                                       encode=lambda _: api.ConfigureResponse(events=mask).SerializeToString())

    async def _synchronize(self, payload: bytes, deadline: float | None) -> bytes:
        req = api.SynchronizeRequest.FromString(payload)
        self._sync_pods.extend(req.pods)
        self._sync_containers.extend(req.containers)
        if req.more:
            # Split sync (NRI >= 0.8): acknowledge each chunk, updates only in the last reply.
            ack: bytes = api.SynchronizeResponse(more=True).SerializeToString()
            return ack
        pods, containers = self._sync_pods, self._sync_containers
        self._sync_pods, self._sync_containers = [], []
        data = await self._call_plugin(SYNCHRONIZE, pods, containers, budget=self._budget(deadline),
                                       encode=lambda u: api.SynchronizeResponse(update=u or []).SerializeToString())
        self.synchronized.set()
        log.info("synchronized: %d pods, %d containers", len(pods), len(containers))
        self._notify_connection(self._trunk is not None and not self._trunk.closed, True)
        return data

    async def _shutdown(self, payload: bytes, deadline: float | None) -> bytes:
        return await self._call_plugin(SHUTDOWN, budget=self._budget(deadline))

    async def _state_change(self, payload: bytes, deadline: float | None) -> bytes:
        req = api.StateChangeEvent.FromString(payload)
        try:
            event = Event(req.event)
        except ValueError:
            log.debug("ignoring unknown event %d", req.event)
            return b""
        handler = STATE_HANDLERS.get(event)
        if handler is None:
            return b""
        pod_only = event in (Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX, Event.REMOVE_POD_SANDBOX)
        ctr = None if pod_only else req.container
        args = (req.pod,) if ctr is None else (req.pod, ctr)
        return await self._call_plugin(handler, *args, budget=self._budget(deadline), pod=req.pod, ctr=ctr)

    async def _create_container(self, payload: bytes, deadline: float | None) -> bytes:
        req = api.CreateContainerRequest.FromString(payload)
        return await self._call_plugin(
            REQUEST_HANDLERS[Event.CREATE_CONTAINER], req.pod, req.container, budget=self._budget(deadline), pod=req.pod,
            ctr=req.container, encode=lambda r: (r or api.CreateContainerResponse()).SerializeToString())

    async def _update_container(self, payload: bytes, deadline: float | None) -> bytes:
        req = api.UpdateContainerRequest.FromString(payload)
        return await self._call_plugin(
            REQUEST_HANDLERS[Event.UPDATE_CONTAINER], req.pod, req.container, req.linux_resources, budget=self._budget(deadline),
            pod=req.pod, ctr=req.container,
            encode=lambda u: api.UpdateContainerResponse(update=u or []).SerializeToString())

    async def _stop_container(self, payload: bytes, deadline: float | None) -> bytes:
        req = api.StopContainerRequest.FromString(payload)
        return await self._call_plugin(
            REQUEST_HANDLERS[Event.STOP_CONTAINER], req.pod, req.container, budget=self._budget(deadline), pod=req.pod,
            ctr=req.container, encode=lambda u: api.StopContainerResponse(update=u or []).SerializeToString())
