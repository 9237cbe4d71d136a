"""The restore benches' rig: one source pod cold-started and checkpointed by annotation, a
restore awaited to the plugin's verdict and the first answer, the node's facts and the model
into the result document, and everything cleaned up after. bench/restore_speed.py and
bench/scale_out.py build on it."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.common import model, results
from bench.common.disk import drop_caches
from bench.common.plugin import read_timings
from bench.common.workload import CONTAINER, Workload
from devtools.cri import Pod
from tests.gpu import gpu_pods

REPO = Path(__file__).resolve().parents[2]

log = logging.getLogger(__name__)


class RestoreRig:
    """A restore bench's state: its arguments, its result document (``--json``), the pods it runs."""

    def __init__(self, args: argparse.Namespace, doc: dict[str, Any]) -> None:
        self.args = args
        self.doc = doc
        self.pods: list[Pod] = []

    def save(self) -> None:
        results.write_json(self.args.json, self.doc)

    def stop(self, cri: Any, pod: Pod) -> None:
        try:
            cri.stop_pod(pod.id)
            cri.remove_pod(pod.id)
        except Exception as e:  # noqa: BLE001 - clean-up goes on
            log.warning("clean-up of %s: %s", pod.name, e)
        if pod in self.pods:
            self.pods.remove(pod)

    def source(self, cri: Any, plugin: Any, wl: Workload, name: str = "",
               annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The source pod cold-started (timed), checkpointed by annotation as ``name`` (default:
        the case's name; ``annotations`` added) and stopped."""
        rec: dict[str, Any] = {}
        rec["drop_caches_s"] = drop_caches()
        name = name or self.args.case
        a = cri.run_pod_sandbox(f"speed-src-{name}", annotations={"rekindle.dev/checkpoint": name, **(annotations or {})})
        self.pods.append(a)
        cid = wl.start(cri, a)
        ctl = plugin.control_dir(a.uid, CONTAINER)
        log_name = "worker-source.log" if name == self.args.case else f"worker-source-{name}.log"
        try:
            rec["cold_start_s"] = round(gpu_pods.wait_file(ctl / wl.ready_file(), self.args.cold_timeout,
                                                           gpu_pods.running(cri, cid)), 3)
        finally:
            (self.args.out_dir / log_name).write_text(gpu_pods.container_logs(cri, cid)[-100_000:])
        rec["cold"] = wl.cold_record(ctl, cri, a)
        st = gpu_pods.wait_status(plugin, a, CONTAINER, {"published", "checkpoint-failed"}, 600)
        rec["checkpoint_phase"], rec["checkpoint"] = st["phase"], st["timings"]
        if st["phase"] != "published":
            raise AssertionError(f"checkpoint failed: {st.get('reason')}")
        again = getattr(self.args, "recheckpoint", "")  # bench.scale_out shares this, without it
        if again:
            rec["checkpoints"] = [self.recheckpoint(plugin, cid, i, thp) for i, thp in enumerate(again.split(","))]
            self.save()
        self.stop(cri, a)  # frees the GPU and the source's host memory before the measurements
        return rec

    def recheckpoint(self, plugin: Any, cid: str, i: int, thp: str) -> dict[str, Any]:
        """The running source checkpointed once more through the CLI with ``--checkpoint-thp
        thp`` (same code, same source, same run: the THP modes side by side); the artifact is
        deleted after, the disk holds one more at most."""
        name = f"{self.args.case}-again-{i}"
        paths = ["--state-dir", str(plugin.state_dir), "--store", str(plugin.store),
                 "--containerd-state", str(plugin.sandbox.state_dir),
                 "--containerd-socket", str(plugin.sandbox.containerd_socket)]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "nri_plugin", "checkpoint", *paths, "--container-id", cid,
                            "--namespace", "default", "--name", name, "--checkpoint-thp", thp, "-o", "json"],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
        rec: dict[str, Any] = {"thp": thp, "seconds": round(time.monotonic() - t0, 3)}
        if r.returncode:
            rec["error"] = r.stderr[-2000:]
        else:
            rec["timings"] = json.loads(r.stdout)["timings"]
        (self.args.out_dir / f"checkpoint-again-{i}.log").write_text(r.stderr[-200_000:])
        subprocess.run([sys.executable, "-m", "nri_plugin", "artifacts", "delete", *paths[:4], "--namespace",
                        "default", name], cwd=REPO, capture_output=True, timeout=120)
        print(f"checkpoint again ({thp}): {rec.get('timings') or rec.get('error')}", flush=True)
        return rec

    def await_restore(self, cri: Any, plugin: Any, wl: Workload, b: Pod, path: str, t0: float,
                      rec: dict[str, Any]) -> bool:
        """After ``wl.start`` (at ``t0``) in a pod annotated to restore: the plugin's verdict, then
        the first answer, into ``rec`` (restore_s, phases, first_answer_s, identical, answer; on
        the streamed path its serve's figures). False when the plugin cold-started the pod."""
        early: concurrent.futures.Future[tuple[tuple[bool, dict[str, Any]], float]] | None = None
        # a streamed restore (auto's, for a CUDA tree) runs and answers before its last page is in: ask at once
        if path.startswith("stream") or path == "auto":
            early = concurrent.futures.ThreadPoolExecutor(1).submit(
                lambda: (wl.answer(cri, b, plugin.control_dir(b.uid, CONTAINER)), time.monotonic() - t0))
        st = gpu_pods.wait_status(plugin, b, CONTAINER, {"restored", "cold-start"}, 600)
        rec["restore_s"] = round(time.monotonic() - t0, 3)
        rec["phases"] = st["timings"]
        if st["phase"] != "restored":
            rec["failure"] = st.get("reason")
            rec["identical"] = False
            return False
        if early is not None:
            (same, extra), answered = early.result(timeout=600)
        else:
            same, extra = wl.answer(cri, b, plugin.control_dir(b.uid, CONTAINER))
            answered = time.monotonic() - t0
        rec["first_answer_s"] = round(answered, 3)
        rec["identical"] = same
        rec["answer"] = extra
        doc = read_timings(plugin, b)
        if doc is not None:
            rec["route"] = doc.get("route")  # the way it took (runtime.route): path, kind, reason
            if path.startswith("stream") or "stream" in doc:  # the serve's own figures: faults, waits, threads
                rec["stream"] = doc.get("stream")
            rec["node_cache"] = doc.get("cache")  # warm (mapped, filled from it), cold or off
        return True

    def describe(self, wl: Workload) -> bool:
        """The node's GPUs, CRIU's version and (llm-7b) the model, into the doc; False (saved)
        when the model could not be made."""
        doc, args = self.doc, self.args
        if not wl.cpu:
            doc["gpus"] = results.gpu_lines()
        doc["criu"] = results.criu_version()
        if wl.gib is None:
            made, error = model.make_in_child(args.model_dir)
            if made is None:
                doc["failure"] = f"make-model: {error}"
                self.save()
                return False
            doc["model"] = made
        return True

    def clean_up(self, cri: Any, plugin: Any, work: Path) -> None:
        """Every pod left stopped, the plugin stopped, its and CRIU's logs copied out, the store and
        the node cache removed."""
        args = self.args
        for p in list(self.pods):
            self.stop(cri, p)
        plugin.stop()
        shutil.copy(plugin.log_path, args.out_dir / f"plugin-{args.case}.log")
        # CRIU's own logs (timestamped, -v4): where its dump and restore time goes
        for log_file in (work / "plugin" / "state" / "logs").glob("*/*.log"):
            shutil.copy(log_file, args.out_dir / f"{log_file.parent.name}-{log_file.name}")
        cri.close()
        shutil.rmtree(work / "plugin" / "store", ignore_errors=True)
        cache = work / "plugin" / "state" / "cache"
        if os.path.ismount(cache):  # the plugin's tmpfs (--cache-tmpfs), mounted on this host
            subprocess.run(["umount", "-l", str(cache)], check=False)
        shutil.rmtree(cache, ignore_errors=True)  # a node cache on disk (the plugin's default) holds a copy
