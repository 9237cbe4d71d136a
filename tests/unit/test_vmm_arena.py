"""bench/workloads/vmm_arena.py against a fake driver (the GPU run exercises the real one): the
address is reserved once, rounded to the granule, and kept while its backing comes and goes; a
failed call is named; a failed map gives back what it took."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from bench.workloads import vmm_arena


class FakeDriver:
    def __init__(self, granule: int = 2 << 20, fail: str = "") -> None:
        self.granule, self.fail = granule, fail
        self.calls: list[str] = []
        self.live: set[int] = set()  # handles created and not released
        self.mapped: dict[int, int] = {}  # address -> handle
        self._next = 0

    def _rc(self, name: str) -> int:
        self.calls.append(name)
        return 2 if name == self.fail else 0  # CUDA_ERROR_OUT_OF_MEMORY

    def cuMemGetAllocationGranularity(self, out: Any, prop: Any, option: int) -> int:  # noqa: N802 - the driver's
        out._obj.value = self.granule
        return self._rc("cuMemGetAllocationGranularity")

    def cuMemAddressReserve(self, out: Any, size: int, align: int, addr: int, flags: int) -> int:  # noqa: N802
        out._obj.value = 0x7F0000000000
        self.reserved = size
        return self._rc("cuMemAddressReserve")

    def cuMemCreate(self, out: Any, size: int, prop: Any, flags: int) -> int:  # noqa: N802
        rc = self._rc("cuMemCreate")
        if not rc:
            self._next += 1
            out._obj.value = self._next
            self.live.add(self._next)
        return rc

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> int:  # noqa: N802
        rc = self._rc("cuMemMap")
        if not rc:
            self.mapped[ptr] = int(getattr(handle, "value", handle))
        return rc

    def cuMemSetAccess(self, ptr: int, size: int, desc: Any, count: int) -> int:  # noqa: N802
        return self._rc("cuMemSetAccess")

    def cuMemUnmap(self, ptr: int, size: int) -> int:  # noqa: N802
        self.mapped.pop(ptr, None)
        return self._rc("cuMemUnmap")

    def cuMemRelease(self, handle: Any) -> int:  # noqa: N802
        self.live.discard(int(getattr(handle, "value", handle)))
        return self._rc("cuMemRelease")

    def cuGetErrorName(self, rc: int, out: Any) -> int:  # noqa: N802
        out._obj.value = b"CUDA_ERROR_OUT_OF_MEMORY"
        return 0


def test_the_address_is_reserved_once_and_outlives_its_backing():
    cu = FakeDriver()
    arena = vmm_arena.Arena(5 << 20, driver=cu)
    assert arena.size == cu.reserved == 6 << 20  # three granules
    assert arena.mapped and cu.mapped == {arena.ptr: 1}
    arena.unmap()
    assert not arena.mapped and not cu.mapped and not cu.live
    arena.map()
    assert cu.mapped == {arena.ptr: 2} and cu.live == {2}  # new memory, the same address
    assert cu.calls.count("cuMemAddressReserve") == 1
    arena.unmap()
    arena.unmap()  # once is enough
    assert cu.calls.count("cuMemRelease") == 1 + 1


def test_a_failed_call_is_named():
    with pytest.raises(vmm_arena.CudaError, match="cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY"):
        vmm_arena.Arena(1, driver=FakeDriver(fail="cuMemCreate"))


def test_a_failed_map_gives_back_the_memory_it_created():
    cu = FakeDriver(fail="cuMemSetAccess")
    with pytest.raises(vmm_arena.CudaError, match="cuMemSetAccess"):
        vmm_arena.Arena(1, driver=cu)
    assert not cu.live and not cu.mapped


def test_the_interface_torch_reads():
    iface = vmm_arena._Interface(0x1000, 64)
    assert iface.__cuda_array_interface__ == {"shape": (64,), "typestr": "|u1", "data": (0x1000, False),
                                              "version": 2, "strides": None}
    assert ctypes.sizeof(vmm_arena._AllocationProp) == 32  # cuda.h's CUmemAllocationProp
    assert ctypes.sizeof(vmm_arena._AccessDesc) == 12
