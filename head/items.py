"""Items of a step that are not array trees: a data iterator's position, JSON.

A training step is only restorable exactly with the input pipeline's position, so a step holds
small head-side items beside the arrays. Each is a subtree of the step of host byte arrays
(numpy ``uint8`` leaves), one per file Orbax would write in the item's directory
(``process_0-of-1.json`` for a Grain iterator, ``metadata`` for JSON). Host arrays are blobs like
any other: hashed, listed in the step manifest, committed with the step, kept, replicated and
backed up by the sidecars, so an item is restored from the same tier, and the same commit, as the
arrays beside it.

``IteratorSave``/``IteratorRestore`` take an iterator with ``get_state``/``set_state`` (Grain's
``DatasetIterator`` and ``DataLoaderIterator``, or any object with both), or a list of them (a
process that loads several data shards), and optionally a description of the pipeline (JSON)
that is checked at restore: a position saved over other files, another shuffle seed, ... is
refused with both descriptions, never applied to a pipeline it does not belong to; a restore that
describes its pipeline refuses a position saved without a description (nothing says whose it is).
A malformed ``mtc_iterator.json`` or state file is a ``DataPositionError`` too. Orbax's
``JsonSave``/``JsonRestore`` and Grain's ``CheckpointSave``/``CheckpointRestore`` (the
``PyGrainCheckpoint*`` args) are read as the same items.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np

from mtc.shared.errors import TargetMismatchError

ITERATOR_META = "mtc_iterator.json"  # beside the iterator's state files: how to read them back
JSON_FILE = "metadata"  # Orbax's JsonCheckpointHandler's file name
_FORMAT = "mtc-iterator/1"


class DataPositionError(TargetMismatchError):
    """A data iterator's saved position cannot be restored into this pipeline (or is missing)."""


@dataclasses.dataclass
class IteratorSave:
    """Save a data iterator's position (``item``: an iterator or a list of them) with the step.

    ``names``: the state files' names, one per iterator (default: ``process_<i>-of-<n>.json`` as
    Grain's Orbax handler names them); ``pipeline``: a JSON description of the input pipeline,
    compared at restore.
    """

    item: Any
    names: Sequence[str] | None = None
    pipeline: Any = None


@dataclasses.dataclass
class IteratorRestore:
    """Restore a data iterator's position in place (``item`` as for ``IteratorSave``).

    ``names``: as for ``IteratorSave``, or a function of the saved state files' names that
    returns this run's (it raises ``DataPositionError`` when they cannot be mapped);
    ``pipeline``: this run's description, compared with the saved one (a difference, or a position
    saved without one, is refused);
    ``missing_ok``: a step saved without an iterator restores (the data starts over: a warning),
    instead of being refused.
    """

    item: Any
    names: Sequence[str] | None = None
    pipeline: Any = None
    missing_ok: bool = False


def _type_name(args: Any) -> str:
    return type(args).__name__


def byte_item(args: Any) -> str | None:
    """"iterator" or "json" for the args of an item kept as bytes; None for an array tree."""
    if isinstance(args, (IteratorSave, IteratorRestore)):
        return "iterator"
    name, module = _type_name(args), type(args).__module__
    if name in ("JsonSaveArgs", "JsonRestoreArgs", "JsonSave", "JsonRestore") and module.startswith("orbax"):
        return "json"
    if name in ("CheckpointSave", "CheckpointRestore") and module.startswith("grain"):
        return "iterator"
    return None


def as_iterator_args(args: Any) -> Any:
    """Grain's CheckpointSave/CheckpointRestore as mtc's iterator args (others as they are)."""
    if _type_name(args) == "CheckpointSave" and not isinstance(args, IteratorSave):
        return IteratorSave(args.item)
    if _type_name(args) == "CheckpointRestore" and not isinstance(args, IteratorRestore):
        return IteratorRestore(args.item)
    return args


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


def _iterators(item: Any) -> list[Any]:
    items = list(item) if isinstance(item, (list, tuple)) else [item]
    for it in items:
        if not (callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))):
            raise TypeError(f"a data iterator item must have get_state() and set_state(); got {type(it).__name__}")
    return items


def _names(args: Any, count: int) -> list[str]:
    if args.names is not None:
        names = [str(n) for n in args.names]
        if len(names) != count:
            raise ValueError(f"{count} iterators but {len(names)} names ({names})")
        return names
    if count == 1:
        import jax

        return [f"process_{jax.process_index()}-of-{jax.process_count()}.json"]
    return [f"process_{i}-of-{count}.json" for i in range(count)]


def _is_dataset_iterator(it: Any) -> bool:
    """Grain's DatasetIterator (a dict state, kept as JSON), not its DataLoaderIterator (bytes)."""
    try:
        import grain

        return isinstance(it, grain.DatasetIterator)
    except (ImportError, AttributeError):
        return False


