"""Device memory whose virtual address outlives its backing: CUDA's virtual memory management
through the driver API (ctypes, no extension to build).

An engine's sleep gives the GPU memory of its weights back and its wake-up takes it again at the
same virtual addresses (vLLM's sleep allocator, SGLang's torch_memory_saver), so the CUDA graphs
recorded over those tensors stay valid. :class:`Arena` does the same for one range: the address
is reserved once (``cuMemAddressReserve``), backed by ``map`` (``cuMemCreate``, ``cuMemMap``,
``cuMemSetAccess``) and given back by ``unmap`` (``cuMemUnmap``, ``cuMemRelease``); tensors placed
in it by :func:`as_bytes` keep their addresses across an ``unmap``/``map``, though not their
contents. Calls run on the thread whose CUDA context is current (the worker's main thread).
"""

from __future__ import annotations

import ctypes
from typing import Any

# cuda.h's values
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_MINIMUM = 0

_CUptr = ctypes.c_uint64   # CUdeviceptr
_CUhandle = ctypes.c_uint64  # CUmemGenericAllocationHandle


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    pass


def round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def _driver() -> Any:
    cu = ctypes.CDLL("libcuda.so.1")
    size, ptr, handle, flags = ctypes.c_size_t, _CUptr, _CUhandle, ctypes.c_ulonglong
    cu.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int]
    cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(ptr), size, size, ptr, flags]
    cu.cuMemAddressFree.argtypes = [ptr, size]
    cu.cuMemCreate.argtypes = [ctypes.POINTER(handle), size, ctypes.POINTER(_AllocationProp), flags]
    cu.cuMemMap.argtypes = [ptr, size, size, handle, flags]
    cu.cuMemSetAccess.argtypes = [ptr, size, ctypes.POINTER(_AccessDesc), size]
    cu.cuMemUnmap.argtypes = [ptr, size]
    cu.cuMemRelease.argtypes = [handle]
    cu.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return cu


class Arena:
    """One reserved range of ``size`` bytes (rounded up to the allocation granule) on ``device``,
    backed from the start."""

    def __init__(self, size: int, device: int = 0, driver: Any = None) -> None:
        self._cu = driver or _driver()
        self._prop = _AllocationProp(type=_ALLOCATION_TYPE_PINNED, location=_Location(_LOCATION_DEVICE, device))
        self._access = _AccessDesc(location=_Location(_LOCATION_DEVICE, device), flags=_ACCESS_READWRITE)
        granule = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", ctypes.byref(granule), ctypes.byref(self._prop),
                    _GRANULARITY_MINIMUM)
        self.size = round_up(max(1, size), granule.value)
        ptr = _CUptr()
        self._check("cuMemAddressReserve", ctypes.byref(ptr), self.size, 0, 0, 0)
        self.ptr = ptr.value
        self._handle: int | None = None
        self.map()

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the range with new device memory (its contents undefined)."""
        if self.mapped:
            return
        handle = _CUhandle()
        self._check("cuMemCreate", ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0)
        try:
            self._check("cuMemMap", self.ptr, self.size, 0, handle, 0)
            self._check("cuMemSetAccess", self.ptr, self.size, ctypes.byref(self._access), 1)
        except CudaError:
            self._cu.cuMemUnmap(self.ptr, self.size)
            self._cu.cuMemRelease(handle)
            raise
        self._handle = handle.value

    def unmap(self) -> None:
        """Give the device memory back; the address stays reserved."""
        if self._handle is None:
            return
        self._check("cuMemUnmap", self.ptr, self.size)
        self._check("cuMemRelease", self._handle)
        self._handle = None

    def _check(self, fn: str, *args: Any) -> None:
        rc = getattr(self._cu, fn)(*args)
        if rc != 0:
            name = ctypes.c_char_p()
            self._cu.cuGetErrorName(rc, ctypes.byref(name))
            raise CudaError(f"{fn}: {(name.value or b'?').decode()} ({rc})")


class _Interface:
    """What ``torch.as_tensor`` reads: a byte vector at a device address (no owner: the arena
    keeps the memory)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}


def as_bytes(torch: Any, arena: Arena) -> Any:
    """The whole arena as one uint8 CUDA tensor that aliases it."""
    return torch.as_tensor(_Interface(arena.ptr, arena.size), device="cuda")
