"""Turning raw registers of a library call into words: enum names, sizes,
and the `detail` text of an api_call row."""

from __future__ import annotations

CUDA_ERRORS = {
    0: "cudaSuccess", 1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError", 4: "cudaErrorCudartUnloading", 35: "cudaErrorInsufficientDriver",
    46: "cudaErrorDevicesUnavailable", 98: "cudaErrorInvalidDeviceFunction", 100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice", 209: "cudaErrorNoKernelImageForDevice", 400: "cudaErrorInvalidResourceHandle",
    700: "cudaErrorIllegalAddress", 719: "cudaErrorLaunchFailure", 999: "cudaErrorUnknown",
}
NCCL_RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}
NCCL_DATATYPES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16",
                  7: "float32", 8: "float64", 9: "bfloat16"}
NCCL_DATATYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
NCCL_REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
MEMCPY_KINDS = {0: "HostToHost", 1: "HostToDevice", 2: "DeviceToHost", 3: "DeviceToDevice", 4: "Default"}


def _signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def ret_name(kind: str, ret: int) -> str | None:
    r = _signed(ret, 32)
    if kind == "cuda_error":
        return CUDA_ERRORS.get(r, f"cudaError({r})")
    if kind == "nccl_result":
        return NCCL_RESULTS.get(r, f"ncclResult({r})")
    return None


def arg_text(kind: str, v: int) -> str:
    if kind == "ptr":
        return hex(v)
    if kind == "i32":
        return str(_signed(v, 32))
    if kind == "u32":
        return str(v & 0xFFFFFFFF)
    if kind == "i64":
        return str(_signed(v, 64))
    if kind == "dim3":  # x and y packed in one register (z follows separately)
        return f"{v & 0xFFFFFFFF}x{v >> 32}"
    if kind == "cuda_memcpy_kind":
        return MEMCPY_KINDS.get(v & 0xFFFFFFFF, str(v))
    if kind == "nccl_datatype":
        return NCCL_DATATYPES.get(v & 0xFFFFFFFF, str(v))
    if kind == "nccl_redop":
        return NCCL_REDOPS.get(v & 0xFFFFFFFF, str(v))
    return str(v)


def deref_value(kind: str, raw: tuple[int, int], ok: bool) -> int | None:
    if not ok:
        return None
    lo, hi = raw
    if kind == "i32":
        return _signed(lo, 32)
    if kind == "u64":
        return lo
    if kind == "tensor_vector":  # std::vector<at::Tensor>: begin, end; 8 bytes per Tensor
        return (hi - lo) // 8 if hi >= lo else None
    return lo


def detail(spec, args: list[int], deref: int | None, symbolizer=None) -> str:
    parts = []
    for i, a in enumerate(spec.args):
        if a.type == "symbol" and symbolizer is not None:
            parts.append(f"{a.name}={symbolizer(args[i]) or hex(args[i])}")
        else:
            parts.append(f"{a.name}={arg_text(a.type, args[i])}")
    if spec.deref and deref is not None:
        parts.append(f"{spec.deref.name}={deref}")
    return " ".join(parts)

