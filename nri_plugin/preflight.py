"""``rekindle doctor``: the node checks of ``runtime.doctor`` plus one only the NRI side can do.

``check_nri_socket`` connects to the NRI socket and completes one ttrpc exchange through the
mux, as a plugin would, without registering: it calls a method the runtime's service does not
have and expects the runtime to answer ``Unimplemented``. A socket that accepts but does not
speak mux + ttrpc, or does not answer in time, fails the check; nothing is registered with the
runtime, so no pod is ever routed through the doctor.
"""

from __future__ import annotations

import asyncio
import os

from runtime.doctor import Check
from runtime.doctor import run_checks as node_checks

from .config import Settings
from .stub import RUNTIME_SERVICE
from .transport.mux import RUNTIME_SERVICE_CONN, MuxTrunk
from .transport.rpc_errors import Code, RpcError, TransportError
from .transport.ttrpc import TtrpcClient

PROBE_METHOD = "RekindleDoctor"  # not a method of the runtime's service, on purpose
TIMEOUT = 3.0


async def _exchange(socket_path: str, timeout: float) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), timeout)
    trunk = MuxTrunk(reader, writer)
    client = TtrpcClient(lambda b: trunk.send(RUNTIME_SERVICE_CONN, b))
    trunk.route(RUNTIME_SERVICE_CONN, client.feed)
    reader_task = asyncio.create_task(trunk.run())
    try:
        await client.call(RUNTIME_SERVICE, PROBE_METHOD, b"", timeout=timeout)
        return "answered a call that should not exist"
    except RpcError as exc:
        if exc.code == Code.UNIMPLEMENTED:
            return f"ttrpc exchange ok (the runtime answered Unimplemented: {exc.message})"
        raise
    finally:
        client.close(ConnectionError("doctor done"))
        trunk.close()
        reader_task.cancel()
        await asyncio.gather(reader_task, return_exceptions=True)


def check_nri_socket(socket_path: str, timeout: float = TIMEOUT) -> Check:
    if not os.path.exists(socket_path):
        return Check("nri-socket", False, f"{socket_path} missing: is NRI enabled? (rekindle nri-toggle)")
    try:
        detail = asyncio.run(asyncio.wait_for(_exchange(socket_path, timeout), timeout + 1))
    except (OSError, TransportError, asyncio.TimeoutError, TimeoutError) as exc:
        return Check("nri-socket", False, f"{socket_path}: no NRI ttrpc exchange: {type(exc).__name__}: {exc}")
    return Check("nri-socket", True, f"{socket_path}: {detail}")


def check_kubernetes_client(events: bool) -> Check:
    """The optional client behind Events and the pod condition: a failure only with --events."""
    from .events_k8s import INSTALL_HINT, client_missing
    missing = client_missing()
    if missing is None:
        return Check("kubernetes-client", True, "importable (--events can report Events and the pod condition)",
                     required=False)
    effect = "--events is on, but" if events else "with --events,"
    return Check("kubernetes-client", False, f"not importable ({missing}): {effect} no Events and no pod "
                 f"condition would be reported; {INSTALL_HINT}", required=False)


def run_checks(settings: Settings) -> list[Check]:
    checks = [c for c in node_checks(settings) if c.name != "nri-socket"]
    checks.append(check_kubernetes_client(settings.report.events))
    sock = settings.socket_path
    if sock:
        checks.insert(next((i for i, c in enumerate(checks) if c.name == "containerd-api"), len(checks)),
                      check_nri_socket(sock))
    return checks
