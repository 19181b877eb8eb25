"""Pytrees on the head: flatten to (key, leaf) pairs and describe the structure in JSON.

Keys are jax key paths (``jax.tree_util.keystr``), the names that errors and manifests use. Typed
PRNG keys are leaves of their own kind (``is_prng_key``, ``prng_key_shape``): saved as their key data.
The structure is kept in the manifest so that ``restore()`` without a target gives back the
same containers (dict, list, tuple, namedtuple, None).
"""

from __future__ import annotations

import importlib
from typing import Any

import jax

from mtc.shared.errors import TargetMismatchError


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """(keys, leaves, treedef) of ``tree``; None leaves are part of the structure."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [jax.tree_util.keystr(path) for path, _ in pairs]
    return keys, [leaf for _, leaf in pairs], treedef


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def encode(tree: Any) -> Any:
    """A JSON description of the containers of ``tree``; leaves become their leaf index."""
    counter = iter(range(1 << 62))

    def enc(x: Any) -> Any:
        if x is None:
            return {"t": "none"}
        if isinstance(x, dict):
            return {"t": "dict", "k": [_key(k) for k in sorted(x, key=_sort_key)],
                    "v": [enc(x[k]) for k in sorted(x, key=_sort_key)]}
        if _is_namedtuple(x):
            cls = type(x)
            return {"t": "namedtuple", "cls": f"{cls.__module__}:{cls.__qualname__}",
                    "k": list(cls._fields), "v": [enc(v) for v in x]}
        if isinstance(x, (list, tuple)):
            return {"t": type(x).__name__ if type(x) in (list, tuple) else "tuple", "v": [enc(v) for v in x]}
        children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
        if len(children) == 1 and children[0] is x:
            return {"t": "leaf", "i": next(counter)}
        # Other registered pytree nodes (dataclasses, flax structs): keep their leaves in order.
        return {"t": "node", "type": type(x).__qualname__,
                "v": [enc(v) for v in jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)]}

    return enc(tree)


def _key(k: Any) -> Any:
    if isinstance(k, (str, int, bool)) or k is None:
        return k
    return str(k)


def _sort_key(k: Any) -> Any:
    # jax sorts dict keys; mixed key types fall back to their string form.
    return (type(k).__name__, k) if isinstance(k, (int, float, str)) else (type(k).__name__, str(k))


def decode(doc: Any, leaves: list[Any]) -> Any:
    """Rebuild the containers described by ``encode`` around ``leaves`` (in flatten order)."""
    it = iter(leaves)

    def dec(d: Any) -> Any:
        t = d["t"]
        if t == "none":
            return None
        if t == "leaf":
            return next(it)
        if t == "dict":
            return {k: dec(v) for k, v in zip(d["k"], d["v"])}
        if t == "list":
            return [dec(v) for v in d["v"]]
        if t == "tuple":
            return tuple(dec(v) for v in d["v"])
        if t == "namedtuple":
            values = [dec(v) for v in d["v"]]
            cls = _import(d["cls"])
            if cls is not None and tuple(getattr(cls, "_fields", ())) == tuple(d["k"]):
                return cls(*values)
            return dict(zip(d["k"], values))
        if t == "node":
            return [dec(v) for v in d["v"]]
        raise ValueError(f"unknown tree node type {t!r} in manifest")

    return dec(doc)


def _import(path: str) -> Any:
    module, _, qual = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def prng_key_shape(impl: str) -> tuple[int, ...]:
    """The trailing key data dimensions of one key of ``impl`` ((2,) for threefry2x32)."""
    try:
        return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)
    except (ValueError, TypeError, KeyError) as e:
        raise TargetMismatchError(f"PRNG impl {impl!r} is not known to this jax {jax.__version__} ({e}); "
                                  "restore with the jax the checkpoint was saved with") from None
