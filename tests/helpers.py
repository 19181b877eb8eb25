"""Helpers for tests: bit-for-bit comparison of restored trees, random states."""

from __future__ import annotations

import jax
import numpy as np


def as_bytes(x) -> tuple:
    """(type tag, dtype, shape, raw bytes) of a leaf: equal iff bit-for-bit equal.

    A typed PRNG key array compares by its impl and key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        a = np.asarray(jax.random.key_data(x))
        return ("key", str(jax.random.key_impl(x)), x.shape, a.shape, a.tobytes())
    if isinstance(x, jax.Array):
        a = np.asarray(x)
        return ("jax", a.dtype.name, a.shape, np.ascontiguousarray(a).tobytes())
    if isinstance(x, (np.ndarray, np.generic)):
        a = np.asarray(x)
        return ("numpy", a.dtype.name, a.shape, np.ascontiguousarray(a).tobytes())
    return ("py", type(x).__name__, (), repr(x))


def assert_trees_bitwise_equal(a, b, *, check_sharding: bool = True) -> None:
    """Same structure, same leaf kinds, dtypes, shapes, bytes (and shardings)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for (path, x), (_, y) in zip(la, lb):
        key = jax.tree_util.keystr(path)
        assert as_bytes(x) == as_bytes(y), f"leaf {key} differs"
        if check_sharding and isinstance(x, jax.Array):
            assert isinstance(y, jax.Array), key
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), f"leaf {key}: sharding {y.sharding} != {x.sharding}"


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random contents of any dtype (random bits reinterpreted, so every bit pattern occurs)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    out = raw.view(dtype).reshape(shape)
    if dtype.kind in "fc":
        # NaN payloads are preserved by a byte copy, but keep values finite for readability.
        out = np.where(np.isfinite(out), out, np.zeros((), dtype)).astype(dtype)
    return out


def control_connection(address: str, token: str, timeout: float = 10.0):
    """A socket to a sidecar daemon's control port, authenticated with ``token`` as a head does
    (``mtc.shared.auth``); the caller sends requests on it and closes it."""
    import socket

    from mtc.shared import auth, protocol

    s = socket.create_connection(protocol.parse_address(address), timeout=timeout)
    c = auth.new_nonce()
    protocol.send_request(s, protocol.Request("hello", 1, {"nonce": c}))
    hello = protocol.recv_reply(s)
    assert hello.error is None, hello.error
    key, n = auth.control_key(token), hello.result["nonce"]
    protocol.send_request(s, protocol.Request("auth", 2, {"proof": auth.proof(key, "client", n, c)}))
    done = protocol.recv_reply(s)
    assert done.error is None, done.error
    assert done.result["proof"] == auth.proof(key, "server", n, c)
    return s
