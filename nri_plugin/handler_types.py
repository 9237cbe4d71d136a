"""What a plugin implements: one Protocol per NRI event, as containerd's Go stub asks one
interface per event of a plugin. The stub subscribes to the events whose Protocol the plugin
satisfies and calls the method that Protocol names; a handler may be a plain function (run on
the stub's handler threads) or a coroutine (run on the event loop).

``EventHandler`` ties an event's Protocol to its method, typed: no method is looked up by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

from .events import Event, RuntimeInfo
from .proto import nri_api_pb2 as api


@runtime_checkable
class ConfigureHandler(Protocol):
    def configure(self, config: str, runtime: RuntimeInfo) -> Any: ...


@runtime_checkable
class SynchronizeHandler(Protocol):
    def synchronize(self, pods: list[api.PodSandbox], containers: list[api.Container]) -> Any: ...


@runtime_checkable
class ShutdownHandler(Protocol):
    def shutdown(self) -> Any: ...


@runtime_checkable
class RunPodSandboxHandler(Protocol):
    def run_pod_sandbox(self, pod: api.PodSandbox) -> Any: ...


@runtime_checkable
class StopPodSandboxHandler(Protocol):
    def stop_pod_sandbox(self, pod: api.PodSandbox) -> Any: ...


@runtime_checkable
class RemovePodSandboxHandler(Protocol):
    def remove_pod_sandbox(self, pod: api.PodSandbox) -> Any: ...


@runtime_checkable
class CreateContainerHandler(Protocol):
    def create_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class PostCreateContainerHandler(Protocol):
    def post_create_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class StartContainerHandler(Protocol):
    def start_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class PostStartContainerHandler(Protocol):
    def post_start_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class UpdateContainerHandler(Protocol):
    def update_container(self, pod: api.PodSandbox, ctr: api.Container, resources: api.LinuxResources) -> Any: ...


@runtime_checkable
class PostUpdateContainerHandler(Protocol):
    def post_update_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class StopContainerHandler(Protocol):
    def stop_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class RemoveContainerHandler(Protocol):
    def remove_container(self, pod: api.PodSandbox, ctr: api.Container) -> Any: ...


@runtime_checkable
class DisconnectHandler(Protocol):
    def on_disconnect(self, error: BaseException | None) -> Any: ...


@runtime_checkable
class HandlerErrorHandler(Protocol):
    """Told, after the empty reply went out, that ``handler`` raised or overran."""

    def on_handler_error(self, handler: str, pod: api.PodSandbox | None, ctr: api.Container | None,
                         exc: Exception) -> Any: ...


P = TypeVar("P")


@dataclass(frozen=True)  # no slots: a subscripted Generic sets __orig_class__ on what it makes
class EventHandler(Generic[P]):
    """One handler of a plugin: its Protocol, and how a plugin that satisfies it is called."""

    name: str  # how logs and metrics name the handler: its method's name
    protocol: type  # a runtime_checkable Protocol: mypy takes no Protocol for type[P]
    bind: Callable[[P], Callable[..., Any]]

    def of(self, plugin: object) -> Callable[..., Any] | None:
        """``plugin``'s handler, or None when it has none."""
        if not isinstance(plugin, self.protocol):
            return None
        fn = self.bind(cast(P, plugin))
        return fn if callable(fn) else None


CONFIGURE = EventHandler[ConfigureHandler]("configure", ConfigureHandler, lambda p: p.configure)
SYNCHRONIZE = EventHandler[SynchronizeHandler]("synchronize", SynchronizeHandler, lambda p: p.synchronize)
SHUTDOWN = EventHandler[ShutdownHandler]("shutdown", ShutdownHandler, lambda p: p.shutdown)
DISCONNECT = EventHandler[DisconnectHandler]("on_disconnect", DisconnectHandler, lambda p: p.on_disconnect)
HANDLER_ERROR = EventHandler[HandlerErrorHandler]("on_handler_error", HandlerErrorHandler, lambda p: p.on_handler_error)

# StateChange events and the handler each one calls.
STATE_HANDLERS: dict[Event, EventHandler[Any]] = {
    Event.RUN_POD_SANDBOX: EventHandler[RunPodSandboxHandler]("run_pod_sandbox", RunPodSandboxHandler, lambda p: p.run_pod_sandbox),
    Event.STOP_POD_SANDBOX: EventHandler[StopPodSandboxHandler]("stop_pod_sandbox", StopPodSandboxHandler, lambda p: p.stop_pod_sandbox),
    Event.REMOVE_POD_SANDBOX: EventHandler[RemovePodSandboxHandler]("remove_pod_sandbox", RemovePodSandboxHandler,
                                           lambda p: p.remove_pod_sandbox),
    Event.POST_CREATE_CONTAINER: EventHandler[PostCreateContainerHandler]("post_create_container", PostCreateContainerHandler,
                                              lambda p: p.post_create_container),
    Event.START_CONTAINER: EventHandler[StartContainerHandler]("start_container", StartContainerHandler, lambda p: p.start_container),
    Event.POST_START_CONTAINER: EventHandler[PostStartContainerHandler]("post_start_container", PostStartContainerHandler,
                                             lambda p: p.post_start_container),
    Event.POST_UPDATE_CONTAINER: EventHandler[PostUpdateContainerHandler]("post_update_container", PostUpdateContainerHandler,
                                              lambda p: p.post_update_container),
    Event.REMOVE_CONTAINER: EventHandler[RemoveContainerHandler]("remove_container", RemoveContainerHandler, lambda p: p.remove_container),
}
# Requests the runtime waits on for a reply.
REQUEST_HANDLERS: dict[Event, EventHandler[Any]] = {
    Event.CREATE_CONTAINER: EventHandler[CreateContainerHandler]("create_container", CreateContainerHandler, lambda p: p.create_container),
    Event.UPDATE_CONTAINER: EventHandler[UpdateContainerHandler]("update_container", UpdateContainerHandler, lambda p: p.update_container),
    Event.STOP_CONTAINER: EventHandler[StopContainerHandler]("stop_container", StopContainerHandler, lambda p: p.stop_container),
}


def subscribed_events(plugin: object) -> set[Event]:
    """The events ``plugin`` has a handler for."""
    return {ev for ev, h in {**STATE_HANDLERS, **REQUEST_HANDLERS}.items() if h.of(plugin) is not None}