def save_tree(kind: str, args: Any) -> dict[str, np.ndarray]:
    """The item's files as host byte arrays, taken now (the iterator's state at this step)."""
    if kind == "json":
        return {JSON_FILE: _bytes(json.dumps(args.item).encode())}
    args = as_iterator_args(args)
    iterators = _iterators(args.item)
    out, encodings = {}, {}
    for name, it in zip(_names(args, len(iterators)), iterators):
        state = it.get_state()
        if isinstance(state, (bytes, bytearray, memoryview)):
            out[name], encodings[name] = _bytes(bytes(state)), "bytes"
        elif isinstance(state, str):
            out[name], encodings[name] = _bytes(state.encode()), "str"
        else:  # Grain's DatasetIterator: a dict, written as its Orbax handler writes it
            out[name], encodings[name] = _bytes(json.dumps(state, indent=4).encode()), "json"
    meta = {"format": _FORMAT, "states": encodings}
    if args.pipeline is not None:
        meta["pipeline"] = args.pipeline
    out[ITERATOR_META] = _bytes(json.dumps(meta, sort_keys=True).encode())
    return out


def _text(tree: Any, name: str, item: str) -> bytes:
    if not isinstance(tree, dict) or name not in tree:
        raise DataPositionError(f"item {item!r} of this step holds no {name!r} (it holds "
                                f"{sorted(tree) if isinstance(tree, dict) else type(tree).__name__})")
    return np.asarray(tree[name]).tobytes()


def _differences(saved: Any, now: Any) -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        return [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in sorted(set(saved) | set(now))
                if saved.get(k) != now.get(k)]
    return [] if saved == now else [f"saved {saved!r}, now {now!r}"]


_RESTART = ("restart the data on purpose (MTC_DATA_RESTART=1 under the MaxText launcher; in the API, restore "
            "without the iterator item)")
_ENCODINGS = ("bytes", "str", "json")


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested beyond the parser
        raise DataPositionError(f"{what} is not readable JSON ({type(e).__name__}: {str(e)[:200]}); "
                                f"restore another step, or {_RESTART}") from None


def _meta(tree: Any, name: str, step: int) -> dict:
    """The item's ``mtc_iterator.json``, checked: what mtc wrote, or a ``DataPositionError``."""
    where = f"step {step}'s data position ({name!r}, {ITERATOR_META})"
    meta = _json(_text(tree, ITERATOR_META, name), where)
    problem = (f"is a JSON {type(meta).__name__}, not an object" if not isinstance(meta, dict) else
               f"has format {meta.get('format')!r}, not {_FORMAT!r}" if meta.get("format") != _FORMAT else
               "has 'states' that is not an object of state file -> one of " + "/".join(_ENCODINGS)
               if not (isinstance(meta.get("states", {}), dict)
                       and all(isinstance(k, str) and v in _ENCODINGS for k, v in meta.get("states", {}).items()))
               else None)
    if problem:
        raise DataPositionError(f"{where} {problem}: it is not a data position mtc saved; restore another step, "
                                f"or {_RESTART}")
    return meta


def restore_item(kind: str, args: Any, tree: Any, name: str, step: int) -> Any:
    """Apply a restored byte item: the JSON value, or the iterator(s) set to the saved position.

    With this run's pipeline description (``IteratorRestore.pipeline``), the saved position must
    carry one too, and the same: a position without it could belong to any pipeline."""
    if kind == "json":
        return json.loads(_text(tree, JSON_FILE, name))
    args = as_iterator_args(args)
    iterators = _iterators(args.item)
    meta = _meta(tree, name, step)
    saved_files = sorted(k for k in tree if k != ITERATOR_META)
    if args.pipeline is not None and "pipeline" not in meta:
        raise DataPositionError(
            f"step {step}'s data position ({name!r}) was saved without a description of its input pipeline, so "
            "nothing says it belongs to this run's; it is not applied. Resume from a step saved with the "
            f"description, or {_RESTART}")
    if args.pipeline is not None:
        diff = _differences(meta["pipeline"], json.loads(json.dumps(args.pipeline)))
        if diff:
            raise DataPositionError(
                f"step {step}'s data position ({name!r}) belongs to another input pipeline than this run's: "
                + "; ".join(diff) + ". Resume with the pipeline it was saved with, or restart the data on purpose "
                "(MTC_DATA_RESTART=1 under the MaxText launcher; missing_ok/no iterator item in the API)")
    if callable(args.names):
        args = dataclasses.replace(args, names=args.names(saved_files))
    wanted = _names(args, len(iterators))
    absent = [w for w in wanted if w not in saved_files]
    if absent:
        raise DataPositionError(
            f"step {step}'s data position was saved by {len(saved_files)} data-loading iterator(s) "
            f"({', '.join(saved_files)}); this run restores {len(wanted)} ({', '.join(wanted)}): {absent} are not "
            "in it. Restore with as many data shards as were saved (MaxText: set expansion_factor_real_data so "
            "that the number of data-loading shards matches), or restart the data on purpose (MTC_DATA_RESTART=1)")
    encodings = meta.get("states", {})
    states = []
    for w, it in zip(wanted, iterators):  # every state read before any iterator is set
        data = _text(tree, w, name)
        enc = encodings.get(w, "json" if _is_dataset_iterator(it) else "bytes")
        what = f"step {step}'s data position ({name!r}, {w})"
        if enc == "str":
            try:
                states.append(data.decode())
            except UnicodeDecodeError:
                raise DataPositionError(f"{what} is not UTF-8 text; restore another step, or {_RESTART}") from None
        else:
            states.append(_json(data, what) if enc == "json" else data)
    for it, st in zip(iterators, states):
        it.set_state(st)
        start = getattr(it, "start_prefetch", None)
        if callable(start):  # as Grain's own Orbax handler does after set_state
            start()
    return args.item
