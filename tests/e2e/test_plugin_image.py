"""The plugin image, run the way the chart runs it, against the sandbox's containerd.

hack/build-plugin-image.sh builds the image (debootstrap rootfs, OCI archive)
and imports it into the sandbox. The chart is rendered (tests/unit/chart_render)
with its host paths pointed at the sandbox; the DaemonSet's pod becomes a CRI
pod: privileged, host pid namespace, every hostPath volume a CRI mount at the
same place, the Secret a directory laid out exactly as kubelet writes a Secret
volume (kubelet_volumes.py: the key a symlink into ..data, mode from the
chart's defaultMode), the ConfigMap environment variables. Then:
containerd's log says the plugin connected, and a pod annotated
rekindle.dev/checkpoint gets the control dir (REKINDLE_CONTROL_DIR) in its spec.
A workload whose bind source is a host dir the plugin's pod does not mount (as a
host-installed driver's libraries are) is checkpointed and restored warm by the
plugin in its pod: CRIU runs in the host's mount namespace (runtime/container/hostview.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.cri import ContainerState, Mount, NamespaceMode, Pod, SecurityContext
from runtime.containerd.proto import cri_api_pb2 as pb
from tests.e2e.kubelet_volumes import KUBELET_DEFAULT_MODE, project
from tests.unit import chart_render
from tests.waiting import WaitTimeout, wait_for

REPO = Path(__file__).resolve().parents[2]

BUSYBOX = "localhost/rekindle/busybox:1"
COUNTER = "localhost/rekindle/counter:1"
SERVER = ["/usr/local/bin/counter-server", "8080"]
STATE_DIR = Path("/var/lib/rekindle-e2e-image")  # the plugin's state dir, the same path on host and in the pod
PROPAGATION = {None: pb.PROPAGATION_PRIVATE, "None": pb.PROPAGATION_PRIVATE,
               "HostToContainer": pb.PROPAGATION_HOST_TO_CONTAINER, "Bidirectional": pb.PROPAGATION_BIDIRECTIONAL}


def _version() -> str:
    import tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def plugin_image(sandbox) -> str:
    """Build the image (the debootstrap base is cached under build/) and import it into the sandbox."""
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap is missing: apt-get install debootstrap (hack/build-plugin-image.sh needs it)")
    res = subprocess.run([str(REPO / "hack" / "build-plugin-image.sh"), "--import", sandbox.containerd_socket,
                          "--ctr", sandbox.ctr], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"build-plugin-image.sh failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    name = f"localhost/rekindle/plugin:{_version()}"
    assert name in sandbox.cri.list_images()
    return name


def _ensure_shared(path: Path) -> None:
    """Make the mount holding path shared, as / is on a systemd node.

    The chart mounts containerd's state and root dirs with HostToContainer
    propagation (so container rootfs mounts made later show up in the plugin),
    and runc refuses that from a private mount. This machine's / is private, so
    the sandbox dir becomes a shared recursive bind of itself (its existing
    submounts are carried over; Sandbox.down unmounts it with the rest).
    """
    prop = subprocess.run(["findmnt", "-n", "-o", "TARGET,PROPAGATION", "--target", str(path)],
                          capture_output=True, text=True, check=True).stdout.split()
    if prop[-1] == "shared":
        return
    if prop[0] != str(path):
        subprocess.run(["mount", "--rbind", str(path), str(path)], check=True)
    subprocess.run(["mount", "--make-rshared", str(path)], check=True)


def _rendered_pod_spec(sandbox, store: Path) -> tuple[dict, dict]:
    values = {
        "image": {"name": "localhost/rekindle/plugin", "pullPolicy": "Never", "allowLocal": True},
        "nri": {"plugin": {"index": 90}, "socketDir": str(sandbox.nri_socket.parent)},
        "containerd": {"stateDir": str(sandbox.state_dir), "rootDir": str(sandbox.root_dir)},
        "stateDir": str(STATE_DIR),
        # Pod volumes would live under /var/lib/kubelet on a node; here, inside the shared sandbox dir.
        "hostBindSources": [str(sandbox.dir / "kubelet")],
        "store": {"type": "hostPath", "hostPath": {"path": str(store)}},
        "settings": {"logLevel": "debug", "logFormat": "json", "restoreTimeoutSeconds": 1800},
    }
    r = chart_render.render(values)
    (ds,) = chart_render.by_kind(r["objects"], "DaemonSet")
    (cm,) = chart_render.by_kind(r["objects"], "ConfigMap")
    return ds["spec"]["template"]["spec"], cm["data"]


def _cri_mounts(pod_spec: dict, container: dict, secret_dir: Path) -> list[Mount]:
    """The container's volumeMounts as CRI mounts (what kubelet would hand to containerd)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = []
    for vm in container["volumeMounts"]:
        vol = volumes[vm["name"]]
        if "hostPath" in vol:
            host = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            assert host.is_dir(), f"hostPath {host} of volume {vm['name']} does not exist"
        elif "secret" in vol:
            items = {item["path"]: os.urandom(32) for item in vol["secret"]["items"]}
            project(secret_dir, items, mode=vol["secret"].get("defaultMode", KUBELET_DEFAULT_MODE))
            host = secret_dir
        else:
            pytest.fail(f"volume {vm['name']} has a kind this test cannot translate: {sorted(vol)}")
        mounts.append(Mount(vm["mountPath"], str(host), readonly=bool(vm.get("readOnly")),
                            propagation=PROPAGATION[vm.get("mountPropagation")]))
    return mounts


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of $(NAME) in a container's args ($$ escapes; unknown stays)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)


