"""Restore planning, as values the dispatcher executes (docs/architecture.md, "The seam").

``plan_target`` turns a step manifest and a restore target (the shardings of the *current*
mesh) into load requests; ``host_needs`` says which saved blobs each host needs for its
shards of them; ``RestorePlan`` adds where those blobs are now (the inventory's holders) and
so which host must pull which blob before the load. All of it is computed on the head from
plain values, and unit-tested without processes (a lost slice, a resized mesh, a bad holder).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from mtc.head import tree as tree_lib
from mtc.head.dispatch.interface import LoadRequest
from mtc.shared import format as fmt
from mtc.shared import shardings
from mtc.shared.errors import TargetMismatchError


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What a restore of ``step`` does before the load: per host, the blobs it needs and lacks."""

    step: int
    needs: dict  # host -> sorted blob names for its shards of the target
    holders: dict | None  # blob -> hosts that hold it now (None: restore from a backup, or unknown)

    @property
    def lacking(self) -> dict[str, list[str]]:
        """host -> the needed blobs it does not hold (to pull from a peer, else the backup)."""
        if self.holders is None:
            return {}
        out = {h: [b for b in bs if h not in self.holders.get(b, ())] for h, bs in self.needs.items()}
        return {h: bs for h, bs in out.items() if bs}

    @property
    def unavailable(self) -> list[str]:
        """Needed blobs that no host holds (only a backup can give them)."""
        if self.holders is None:
            return []
        return sorted({b for bs in self.needs.values() for b in bs if not self.holders.get(b)})

    def nbytes(self, sizes: Mapping[str, int]) -> tuple[int, int]:
        """(bytes, blobs) the hosts need in all (a blob two hosts need counts twice)."""
        return (sum(sizes[b] for bs in self.needs.values() for b in bs), sum(len(bs) for bs in self.needs.values()))

    def after_fetch(self, fetched: Mapping[str, Sequence[str]]) -> "RestorePlan":
        """This plan once the hosts of ``fetched`` (host -> blobs) hold those blobs too: what the
        load reads from after pulls from peers or a fetch from the backup."""
        holders = {b: set(hs) for b, hs in (self.holders or {}).items()}
        for h, blobs in fetched.items():
            for b in blobs:
                holders.setdefault(b, set()).add(h)
        return dataclasses.replace(self, holders={b: frozenset(hs) for b, hs in holders.items()})


def make_plan(step: int, manifest: fmt.StepManifest, requests: list[LoadRequest], hosts: Sequence[str],
              host_of_device: Callable[[int], str], holders: Mapping[str, set] | None) -> RestorePlan:
    return RestorePlan(step=step, needs=host_needs(manifest, requests, hosts, host_of_device),
                       holders=None if holders is None else {b: frozenset(h) for b, h in holders.items()})


def scalar_value(doc: dict) -> Any:
    t, v = doc["type"], doc["v"]
    return {"bool": bool, "int": int, "float": float.fromhex, "str": str}[t](v)


def host_needs(manifest: fmt.StepManifest, requests: list[LoadRequest], hosts: Sequence[str],
               host_of_device: Callable[[int], str]) -> dict[str, list[str]]:
    """host -> the blobs it needs to assemble its shards of the restore target."""
    out: dict[str, set[str]] = {h: set() for h in hosts}
    for r in requests:
        rec = r.record
        if r.sharding is None:
            for h in out:
                out[h].update(sh.blob for sh in rec.shards)
            continue
        # Saved boxes of one array are disjoint or identical (replicas), so a target box that was
        # saved as is overlaps exactly the shards with that box: no scan in the common case
        # (every restore plans this, and a scan is arrays x devices x shards).
        exact: dict[Any, list[str]] = {}
        for sh in rec.shards:
            exact.setdefault(sh.box, []).append(sh.blob)
        for dev_id, box in shardings.device_boxes(r.sharding, rec.shape).items():
            host = host_of_device(dev_id)
            blobs = exact.get(box)
            if blobs is None:  # resharded: every saved shard it overlaps
                blobs = [sh.blob for sh in rec.shards if fmt.box_intersect(sh.box, box) is not None]
            out.setdefault(host, set()).update(blobs)
    return {h: sorted(b) for h, b in out.items()}

class NothingSavedError(TargetMismatchError):
    """A restore target's ``AS_SAVED`` names a place where the step holds nothing (``keys``)."""

    def __init__(self, keys: list[str], message: str):
        super().__init__(message)
        self.keys = list(keys)


