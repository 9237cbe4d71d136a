"""ctypes binding of the CUDA driver's process-checkpoint API (libcuda, driver >= 570; GPU remap >= 580).

Contract:

- Nothing is loaded at import. :func:`load_driver` opens ``libcuda.so.1`` (or a given path), applies
  :data:`SIGNATURES` once and installs an errcheck on every ``CUresult`` call, so a non-zero result
  raises :class:`runtime.errors.CudaError` ``(call, code, name)`` with the name from
  ``cuGetErrorName`` (or :data:`ERROR_NAMES` when that fails).
- A missing library, or a library without the ``cuCheckpointProcess*`` symbols, raises
  :class:`runtime.errors.CudaUnavailable`.
- Argument structs follow the CUDA 13 header: every one is 64 bytes, ctypes zero-fills them, so
  every reserved byte is zero. ``CUcheckpointRestoreArgs``: ``gpuPairs`` pointer at 0,
  ``gpuPairsCount`` at 8; ``CUcheckpointGpuPair``: 32 bytes, old UUID at 0, new UUID at 16.
- :class:`Driver` is a thin, typed wrapper; it is not thread-safe by itself: the caller
  (:class:`runtime.gpu.cuda.CudaCheckpointer`) funnels all calls through one thread. Calls go
  through ``ctypes.CDLL``, which lets go of the GIL, so a call that hangs in the driver blocks
  only its own thread: the caller can stop waiting at a deadline and carry on on another (the
  hung one stays in libcuda; libcuda itself is thread-safe).
- GPU UUID strings are ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's form).
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from runtime.errors import CudaError, CudaUnavailable

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"
LIBNVML = "libnvidia-ml.so.1"

c_int_p = ctypes.POINTER(ctypes.c_int)
c_uint_p = ctypes.POINTER(ctypes.c_uint)


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 0 = wait forever
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - 8)),
        ("reserved1", ctypes.c_uint64),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


# name -> (argtypes, restype). Every call here returns CUresult (c_int) and gets the errcheck,
# except cuGetErrorName, which the errcheck itself uses.
SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "cuInit": ([ctypes.c_uint], ctypes.c_int),
    "cuDriverGetVersion": ([c_int_p], ctypes.c_int),
    "cuDeviceGetCount": ([c_int_p], ctypes.c_int),
    "cuDeviceGet": ([c_int_p, ctypes.c_int], ctypes.c_int),
    "cuDeviceGetName": ([ctypes.c_char_p, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "cuDeviceGetUuid_v2": ([ctypes.POINTER(CUuuid), ctypes.c_int], ctypes.c_int),
    "cuDeviceGetUuid": ([ctypes.POINTER(CUuuid), ctypes.c_int], ctypes.c_int),
    "cuGetErrorName": ([ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
    "cuCheckpointProcessLock": ([ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)], ctypes.c_int),
    "cuCheckpointProcessCheckpoint": (
        [ctypes.c_int, ctypes.POINTER(CUcheckpointCheckpointArgs)], ctypes.c_int),
    "cuCheckpointProcessRestore": ([ctypes.c_int, ctypes.POINTER(CUcheckpointRestoreArgs)], ctypes.c_int),
    "cuCheckpointProcessUnlock": ([ctypes.c_int, ctypes.POINTER(CUcheckpointUnlockArgs)], ctypes.c_int),
    "cuCheckpointProcessGetState": ([ctypes.c_int, c_int_p], ctypes.c_int),
    "cuCheckpointProcessGetRestoreThreadId": ([ctypes.c_int, c_int_p], ctypes.c_int),
}
NO_ERRCHECK = frozenset({"cuGetErrorName"})
OPTIONAL = frozenset({"cuDeviceGetUuid_v2", "cuDeviceGetUuid", "cuGetErrorName"})
CHECKPOINT_SYMBOLS = tuple(n for n in SIGNATURES if n.startswith("cuCheckpointProcess"))

# Fallback names (cuda.h) for when cuGetErrorName is absent or fails.
ERROR_NAMES: dict[int, str] = {
    1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM", 400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
    800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED", 909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}

_UUID_RE = re.compile(r"^(?:GPU-)?([0-9a-fA-F]{8})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?"
                      r"([0-9a-fA-F]{4})-?([0-9a-fA-F]{12})$")


def parse_uuid(text: str) -> bytes:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (prefix and dashes optional) -> 16 bytes."""
    m = _UUID_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a GPU UUID: {text!r} (want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return bytes.fromhex("".join(m.groups()))


def format_uuid(raw: bytes) -> str:
    """16 bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (lower-case, as nvidia-smi prints)."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def make_restore_args(pairs: Sequence[tuple[str, str]]) -> tuple[CUcheckpointRestoreArgs, Any]:
    """Restore args for ``pairs`` of (old UUID, new UUID); returns (args, array kept alive by the caller)."""
    if not pairs:
        return CUcheckpointRestoreArgs(), None
    array = (CUcheckpointGpuPair * len(pairs))()
    for i, (old, new) in enumerate(pairs):
        ctypes.memmove(array[i].oldUuid.bytes, parse_uuid(old), 16)
        ctypes.memmove(array[i].newUuid.bytes, parse_uuid(new), 16)
    args = CUcheckpointRestoreArgs()
    args.gpuPairs = ctypes.cast(array, ctypes.POINTER(CUcheckpointGpuPair))
    args.gpuPairsCount = len(pairs)
    return args, array


def error_name(lib: Any, code: int) -> str:
    fn = getattr(lib, "cuGetErrorName", None)
    if fn is not None:
        out = ctypes.c_char_p()
        try:
            if fn(code, ctypes.byref(out)) == 0 and out.value:
                return out.value.decode()
        except Exception:  # noqa: BLE001 - a name is a nicety; never mask the real error
            log.debug("cuGetErrorName(%d) failed", code, exc_info=True)
    return ERROR_NAMES.get(code, f"CUDA_ERROR_{code}")


def _checker(lib: Any) -> Callable[[int, Any, tuple[Any, ...]], tuple[Any, ...]]:
    def check(result: int, func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if result != 0:
            raise CudaError(func.__name__, int(result), error_name(lib, int(result)))
        return args
    return check


def load_library(path: str | None = None) -> ctypes.CDLL:
    """Open libcuda and apply SIGNATURES + errcheck; CudaUnavailable when it or its checkpoint API is missing."""
    name = path or LIBCUDA
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise CudaUnavailable(f"cannot load {name}: {exc}") from exc
    check = _checker(lib)
    for fname, (argtypes, restype) in SIGNATURES.items():
        try:
            fn = getattr(lib, fname)
        except AttributeError:
            if fname in OPTIONAL:
                continue
            why = " (the checkpoint API needs driver >= 570)" if fname in CHECKPOINT_SYMBOLS else ""
            raise CudaUnavailable(f"{name} has no {fname}{why}") from None
        fn.argtypes = argtypes
        fn.restype = restype
        if fname not in NO_ERRCHECK:
            fn.errcheck = check
    return lib


class Driver:
    """Typed calls into a loaded libcuda. Raises CudaError on any failing call."""

    def __init__(self, path: str | None = None, lib: Any = None) -> None:
        self.lib = lib if lib is not None else load_library(path)
        self._initialized = False

    def init(self) -> None:
        if not self._initialized:
            self.lib.cuInit(0)
            self._initialized = True

    def version(self) -> int:
        v = ctypes.c_int()
        self.lib.cuDriverGetVersion(ctypes.byref(v))
        return v.value

    def device_count(self) -> int:
        n = ctypes.c_int()
        self.lib.cuDeviceGetCount(ctypes.byref(n))
        return n.value

    def device(self, ordinal: int) -> int:
        d = ctypes.c_int()
        self.lib.cuDeviceGet(ctypes.byref(d), ordinal)
        return d.value

    def device_name(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.lib.cuDeviceGetName(buf, len(buf), dev)
        return buf.value.decode(errors="replace")

    def device_uuid(self, dev: int) -> str:
        u = CUuuid()
        fn = getattr(self.lib, "cuDeviceGetUuid_v2", None) or self.lib.cuDeviceGetUuid
        fn(ctypes.byref(u), dev)
        return format_uuid(bytes(u.bytes))

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        args = CUcheckpointLockArgs()
        args.timeoutMs = max(0, int(timeout_ms))
        self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(CUcheckpointCheckpointArgs()))

    def restore(self, pid: int, pairs: Sequence[tuple[str, str]] = ()) -> None:
        args, keep = make_restore_args(pairs)
        self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        del keep

    def unlock(self, pid: int) -> None:
        self.lib.cuCheckpointProcessUnlock(pid, ctypes.byref(CUcheckpointUnlockArgs()))

    def get_state(self, pid: int) -> int:
        s = ctypes.c_int()
        self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(s))
        return s.value

    def restore_tid(self, pid: int) -> int:
        t = ctypes.c_int()
        self.lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(t))
        return t.value


def nvml_driver_version(path: str | None = None) -> str | None:
    """The kernel driver's version string through NVML (e.g. '580.159.04'), or None when NVML fails."""
    try:
        nvml = ctypes.CDLL(path or LIBNVML)
        init = getattr(nvml, "nvmlInit_v2", None) or nvml.nvmlInit
    except (OSError, AttributeError):
        return None
    init.restype = ctypes.c_int
    if init() != 0:
        return None
    try:
        buf = ctypes.create_string_buffer(96)
        fn = nvml.nvmlSystemGetDriverVersion
        fn.argtypes = [ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        if fn(buf, len(buf)) != 0:
            return None
        return buf.value.decode() or None
    finally:
        nvml.nvmlShutdown()


_PROC_VERSION_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def proc_driver_version(text: str) -> str | None:
    """Parse /proc/driver/nvidia/version's first line ('... Kernel Module  580.159.04  ...')."""
    m = _PROC_VERSION_RE.search(text)
    return m.group(1) if m else None