def _run_privileged_host_pid_pod(cri, name: str) -> Pod:
    """RunPodSandbox like kubelet does for a privileged hostPID pod (CRIClient.run_pod_sandbox
    makes unprivileged pods, and containerd refuses privileged containers in those)."""
    uid = str(uuid.uuid4())
    log_dir = cri.log_root / f"kube-system_{name}_{uid}"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="kube-system", uid=uid, attempt=0),
        hostname=name, log_directory=str(log_dir),
        linux=pb.LinuxPodSandboxConfig(security_context=pb.LinuxSandboxSecurityContext(
            privileged=True, namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.NODE, ipc=pb.POD))))
    resp = cri._call("RunPodSandbox", cri._rt.RunPodSandbox, pb.RunPodSandboxRequest(config=config), 120)
    return Pod(resp.pod_sandbox_id, name, "kube-system", uid, log_dir, config, NamespaceMode.NODE)


def _status(url: str) -> int | None:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _http(ip: str, path: str) -> str | None:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def _wait(pred: Callable[[], object], timeout: float, what: str, diag: Callable[[], str]) -> None:
    try:
        wait_for(pred, timeout, what, interval=0.5)
    except WaitTimeout as exc:
        pytest.fail(f"{exc}\n{diag()}")


@dataclass
class PluginPod:
    cid: str
    args: list[str]
    logs: Callable[[], str]


