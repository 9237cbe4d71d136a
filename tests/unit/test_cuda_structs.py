"""Pure checks of the CUDA checkpoint binding: struct layouts, UUIDs, GPU maps, CLI parsing."""

from __future__ import annotations

import ctypes

import pytest

from nri_plugin import cuda_checkpoint
from runtime.gpu.cuda import GpuMapError, ProcessState, build_gpu_map, gpu_pairs
from runtime.gpu.driver import (
    CUcheckpointCheckpointArgs,
    CUcheckpointGpuPair,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
    CUuuid,
    format_uuid,
    make_restore_args,
    parse_uuid,
    proc_driver_version,
)

A = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
B = "GPU-11111111-2222-3333-4444-555555555555"
C = "GPU-99999999-8888-7777-6666-555555555555"


@pytest.mark.parametrize("struct,size", [
    (CUuuid, 16), (CUcheckpointLockArgs, 64), (CUcheckpointCheckpointArgs, 64),
    (CUcheckpointGpuPair, 32), (CUcheckpointRestoreArgs, 64), (CUcheckpointUnlockArgs, 64),
])
def test_struct_sizes(struct: type[ctypes.Structure], size: int) -> None:
    assert ctypes.sizeof(struct) == size


def test_struct_offsets() -> None:
    assert CUcheckpointLockArgs.timeoutMs.offset == 0
    assert CUcheckpointLockArgs.reserved0.offset == 4
    assert CUcheckpointLockArgs.reserved1.offset == 8
    assert CUcheckpointRestoreArgs.gpuPairs.offset == 0
    assert CUcheckpointRestoreArgs.gpuPairsCount.offset == 8
    assert CUcheckpointRestoreArgs.reserved.offset == 12
    assert CUcheckpointRestoreArgs.reserved1.offset == 56
    assert CUcheckpointGpuPair.oldUuid.offset == 0
    assert CUcheckpointGpuPair.newUuid.offset == 16


def test_lock_args_bytes_are_zero_but_timeout() -> None:
    args = CUcheckpointLockArgs()
    args.timeoutMs = 0x01020304
    raw = bytes(args)
    assert raw[:4] == (0x01020304).to_bytes(4, "little")
    assert raw[4:] == bytes(60)


def test_restore_args_with_pairs() -> None:
    args, keep = make_restore_args([(A, B), (B, A)])
    raw = bytes(args)
    assert int.from_bytes(raw[8:12], "little") == 2
    assert raw[12:] == bytes(52)  # every reserved byte zero
    pair0 = bytes(keep[0])
    assert pair0[:16] == parse_uuid(A) and pair0[16:] == parse_uuid(B)
    assert ctypes.addressof(args.gpuPairs.contents) == ctypes.addressof(keep)


def test_restore_args_without_pairs_are_all_zero() -> None:
    args, keep = make_restore_args([])
    assert keep is None and bytes(args) == bytes(64)


@pytest.mark.parametrize("text", [A, A.upper().replace("GPU-", "GPU-"), A[4:], A[4:].replace("-", "")])
def test_uuid_parse_forms(text: str) -> None:
    assert format_uuid(parse_uuid(text)) == A


def test_uuid_bytes_order() -> None:
    raw = parse_uuid(A)
    assert raw[0] == 0x0A and raw[15] == 0xF9 and len(raw) == 16


@pytest.mark.parametrize("bad", ["", "GPU-xyz", "MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9", A + "0", "GPU-0a1b"])
def test_uuid_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_uuid(bad)


def test_format_uuid_rejects_short() -> None:
    with pytest.raises(ValueError):
        format_uuid(b"\x00" * 15)


@pytest.mark.parametrize("src,dst,want", [
    ([A], [A], None),
    ([A, B], [A, B], None),
    ([], [], None),
    ([A], [B], {A: B}),
    ([A, B], [B, A], {A: B, B: A}),
    ([A, B], [A, C], {A: A, B: C}),
    ([A.upper()], [A[4:]], None),
])
def test_build_gpu_map(src: list[str], dst: list[str], want: dict[str, str] | None) -> None:
    assert build_gpu_map(src, dst) == want


@pytest.mark.parametrize("src,dst,needle", [
    ([A, B], [A], "same count"),
    ([A, A], [B, C], "duplicate"),
    ([A, B], [C, C], "duplicate"),
    (["nope"], [A], "not a GPU UUID"),
])
def test_build_gpu_map_errors(src: list[str], dst: list[str], needle: str) -> None:
    with pytest.raises(GpuMapError, match=needle):
        build_gpu_map(src, dst)


def test_gpu_pairs_rejects_non_injective() -> None:
    assert gpu_pairs(None) == []
    with pytest.raises(GpuMapError, match="same target"):
        gpu_pairs({A: C, B: C})


def test_process_state_names() -> None:
    assert str(ProcessState(0)) == "running"
    assert str(ProcessState(2)) == "checkpointed"
    assert ProcessState(42) is ProcessState.UNKNOWN


def test_proc_driver_version() -> None:
    line = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16)"
    assert proc_driver_version(line) == "580.159.04"
    assert proc_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar") == "550.54.15"
    assert proc_driver_version("garbage") is None


@pytest.mark.parametrize("argv,op,pid,timeout,dmap", [
    (["--toggle", "--pid", "12"], "toggle", 12, 0, {}),
    (["--action", "lock", "--pid", "7", "--timeout", "500"], "lock", 7, 500, {}),
    (["--action", "checkpoint", "--pid", "7"], "checkpoint", 7, 0, {}),
    (["--action", "restore", "--pid", "7", "--device-map", f"{A}={B},{B}={A}"], "restore", 7, 0, {A: B, B: A}),
    (["--action", "unlock", "-p", "7"], "unlock", 7, 0, {}),
    (["--get-state", "--pid", "99"], "get-state", 99, 0, {}),
    (["--get-restore-tid", "--pid", "99"], "get-restore-tid", 99, 0, {}),
    (["-h"], "help", 0, 0, {}),
    (["--help"], "help", 0, 0, {}),
])
def test_cli_parse(argv: list[str], op: str, pid: int, timeout: int, dmap: dict[str, str]) -> None:
    cmd = cuda_checkpoint.parse_args(argv)
    assert (cmd.op, cmd.pid, cmd.timeout_ms, cmd.device_map) == (op, pid, timeout, dmap)


@pytest.mark.parametrize("argv", [
    [], ["--pid", "3"], ["--toggle"], ["--toggle", "--get-state", "--pid", "3"],
    ["--action", "freeze", "--pid", "3"], ["--toggle", "--pid", "abc"], ["--toggle", "--pid", "-4"],
    ["--get-state", "--pid", "3", "--device-map", f"{A}={B}"],
    ["--action", "restore", "--pid", "3", "--device-map", "nonsense"],
    ["--action", "restore", "--pid", "3", "--device-map", f"{A}={B},{A}={C}"],
    ["--action", "lock", "--pid", "3", "--timeout", "-1"], ["--bogus"],
])
def test_cli_parse_rejects(argv: list[str]) -> None:
    with pytest.raises(cuda_checkpoint.UsageError):
        cuda_checkpoint.parse_args(argv)


def test_cli_help_and_usage_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cuda_checkpoint.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--action" in out and "--get-restore-tid" in out and "--device-map" in out
    assert cuda_checkpoint.main(["--toggle"]) == 1
    assert "--pid is required" in capsys.readouterr().err
