"""The one GPU type: the driver's listing keyed by device minor, a container's GPUs by its device
nodes, and the node's facts narrowed to them."""

from __future__ import annotations

from pathlib import Path

from runtime.compat import NodeFacts
from runtime.gpu import devices as gpus
from runtime.gpu.target import source_gpus, target_facts
from runtime.manifest import CudaInfo, Gpu

A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def proc_gpus(tmp_path: Path) -> str:
    """A stand-in for /proc/driver/nvidia/gpus: two GPUs whose bus order is not their minor order."""
    for bus, minor, uuid in (("0000:c1:00.0", 0, A), ("0000:41:00.0", 1, B)):
        d = tmp_path / bus
        d.mkdir()
        (d / "information").write_text(f"Model: \t\t NVIDIA H200\nIRQ:   42\nGPU UUID: \t {uuid}\n"
                                       f"Device Minor: \t {minor}\n")
    (tmp_path / "0000:99:00.0").mkdir()  # no information file: skipped
    return str(tmp_path)


def test_node_gpus_by_minor_and_visible_by_device_node(tmp_path):
    root = proc_gpus(tmp_path)
    assert gpus.node_gpus(root) == {0: Gpu(A, "NVIDIA H200"), 1: Gpu(B, "NVIDIA H200")}
    assert gpus.node_gpus(str(tmp_path / "none")) == {}
    devices = [("/dev/nvidia1", 195, 1), ("/dev/nvidiactl", 195, 255), ("/dev/null", 1, 3)]
    assert gpus.visible_gpus(devices, root) == [Gpu(B, "NVIDIA H200")]


def test_target_facts_narrow_to_the_containers_gpus_with_cudas_names(tmp_path, monkeypatch):
    root = proc_gpus(tmp_path)
    monkeypatch.setattr(gpus, "node_gpus", lambda proc_gpus=root: {0: Gpu(A, "H200 (driver)"), 1: Gpu(B, "x")})
    facts = NodeFacts("n", "6.8.0", "x86_64", "4.2.1", CudaInfo("580.1", (Gpu(A, "NVIDIA H200"), Gpu(B, "NVIDIA H200"))))
    spec = {"linux": {"devices": [{"path": "/dev/nvidia0", "major": 195, "minor": 0}]}}
    assert target_facts(facts, spec).cuda == CudaInfo("580.1", (Gpu(A, "NVIDIA H200"),))
    assert target_facts(facts, {}).cuda == facts.cuda  # given no GPU node: the node's


class Cuda:
    def gpus(self) -> list[Gpu]:
        return [Gpu(A, "NVIDIA H200"), Gpu(B, "NVIDIA H200")]


def test_source_gpus_are_the_containers_else_all_cuda_sees(tmp_path, monkeypatch):
    root = proc_gpus(tmp_path)
    monkeypatch.setattr(gpus, "node_gpus", lambda proc_gpus=root: {0: Gpu(A, "NVIDIA H200"), 1: Gpu(B, "NVIDIA H200")})
    spec = {"linux": {"devices": [{"path": "/dev/nvidia1", "major": 195, "minor": 1}]}}
    assert source_gpus(Cuda(), spec) == (Gpu(B, "NVIDIA H200"),)
    assert source_gpus(Cuda(), {}) == tuple(Cuda().gpus())