@contextlib.contextmanager
def _plugin_pod(sandbox, plugin_image: str, tmp_path: Path) -> Iterator[PluginPod]:
    """The chart's DaemonSet pod, run through CRI: connected to containerd and ready."""
    cri = sandbox.cri
    shutil.rmtree(STATE_DIR, ignore_errors=True)  # a run that died may have left it
    _ensure_shared(sandbox.dir)
    store = tmp_path / "store"
    pod_spec, config_env = _rendered_pod_spec(sandbox, store)
    (plugin,) = pod_spec["containers"]
    assert pod_spec["hostPID"] is True and plugin["securityContext"]["privileged"] is True

    args = list(plugin["args"])
    # The sandbox keeps containerd.sock beside nri.sock (mounted at /var/run/nri), not in its state dir.
    i = args.index("--containerd-socket")
    args[i + 1] = "/var/run/nri/" + Path(sandbox.containerd_socket).name
    env = dict(config_env)
    env.update({e["name"]: e["value"] for e in plugin.get("env", []) if "value" in e})
    env["NODE_NAME"] = os.uname().nodename

    secret_dir = tmp_path / "etc-rekindle"
    secret_dir.mkdir()
    mounts = _cri_mounts(pod_spec, plugin, secret_dir)
    assert os.readlink(secret_dir / "hmac.key") == "..data/hmac.key"  # what the plugin must follow
    log_start = sandbox.log_path.stat().st_size if sandbox.log_path.exists() else 0

    ppod = _run_privileged_host_pid_pod(cri, "rekindle-plugin-image")
    try:
        # As the kubelet: POD_IP from the downward API (status.podIP), and $(VAR) in args expanded
        # from the container's environment (the chart's --metrics-address $(POD_IP)).
        env["POD_IP"] = cri.pod_ip(ppod.id)
        assert env["POD_IP"], "the plugin's pod has no IP"
        args = [_expand(a, env) for a in args]
        cid = sandbox.run_container(ppod, plugin["name"], plugin_image, command=plugin["command"], args=args,
                                    env=env, mounts=mounts, security=SecurityContext(privileged=True))

        def plugin_logs() -> str:
            st = cri.container_status(cid)
            return (f"plugin container {st.state.name} exit={st.exit_code} {st.reason} {st.message}\n"
                    + "\n".join(cri.logs(cid, "both")[-60:]))

        def new_containerd_log() -> str:
            with open(sandbox.log_path, errors="replace") as f:
                f.seek(log_start)
                return f.read()

        def connected() -> bool:
            assert cri.container_status(cid).state is ContainerState.RUNNING, plugin_logs()
            return re.search(r'90-rekindle\W{0,4} connected', new_containerd_log()) is not None

        _wait(connected, 60, "containerd to log that plugin 90-rekindle connected",
              lambda: plugin_logs() + "\n--- containerd log:\n" + new_containerd_log()[-4000:])
        # The chart's probes hit the plugin's own endpoint: ready once registered and synchronized.
        ip = cri.pod_ip(ppod.id)
        ports = {p["name"]: p["containerPort"] for p in plugin["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            get = plugin[probe]["httpGet"]
            url = f"http://{ip}:{ports[get['port']]}{get['path']}"
            _wait(lambda url=url: _status(url) == 200, 30, f"{probe} {url} to answer 200", plugin_logs)
        yield PluginPod(cid, args, plugin_logs)
        assert cri.container_status(cid).state is ContainerState.RUNNING, plugin_logs()
    finally:
        try:
            cri.stop_pod(ppod.id)
            cri.remove_pod(ppod.id)
        finally:
            shutil.rmtree(STATE_DIR, ignore_errors=True)


def test_plugin_from_image_registers_and_adjusts_annotated_pods(sandbox, pod, plugin_image, tmp_path):
    cri = sandbox.cri
    with _plugin_pod(sandbox, plugin_image, tmp_path) as pp:
        cid, args, plugin_logs = pp.cid, pp.args, pp.logs
        # An annotated pod gets the control dir, through the plugin in the image.
        p = pod(annotations={"rekindle.dev/checkpoint": "x"})
        wid = sandbox.run_container(p, "main", BUSYBOX, command=["/bin/sh", "-c", "exec sleep 3600"])
        st = cri.container_status(wid, verbose=True)
        spec_env = st.runtime_spec["process"]["env"]
        assert "REKINDLE_CONTROL_DIR=/rekindle" in spec_env, plugin_logs()
        dests = {m["destination"]: m for m in st.runtime_spec["mounts"]}
        assert "/rekindle" in dests, plugin_logs()
        control = Path(dests["/rekindle"]["source"])
        assert control.is_relative_to(STATE_DIR / "control"), control
        assert control.is_dir()
        # the plugin installed the init from the image onto the host
        assert (STATE_DIR / "bin" / "rekindle-init").exists(), plugin_logs()

        # An unannotated pod is left alone.
        q = pod()
        qid = sandbox.run_container(q, "main", BUSYBOX, command=["/bin/sh", "-c", "exec sleep 3600"])
        q_env = cri.container_status(qid, verbose=True).runtime_spec["process"]["env"]
        assert not any(e.startswith("REKINDLE_CONTROL_DIR=") for e in q_env)

        # Checkpoint and restore, with CRIU and the engine running inside the plugin's pod.
        from runtime.status import Phase, StatusBook
        book = StatusBook(STATE_DIR)
        src = pod("img-src", annotations={"rekindle.dev/checkpoint": "from-image"})
        # The server says ready (and so is checkpointed) only once it has answered our 3 requests.
        sandbox.run_container(src, "server", COUNTER, command=SERVER, env={"READY_AFTER_REQUESTS": "3"})
        src_ip = cri.pod_ip(src.id)
        _wait(lambda: _http(src_ip, "/healthz") is not None, 30, "the source server", plugin_logs)
        ready_file = STATE_DIR / "control" / src.uid / "server" / "ready-for-checkpoint"
        assert not ready_file.exists(), "the source said ready before the requests"
        for i in range(1, 4):
            assert f"count={i} " in (_http(src_ip, "/") or ""), plugin_logs()
        st = book.wait("default", src.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 60)
        assert st is not None and st.phase is Phase.PUBLISHED, (st, plugin_logs())
        # `kubectl exec ds/rekindle -- rekindle artifacts inspect`: the CLI in the pod finds the
        # plugin's key through REKINDLE_HMAC_KEY_FILE and checks the signature with it.
        shown = cri.exec_sync(cid, ["rekindle", "artifacts", "inspect", "--store", args[args.index("--store") + 1],
                                    "--namespace", "default", "from-image"], timeout=30)
        assert shown.exit_code == 0 and "signature ok" in shown.out, (shown, plugin_logs())
        dst = pod("img-dst", annotations={"rekindle.dev/restore": "from-image"})
        sandbox.run_container(dst, "server", COUNTER, command=SERVER)
        st = book.wait("default", dst.name, "server", {Phase.RESTORED, Phase.COLD_START}, 60)
        assert st is not None and st.phase is Phase.RESTORED, (st, plugin_logs())
        dst_ip = cri.pod_ip(dst.id)
        _wait(lambda: _http(dst_ip, "/healthz") is not None, 30, "the restored server", plugin_logs)
        assert "count=4 " in _http(dst_ip, "/"), plugin_logs()



HOST_ONLY = Path("/var/lib/rekindle-test-hostlib")  # on the host; the plugin's pod does not mount it
LIB = b"version-A of a host library\n" + bytes(range(256)) * 16


@pytest.mark.parametrize("uses", ["bind-only", "mapped"])
def test_plugin_in_its_pod_restores_a_workload_whose_bind_source_only_the_host_has(
        sandbox, pod, plugin_image, tmp_path, uses):
    """As the NVIDIA toolkit binds a host-installed driver's libraries (host /usr/lib/...) into GPU
    containers: a bind source outside every mount of the plugin's pod. ``bind-only``: the tree
    uses nothing from it (CRIU must still re-create the mount from the host path); ``mapped``: it
    maps a library from it (hashed at checkpoint and before the restore, then remapped by CRIU)."""
    from runtime.status import Phase, StatusBook
    cri = sandbox.cri
    lib = HOST_ONLY / uuid.uuid4().hex[:12]
    lib.mkdir(parents=True)
    (lib / "libhost.so").write_bytes(LIB)
    mount = Mount("/hostlib", str(lib), readonly=True)
    env = {"READY_AFTER_REQUESTS": "3"}
    if uses == "mapped":
        env.update({"MAP_FILE": "/hostlib/libhost.so", "WARMUP_MIB": "0"})
    name = f"hostlib-{uses}"
    try:
        with _plugin_pod(sandbox, plugin_image, tmp_path) as pp:
            seen = cri.exec_sync(pp.cid, ["python3", "-c", f"import os; print(os.path.exists({str(lib)!r}))"],
                                 timeout=30)
            assert seen.out.strip() == "False", ("the plugin's pod must not see the host dir", seen)
            book = StatusBook(STATE_DIR)
            src = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
            sandbox.run_container(src, "server", COUNTER, command=SERVER, env=env, mounts=[mount])
            src_ip = cri.pod_ip(src.id)
            _wait(lambda: _http(src_ip, "/healthz") is not None, 30, "the source server", pp.logs)
            for i in range(1, 4):
                assert f"count={i} " in (_http(src_ip, "/") or ""), pp.logs()
            st = book.wait("default", src.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 60)
            assert st is not None and st.phase is Phase.PUBLISHED, f"{st and st.phase}: {st and st.reason}\n{pp.logs()}"

            dst = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
            sandbox.run_container(dst, "server", COUNTER, command=SERVER, mounts=[mount])
            st = book.wait("default", dst.name, "server", {Phase.RESTORED, Phase.COLD_START}, 90)
            assert st is not None and st.phase is Phase.RESTORED, f"{st and st.phase}: {st and st.reason}\n{pp.logs()}"
            dst_ip = cri.pod_ip(dst.id)
            _wait(lambda: _http(dst_ip, "/healthz") is not None, 30, "the restored server", pp.logs)
            assert "count=4 " in (_http(dst_ip, "/") or ""), pp.logs()  # the source's process, continued
            if uses == "mapped":
                assert _http(dst_ip, "/mapped") == "mapped=version-A of a host library\n", pp.logs()
            # CRIU ran through the launcher, in a private copy of the host's mount namespace
            # (nothing of it reached the host's).
            criu_lines = [ln for ln in cri.logs(pp.cid, "both") if "criu restore:" in ln]
            assert criu_lines and all("rekindle-hostexec" in ln for ln in criu_lines), criu_lines
            with open("/proc/self/mountinfo") as f:
                assert "/run/rekindle-criu" not in f.read()
    finally:
        shutil.rmtree(lib, ignore_errors=True)
