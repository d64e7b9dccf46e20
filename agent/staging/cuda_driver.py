"""The CUDA driver API through ctypes (libcuda), each call made in the current device's primary context.
Staging uses it to page-lock host memory torch did not allocate (a mapped shared-memory segment:
segments.pin_host); the reasons for the driver API and for the primary context are at the functions."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in (("cuInit", [ctypes.c_uint]), ("cuDeviceGet", [ctypes.c_void_p, ctypes.c_int]),
                       ("cuDevicePrimaryCtxRetain", [ctypes.c_void_p, ctypes.c_int]),
                       ("cuCtxPushCurrent_v2", [ctypes.c_void_p]), ("cuCtxPopCurrent_v2", [ctypes.c_void_p]),
                       ("cuMemHostRegister_v2", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
                       ("cuMemHostUnregister", [ctypes.c_void_p]),
                       ("cuGetErrorName", [ctypes.c_int, ctypes.c_void_p])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _driver_error(lib: ctypes.CDLL, err: int) -> str:
    name = ctypes.c_char_p()
    lib.cuGetErrorName(err, ctypes.byref(name))
    return (name.value or b"?").decode() + f" ({err})"


@functools.cache
def _primary_context(ordinal: int) -> int:
    """The device's primary context (the one torch's runtime uses), retained once and never released: a
    release that drops the last reference destroys the context, and every registration made in it with it
    (seen on an H100: a pin in a process whose runtime had not made its context yet was gone at once)."""
    lib = _cuda_driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for err in (lib.cuInit(0), lib.cuDeviceGet(ctypes.byref(dev), ordinal),
                lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)):
        if err:
            raise RuntimeError(_driver_error(lib, err))
    return int(ctx.value or 0)


def _in_primary_context(call: Callable[[ctypes.CDLL], int]) -> tuple[int, str]:
    """Run a CUDA driver call in the current device's primary context, whatever is current on this thread.
    Why the driver API: a failed runtime call (cudaHostRegister) leaves the runtime's last error set, and torch
    then reports it from the next, unrelated CUDA call (seen on an H100: the first torch.empty on the GPU after
    a refused registration raised 'invalid argument').
    Returns (error code, its name); (0, "") on success."""
    lib = _cuda_driver()
    try:
        ctx = _primary_context(torch.cuda.current_device())
    except RuntimeError as exc:
        return -1, str(exc)
    err = lib.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx))
    if err:
        return err, _driver_error(lib, err)
    try:
        err = call(lib)
        return err, _driver_error(lib, err) if err else ""
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def host_register(address: int, nbytes: int) -> tuple[int, str]:
    """cuMemHostRegister: page-lock [address, address + nbytes). (error code, its name); (0, "") on success."""
    return _in_primary_context(lambda lib: lib.cuMemHostRegister_v2(address, nbytes, 0))


def host_unregister(address: int) -> tuple[int, str]:
    """cuMemHostUnregister of memory host_register page-locked. (error code, its name); (0, "") on success."""
    return _in_primary_context(lambda lib: lib.cuMemHostUnregister(address))
