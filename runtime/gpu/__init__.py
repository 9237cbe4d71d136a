"""The GPUs: the driver's checkpoint API through ctypes (``driver``), a tree's CUDA processes
checkpointed and restored in order (``cuda``), which GPUs a container was given (``devices``,
from its device nodes), and what a restore onto them needs (``target``: the GPU map, the device
nodes, the node facts). ``nri_plugin.cuda_checkpoint`` is the same API as a command.

The flows use the names below."""

from runtime.gpu.cuda import Checkpointer, CudaCheckpointer, build_gpu_map
from runtime.gpu.target import (
    cuda_restore,
    ensure_device_nodes,
    facts_for_devices,
    hold_cuda,
    node_cuda,
    source_gpus,
    target_facts,
)

__all__ = ["Checkpointer", "CudaCheckpointer", "build_gpu_map", "cuda_restore", "ensure_device_nodes",
           "facts_for_devices", "hold_cuda", "node_cuda", "source_gpus", "target_facts"]
