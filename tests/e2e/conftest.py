"""e2e fixtures: a real containerd sandbox (CRI + NRI + CNI) and pods made through CRI.

Fixtures (use them from any test under tests/e2e/):

``sandbox`` (session) -> :class:`SandboxHandle` for the runtime chosen by ``--containerd`` /
    ``$REKINDLE_E2E_RUNTIME`` (default 1.7), or by indirect parametrization
    (``@pytest.mark.parametrize("sandbox", ["2.1"], indirect=True)``). Uses the sandbox dir
    ``$REKINDLE_SANDBOX`` (default /var/lib/rekindle-sandbox): an already running sandbox of the
    same runtime is reused and left running; otherwise it is started and stopped at the end.
    Attributes: ``runtime``, ``dir``, ``containerd_socket``, ``nri_socket``, ``state_dir``,
    ``bundles_dir``, ``root_dir``, ``log_path``, ``ctr``, ``subnet``, ``env``, ``cri``
    (a :class:`~devtools.cri.CRIClient`), ``sandbox`` (the engine); methods
    ``bundle(container_id)``, ``containerd()`` (a ContainerdClient), ``run_container(pod, name,
    image, **create_kwargs)`` (create + start, returns the id), ``log_tail(lines)``.
``sandbox_factory`` (session) -> callable ``(runtime="2.1") -> SandboxHandle`` (runtime 1.7, 2.1, 2.2 or 2.4): a fresh extra
    sandbox with its own dir, bridge ``rkbr<N>`` and subnet ``10.77.<N>.0/24``; torn down (and
    purged) at the end of the session.
``plugin`` (module) -> :class:`~tests.e2e.plugin_process.PluginProcess`: ``rekindle plugin`` against
    ``sandbox`` for the module's tests, with its own state dir and store (a module that needs
    other flags defines its own ``plugin``). Every e2e module starts with ``make`` done (the init
    and the test server, ``_native``).
``pod`` (function) -> callable ``(name=None, namespace="default", *, annotations=None,
    labels=None, pid_mode=NamespaceMode.CONTAINER, on=None) -> Pod``: runs a pod sandbox in
    ``sandbox`` (or in the handle ``on``); every pod it made is stopped and removed afterwards.

A session holds ``/run/lock/rekindle-e2e.lock`` while it uses sandboxes, so two test sessions
on one machine wait for each other instead of sharing a bridge. On a failed test that used a
sandbox, the report gets a "containerd log" section with the log's tail.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devtools.cri import CRIClient, NamespaceMode, Pod
from devtools.sandbox import DEFAULT_DIR, Runtime, Sandbox, SandboxConfig
from runtime.containerd.client import ContainerdClient
from runtime.errors import RekindleError
from tests.e2e.plugin_process import PluginProcess, build_native

log = logging.getLogger(__name__)

LOCK_PATH = Path("/run/lock/rekindle-e2e.lock")
KEEP = os.environ.get("REKINDLE_E2E_KEEP") == "1"  # leave sandboxes running after the session


@dataclass
class SandboxHandle:
    runtime: str
    sandbox: Sandbox
    cri: CRIClient
    started_here: bool = True
    _extra_clients: list[ContainerdClient] = field(default_factory=list, repr=False)

    @property
    def dir(self) -> Path:
        return self.sandbox.paths.dir

    @property
    def containerd_socket(self) -> str:
        return self.sandbox.address

    @property
    def nri_socket(self) -> Path:
        return self.sandbox.paths.nri_socket

    @property
    def state_dir(self) -> Path:
        return self.sandbox.paths.state

    @property
    def bundles_dir(self) -> Path:
        return self.sandbox.paths.bundles

    @property
    def root_dir(self) -> Path:
        return self.sandbox.paths.root

    @property
    def log_path(self) -> Path:
        return self.sandbox.paths.log

    @property
    def ctr(self) -> str:
        return str(self.sandbox.config.runtime.ctr)

    @property
    def subnet(self) -> str:
        return self.sandbox.config.subnet

    @property
    def env(self) -> dict[str, str]:
        return self.sandbox.env()

    def bundle(self, container_id: str) -> Path:
        """The task bundle of a container (config.json, rootfs/) in this containerd's state dir."""
        return self.bundles_dir / container_id

    def containerd(self) -> ContainerdClient:
        c = ContainerdClient(self.containerd_socket)
        self._extra_clients.append(c)
        return c

    def run_container(self, pod: Pod, name: str, image: str, **kwargs: Any) -> str:
        cid = self.cri.create_container(pod, name, image, **kwargs)
        self.cri.start_container(cid)
        return cid

    def log_tail(self, lines: int = 60) -> str:
        return self.sandbox.log_tail(lines)

    def close(self, purge: bool = False) -> None:
        for c in self._extra_clients:
            c.close()
        self.cri.close()
        if self.started_here and not KEEP:
            self.sandbox.down(purge=purge)


