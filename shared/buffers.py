"""Host buffers both sides hand to JAX or to sockets.

A 64-byte aligned host buffer becomes a CPU ``jax.Array`` without a copy
(``jax.device_put(buf, dev, may_alias=True)``), so staging, restore and receive buffers are
allocated here.
"""

from __future__ import annotations

import numpy as np

ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def byte_view(data) -> memoryview:
    """A flat unsigned-byte memoryview of ``data`` (an array or a buffer) without copying.

    Any dtype, bfloat16 too (an array is viewed as uint8 first, which also covers dtypes the
    buffer protocol cannot describe). Writable when ``data`` is. Refuses object arrays and
    non-contiguous data (blobs and payloads are raw C-order bytes).
    """
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError(f"cannot store an array of dtype {data.dtype}: it holds Python objects, not bytes")
        if not data.flags.c_contiguous:
            raise ValueError("array is not C-contiguous; pass np.ascontiguousarray(a) (blobs are raw C-order bytes)")
        if data.size == 0:
            return memoryview(bytearray()) if data.flags.writeable else memoryview(b"")
        return memoryview(data.reshape(-1).view(np.uint8))
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("buffer is not C-contiguous (blobs are raw C-order bytes)")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv
