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