class _AsSaved:
    """The marker ``AS_SAVED`` (see ``plan_target``)."""

    _instance = None

    def __new__(cls) -> "_AsSaved":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "mtc.head.AS_SAVED"

    def __reduce__(self) -> str:
        return "AS_SAVED"


AS_SAVED = _AsSaved()
"""In a restore target, a leaf that stands for the whole saved subtree at its place, restored as
saved: its leaves with the shardings they were saved with, host data (numpy, byte items) as it
was. ``restore(target={"state": abstract, "iter": AS_SAVED})`` gives ``iter`` back without
knowing its structure or sizes in advance."""


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith((prefix + "[", prefix + "."))


def _subtree(obj: Any, path: tuple) -> Any:
    """The part of a decoded tree (``tree_lib.decode``) at a jax key path."""
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            obj = obj[entry.key]
        elif isinstance(entry, jax.tree_util.SequenceKey):
            obj = obj[entry.idx]
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            obj = getattr(obj, entry.name) if not isinstance(obj, dict) else obj[entry.name]
        else:  # FlattenedIndexKey: a registered node, decoded as a list of its children
            obj = obj[entry.key]
    return obj


def plan_target(manifest: fmt.StepManifest, target: Any, partial: Any = False) -> tuple[list[LoadRequest], Callable]:
    """The arrays to load (each with the sharding it must come back in) and how to rebuild the tree.

    A leaf ``AS_SAVED`` in ``target`` stands for every saved leaf under its key, restored as saved.
    """
    by_key = {a.key: a for a in manifest.arrays}
    whole: dict[int, tuple] = {}  # position in target -> its key path (an AS_SAVED leaf)
    if target is None:
        keys = [a.key for a in manifest.arrays]
        targets = [None] * len(keys)
        rebuild = lambda leaves: tree_lib.decode(manifest.tree, leaves)  # noqa: E731
    else:
        keys, targets, treedef = tree_lib.flatten(target)
        if any(t is AS_SAVED for t in targets):
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]]
            whole = {i: paths[i] for i, t in enumerate(targets) if t is AS_SAVED}
        covered = {k for i, k in enumerate(keys) if i not in whole}
        empty = []
        for i in whole:
            under = [a.key for a in manifest.arrays if _under(a.key, keys[i])]
            if not under:
                empty.append(keys[i])
            covered.update(under)
        if empty:
            raise NothingSavedError(empty, 
                f"step {manifest.step} holds nothing under {', '.join(empty)} (restore target AS_SAVED); "
                "restore without that item, or restore a step saved with it")
        if partial is True:
            missing = []
        else:  # False: every saved leaf; key prefixes: every saved leaf under them
            prefixes = tuple(partial) if partial else ("",)
            missing = sorted(k for k in set(by_key) - covered if k.startswith(prefixes))
        extra = sorted(k for i, k in enumerate(keys) if i not in whole and k not in by_key)
        if missing or extra:
            raise TargetMismatchError(
                f"restore target does not match the tree saved at step {manifest.step}: "
                + (f"missing {missing[:5]}" if missing else "")
                + (" " if missing and extra else "")
                + (f"not in checkpoint {extra[:5]}" if extra else "")
                + "; pass a target with the saved structure (or none)")
        rebuild = lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)  # noqa: E731
    requests: list[LoadRequest] = []
    slots: list[tuple[str, Any]] = []

    def plan_leaf(rec: fmt.ArrayRecord, tgt: Any) -> tuple[str, Any]:
        if rec.kind == "scalar":
            return ("value", scalar_value(rec.value))
        requests.append(LoadRequest(rec, target_sharding(rec, tgt)))
        return ("key" if rec.prng_impl else "array", len(requests) - 1)

    for i, (key, tgt) in enumerate(zip(keys, targets)):
        if i in whole:
            slots.append(("saved", (whole[i], [(a.key, plan_leaf(a, None)) for a in manifest.arrays
                                                 if _under(a.key, key)])))
        else:
            slots.append(plan_leaf(by_key[key], tgt))

    def value(slot: tuple[str, Any], arrays: list[Any]) -> Any:
        kind, v = slot
        if kind == "key":
            return jax.random.wrap_key_data(arrays[v], impl=requests[v].record.prng_impl)
        return v if kind == "value" else arrays[v]

    def finish(arrays: list[Any]) -> Any:
        leaves = []
        for slot in slots:
            if slot[0] != "saved":
                leaves.append(value(slot, arrays))
                continue
            path, parts = slot[1]
            got = {k: value(s, arrays) for k, s in parts}
            saved = tree_lib.decode(manifest.tree, [got.get(a.key) for a in manifest.arrays])
            leaves.append(_subtree(saved, path))
        return rebuild(leaves)

    return requests, finish

