"""The soak's training state, a pure function of (run seed, step), and its digest.

Both sides use it: the head process saves ``state(seed, step)`` and digests what it restores;
the soak driver keeps ``digest(state(seed, step))`` of every step it asked to save, so a restore
is compared bit for bit without the driver importing JAX.

Leaves change at different rates, as in training: some every step (parameters, optimizer
moments), some every few steps (an embedding), one never (a frozen table), so consecutive steps
share blobs (content addressing) and differ in others.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

# name -> (shape, dtype, changes every N steps (0: never), partition over ("data", "model"))
LEAVES = {
    "params/w": ((256, 512), np.float32, 1, (None, "model")),      # replicated over slices: twins
    "params/u": ((256, 512), np.float32, 1, ("data", "model")),    # split over both axes
    "params/emb": ((1024, 64), ml_dtypes.bfloat16, 3, (("data", "model"),)),
    "opt/mu": ((512, 256), np.float32, 1, ("data", None)),
    "frozen": ((256, 256), np.float32, 0, (None, "model")),
    "count": ((16,), np.int32, 1, ()),
}


def state(seed: int, step: int) -> dict[str, np.ndarray]:
    """The global arrays of ``step``: divisible by any mesh of 4 or 8 devices used here."""
    out = {}
    for i, (name, (shape, dtype, every, _)) in enumerate(LEAVES.items()):
        version = step // every if every else 0
        rng = np.random.default_rng([seed, i, version])
        if np.dtype(dtype).kind in "iu":
            out[name] = rng.integers(0, 1 << 20, shape, dtype=dtype)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return out


def digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over every leaf's name, dtype, shape and bytes: equal digests, equal states."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()