def _start(config: SandboxConfig) -> SandboxHandle:
    sb = Sandbox(config)
    meta = sb._read_meta()
    reuse = sb.is_running() and meta is not None and meta.runtime == config.runtime.value
    if sb.is_running() and not reuse:
        pytest.fail(f"sandbox {config.dir} already runs containerd {meta.runtime if meta else '?'}; "
                    f"stop it (hack/sandbox.sh down) or run with --containerd {meta.runtime if meta else '?'}")
    try:
        if reuse:
            sb.wait_ready(30)
        sb.up()  # imports images in both cases (idempotent)
    except RekindleError as e:
        if not reuse:
            sb.down()
        pytest.fail(f"sandbox {config.dir} ({config.runtime.value}) did not come up: {e}")
    return SandboxHandle(config.runtime.value, sb, sb.cri(timeout=60.0), started_here=not reuse)


@pytest.fixture(scope="session")
def _e2e_lock() -> Iterator[None]:
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another test session's sandbox ({LOCK_PATH})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def sandbox(request: pytest.FixtureRequest, _e2e_lock: None) -> Iterator[SandboxHandle]:
    runtime = Runtime(getattr(request, "param", None) or request.config.getoption("--containerd"))
    handle = _start(SandboxConfig(dir=DEFAULT_DIR, runtime=runtime))
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def sandbox_factory(_e2e_lock: None) -> Iterator[Callable[..., SandboxHandle]]:
    made: list[SandboxHandle] = []
    counter = itertools.count(1)

    def make(runtime: str = "2.1") -> SandboxHandle:
        n = next(counter)
        cfg = SandboxConfig(dir=DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-extra{n}"), runtime=Runtime(runtime),
                            bridge=f"rkbr{n}", subnet=f"10.77.{n}.0/24")
        Sandbox(cfg).down(purge=True)  # a crashed earlier session may have left it
        handle = _start(cfg)
        made.append(handle)
        return handle

    yield make
    for h in reversed(made):
        h.close(purge=True)


@pytest.fixture
def pod(request: pytest.FixtureRequest, sandbox: SandboxHandle) -> Iterator[Callable[..., Pod]]:
    made: list[tuple[SandboxHandle, Pod]] = []
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40] or "pod"
    counter = itertools.count()

    def make(name: str | None = None, namespace: str = "default", *, annotations: dict[str, str] | None = None,
             labels: dict[str, str] | None = None, pid_mode: NamespaceMode = NamespaceMode.CONTAINER,
             on: SandboxHandle | None = None) -> Pod:
        where = on or sandbox
        p = where.cri.run_pod_sandbox(name or f"{base}-{next(counter)}", namespace, annotations=annotations,
                                      labels=labels, pid_mode=pid_mode)
        made.append((where, p))
        return p

    yield make
    for where, p in reversed(made):
        try:
            where.cri.stop_pod(p.id)
            where.cri.remove_pod(p.id)
        except RekindleError as e:
            log.warning("cleaning up pod %s: %s", p.name, e)


@pytest.fixture(scope="module", autouse=True)
def _native() -> None:
    build_native()


@pytest.fixture(scope="module")
def plugin(sandbox: SandboxHandle, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[PluginProcess]:
    short = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")[:12]  # socket paths stay short
    p = PluginProcess(sandbox, tmp_path_factory.mktemp(short) / "plugin")
    p.start()
    yield p
    p.stop()
    p.drop_store()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    rep = yield
    if rep.failed:
        handles = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, SandboxHandle)]
        for h in handles:
            rep.sections.append((f"containerd log ({h.runtime}, {h.log_path})", h.log_tail()))
        plugins = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, PluginProcess)]
        for p in plugins:  # why a restore went cold, or a cache entry was not written, is told there
            rep.sections.append((f"plugin log ({p.log_path})", "\n".join(p.log().splitlines()[-60:])))
    return rep
