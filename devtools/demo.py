"""Single-node demo: containerd with NRI, the Rekindle plugin, checkpoint then restore.

    hack/demo.sh [--warmup-mib 1024] [--passes 20] [--restore-path auto|bulk|stock|stream] [--keep]   (as root)

1. brings up the local sandbox (private containerd 1.7.24 with NRI, CNI bridge, local images);
2. starts `rekindle plugin` against it;
3. cold-starts a baseline pod (no annotations) running a server whose start-up is heavy on
   purpose (it fills --warmup-mib MiB of memory, standing in for loading model weights);
4. starts the same pod annotated `rekindle.dev/checkpoint: demo-warm`, sends it 3 requests, after
   which it says it is ready; the plugin then checkpoints it into the store (CRIU dump + writable
   layer, signed manifest);
5. starts a new pod annotated `rekindle.dev/restore: demo-warm` and times it until it serves,
   with its state (request counter, warm memory checksum, files) carried over;
6. prints cold start vs restore, phase by phase.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from devtools.cri import CRIClient
from devtools.sandbox import DEFAULT_DIR, Runtime, Sandbox, SandboxConfig
from runtime.status import Phase, StatusBook

REPO = Path(__file__).resolve().parent.parent

IMAGE = "localhost/rekindle/counter:1"
COMMAND = ["/usr/local/bin/counter-server", "8080"]


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def get(ip: str, path: str = "/", timeout: float = 2.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=timeout) as r:
        return r.read().decode().strip()


def wait_serving(ip: str, t0: float, timeout: float = 300) -> float:
    while time.monotonic() - t0 < timeout:
        try:
            get(ip, "/healthz", 1.0)
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"demo: {ip} did not start serving in {timeout}s")


def _route(state: Path, pod_uid: str) -> str:
    """The route the plugin chose for the restore, and why (the container's timings.json)."""
    try:
        route = json.loads((state / "control" / pod_uid / "server" / "timings.json").read_text())["route"]
        return f"{route['kind']} path: {route['reason']}"
    except (OSError, ValueError, KeyError):
        return "route not recorded"


def wait_status(state: Path, ns: str, pod: str, ctr: str, phases: set[str], timeout: float = 600) -> dict:
    st = StatusBook(state).wait(ns, pod, ctr, {Phase(p) for p in phases}, timeout)
    if st is None or st.phase.value not in phases:
        raise SystemExit(f"demo: {ns}/{pod} never reached {phases}")
    return json.loads(st.to_json())


def run_pod(cri: CRIClient, name: str, env: dict[str, str], annotations: dict[str, str] | None = None):
    pod = cri.run_pod_sandbox(name, "default", annotations=annotations or {})
    t0 = time.monotonic()
    cid = cri.create_container(pod, "server", IMAGE, command=COMMAND, env=env)
    cri.start_container(cid)
    return pod, cid, t0


def _phase_table(store: Path, timings: dict[str, float]) -> str:
    from devtools import phases
    art = phases.artifact_dir(store, "default", "demo-warm")
    files = [p for p in art.rglob("*") if p.is_file()]
    threads = os.cpu_count() or 1
    read = phases.read_gbps(files, threads)  # page cache: the restore just read it
    copy = min(read, phases.copy_gbps(threads))
    ceilings = {"stage": read, "rootfs_apply": read, "criu_restore": copy, "fill": copy, "stream": copy}
    moved = phases.phase_bytes(art)
    if "stream" in timings:  # the bulk pages arrived while the server ran
        moved["stream"] = moved.pop("fill")
    return phases.format_rows(phases.rows(timings, moved, ceilings))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup-mib", type=int, default=1024, help="memory the server fills at start (default 1024)")
    # 20 passes cost ~5 s per GiB here: the start-up cost per GiB of state of the 7B LLM server
    # measured on the H200 (67 s for ~15 GiB, bench/results/h200). Lower it to see restore lose.
    ap.add_argument("--passes", type=int, default=20, help="fill passes: start-up CPU cost (default 20)")
    ap.add_argument("--keep", action="store_true", help="leave the sandbox and pods running")
    ap.add_argument("--restore-path", choices=("auto", "bulk", "stock", "stream"), default="auto",
                    help="auto (default): the plugin's rule (its 1 GiB streams); stream: the server runs "
                         "right after CRIU while its memory is served through userfaultfd; bulk: filled beside "
                         "CRIU on all cores first; stock: CRIU restores every page")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("demo: run as root (it starts containerd)")
    if not (REPO / "build" / "rekindle-init").exists():
        subprocess.run(["make", "-C", str(REPO), "--no-print-directory"], check=True)

    sandbox = Sandbox(SandboxConfig(dir=DEFAULT_DIR, runtime=Runtime("1.7")))
    say(f"sandbox: containerd 1.7.24 with NRI in {DEFAULT_DIR}")
    sandbox.up()
    work = Path(tempfile.mkdtemp(prefix="rekindle-demo-"))
    state = work / "state"
    plugin_log = work / "plugin.log"
    say(f"plugin: rekindle plugin (log {plugin_log})")
    plugin = subprocess.Popen(
        [sys.executable, "-m", "nri_plugin", "plugin", "--socket-path", str(sandbox.paths.nri_socket),
         "--state-dir", str(state), "--store", str(work / "store"),
         "--containerd-socket", sandbox.address, "--containerd-state", str(sandbox.paths.state),
         "--init-binary", str(REPO / "build" / "rekindle-init"), "--create-key",
         "--restore-path", args.restore_path],
        cwd=REPO, stdout=open(plugin_log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    cri = sandbox.cri(timeout=60)
    made = []
    try:
        deadline = time.monotonic() + 20
        while "synchronized" not in plugin_log.read_text():
            if time.monotonic() > deadline or plugin.poll() is not None:
                raise SystemExit(f"demo: plugin did not connect:\n{plugin_log.read_text()}")
            time.sleep(0.1)
        env = {"WARMUP_MIB": str(args.warmup_mib), "WARMUP_PASSES": str(args.passes)}
        tag = str(int(time.time()))

        say(f"cold start, no annotations (fills {args.warmup_mib} MiB in {args.passes} passes)")
        pod, cid, t0 = run_pod(cri, f"demo-cold-{tag}", env)
        made.append(pod)
        cold = wait_serving(cri.pod_ip(pod.id), t0)
        print(f"    serving after {cold:.2f}s")

        say("checkpoint source: rekindle.dev/checkpoint=demo-warm")
        # The source says ready only once it has served our 3 requests, so the checkpoint (and
        # the restored counter) always comes after them.
        src, src_cid, t0 = run_pod(cri, f"demo-source-{tag}", {**env, "READY_AFTER_REQUESTS": "3"},
                                   {"rekindle.dev/checkpoint": "demo-warm"})
        made.append(src)
        src_ip = cri.pod_ip(src.id)
        source_cold = wait_serving(src_ip, t0)
        for _ in range(3):
            get(src_ip)
        print(f"    serving after {source_cold:.2f}s; 3 requests served; waiting for the checkpoint")
        ck = wait_status(state, "default", src.name, "server", {"published", "checkpoint-failed"})
        if ck["phase"] != "published":
            raise SystemExit(f"demo: checkpoint failed: {ck['reason']}")
        print("    published: " + ", ".join(f"{k} {v:.2f}s" for k, v in ck["timings"].items()))

        say("restore: a new pod annotated rekindle.dev/restore=demo-warm")
        dst, dst_cid, t0 = run_pod(cri, f"demo-restore-{tag}", env, {"rekindle.dev/restore": "demo-warm"})
        made.append(dst)
        dst_ip = cri.pod_ip(dst.id)
        warm = wait_serving(dst_ip, t0)
        rs = wait_status(state, "default", dst.name, "server", {"restored", "cold-start"})
        body, verify = get(dst_ip), get(dst_ip, "/verify")
        print(f"    serving after {warm:.2f}s ({rs['phase']}{': ' + rs['reason'] if rs['reason'] else ''})")
        print(f"    restore phases ({_route(state, dst.uid)}), each against its speed of light on this machine:")
        print(_phase_table(work / "store", rs["timings"]))
        print(f"    source pod {src_ip}  ->  restored pod {dst_ip}: {body}")
        print(f"    warm memory after restore: {verify}")

        count = re.search(r"count=(\d+)", body)
        print()
        print(f"  {'':28}{'seconds':>10}")
        print(f"  {'cold start (baseline pod)':28}{cold:>10.2f}")
        print(f"  {'restore (create -> serving)':28}{warm:>10.2f}")
        print(f"  {'speed-up':28}{cold / warm:>9.1f}x")
        print(f"  state carried over: request counter {count.group(1) if count else '?'} (4 = continued), "
              f"{'memory intact' if 'verify=ok' in verify else 'MEMORY CHANGED'}")
        ok = rs["phase"] == "restored" and "verify=ok" in verify and count and count.group(1) == "4"
        return 0 if ok else 1
    finally:
        if not args.keep:
            for p in made:
                try:
                    cri.stop_pod(p.id)
                    cri.remove_pod(p.id)
                except Exception:  # noqa: BLE001 - best-effort clean-up of a demo
                    pass
            plugin.terminate()
            plugin.wait(10)
            sandbox.down()
        else:
            say(f"left running: sandbox {DEFAULT_DIR}, plugin pid {plugin.pid}")


if __name__ == "__main__":
    sys.exit(main())