def uncommit_lone(target: Any, restored: Any) -> Any:
    """Leaves whose target is the default device alone, beside leaves on several devices, as
    uncommitted arrays there (what ``optimizer.init()`` gives for a scalar): jit may move them.

    A state whose optimizer scalar was never placed trains (jit moves the uncommitted scalar
    onto the mesh); restored committed to that one device, the same train step would fail inside
    jit ("incompatible devices"), far from its cause. A leaf on any other single device stays
    committed there, as its target says."""
    t_leaves = jax.tree_util.tree_leaves(target)
    spans = [len(s.device_set) for x in t_leaves
             if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and (s := getattr(x, "sharding", None)) is not None]
    if not spans or max(spans) == 1 or 1 not in spans:
        return restored
    default = jax.devices()[0]

    def lone(x: Any) -> bool:
        s = getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
        return isinstance(s, jax.sharding.SingleDeviceSharding) and s.device_set == {default}

    r_leaves, treedef = jax.tree_util.tree_flatten(restored)
    if len(r_leaves) != len(t_leaves):
        return restored
    out = [jax.numpy.asarray(np.asarray(r)) if lone(t) and isinstance(r, jax.Array) and not tree_lib.is_prng_key(r) else r
           for t, r in zip(t_leaves, r_leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def target_sharding(rec: fmt.ArrayRecord, tgt: Any) -> Any:
    if tgt is not None and not isinstance(tgt, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        if isinstance(tgt, (bool, int, float, str)):
            raise TargetMismatchError(f"array {rec.key!r}: target is a Python scalar but a {rec.kind} "
                                      "array was saved")
        raise TargetMismatchError(f"array {rec.key!r}: unsupported target leaf {type(tgt).__name__}")
    if tgt is not None and (rec.prng_impl or tree_lib.is_prng_key(tgt)):
        return key_target_sharding(rec, tgt)
    if tgt is not None:
        if tuple(tgt.shape) != tuple(rec.shape):
            raise TargetMismatchError(
                f"array {rec.key!r}: target shape {tuple(tgt.shape)} != saved shape {tuple(rec.shape)}")
        if np.dtype(tgt.dtype) != rec.np_dtype:
            raise TargetMismatchError(
                f"array {rec.key!r}: target dtype {np.dtype(tgt.dtype).name} != saved dtype {rec.dtype}; "
                "restore with the saved dtype and cast afterwards")
    if rec.kind == "numpy" or isinstance(tgt, (np.ndarray, np.generic)):
        if tgt is None or isinstance(tgt, (np.ndarray, np.generic)):
            return None
    sharding = getattr(tgt, "sharding", None) if tgt is not None else None
    if sharding is None:
        if rec.sharding is None:
            return None
        sharding = shardings.rebuild(rec.sharding)
    return sharding

def key_target_sharding(rec: fmt.ArrayRecord, tgt: Any) -> Any:
    """The sharding of a PRNG key array's key data, from a target of key dtype."""
    if not rec.prng_impl:
        raise TargetMismatchError(f"array {rec.key!r}: target is a PRNG key array ({tgt.dtype}) but a "
                                  f"{rec.dtype} array was saved")
    if not tree_lib.is_prng_key(tgt):
        raise TargetMismatchError(f"array {rec.key!r}: a PRNG key array ({rec.prng_impl}) was saved but the "
                                  f"target has dtype {tgt.dtype}; pass a key-typed target "
                                  "(jax.eval_shape of jax.random.key)")
    impl = str(jax.random.key_impl(tgt)) if isinstance(tgt, jax.Array) else tgt.dtype._impl.name
    if impl != rec.prng_impl:
        raise TargetMismatchError(f"array {rec.key!r}: saved with PRNG impl {rec.prng_impl}, the target uses "
                                  f"{impl}; restore with the saved impl (jax_default_prng_impl={rec.prng_impl})")
    if tuple(tgt.shape) != rec.logical_shape:
        raise TargetMismatchError(f"array {rec.key!r}: target shape {tuple(tgt.shape)} != saved key array "
                                  f"shape {rec.logical_shape}")
    sharding = getattr(tgt, "sharding", None)
    if sharding is None:
        return shardings.rebuild(rec.sharding) if rec.sharding is not None else None
    if not isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
        raise TargetMismatchError(f"array {rec.key!r}: a PRNG key array restores onto a NamedSharding or a "
                                  f"SingleDeviceSharding, not {type(sharding).__name__}")
    return sharding  # names the leading dimensions; the key data dimensions stay whole
