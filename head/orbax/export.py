"""A step out of mtc as a standard Orbax checkpoint: what MaxText's own checkpointing writes.

``export(manager, directory, step)`` writes ``directory/<step>/`` with orbax-checkpoint itself:
``items`` (the train state, OCDBT + zarr3, as ``ocp.save_checkpointables`` writes it) and, when
the step holds a data iterator's position, ``iter`` (its state files, as MaxText's
``GrainCheckpointable`` names them). So ``load_full_state_path=<dir>/<step>/items``,
``load_parameters_path=...`` and any Orbax user read it as one of MaxText's own checkpoints.

Memory: the state is read and written in groups of whole arrays of at most ``max_bytes``
(an array larger than that is a group of its own), each group restored from the fastest tier
that holds it (verified, as a restore is), written, and dropped before the next is read. The
groups go through Orbax's partial save (each a pending directory beside the checkpoint), and
Orbax's own finalize merges them and makes ``<step>`` appear at once: an export that stops
half-way leaves ``<step>.partial_save``, which no reader takes for a checkpoint, and the next
export of the step starts it over. An export never writes through a symbolic link: one at
``<step>``, ``<step>.partial_save*`` or ``<step>.orbax-checkpoint-tmp*`` is refused before anything
is written; and a failed Orbax save's waiting threads are ended (``_release_orbax``), so that a
failed export never keeps its process alive.

What the saved tree maps to: the MaxText launcher's steps hold ``state`` (and ``iter``); they
become ``items`` (and ``iter``). A step whose array tree is one item (``state``, or ``default``:
``OrbaxCompatibleManager`` given one args object) exports that item as ``items``; any other step
exports its whole array tree as ``items``. Data-iterator items keep their own names.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from mtc.head import items as byte_items
from mtc.head import tree as tree_lib
from mtc.shared import format as fmt
from mtc.shared import shardings
from mtc.shared.errors import MTCError, StepNotFoundError, TargetMismatchError

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30  # state read and written at once (a larger single array: that array)
ITEMS = "items"  # MaxText's name of the train state in its standard checkpoints
LAUNCHER_STATE = "state"  # ... and the MaxText launcher's name of it in mtc's steps
_K = jax.tree_util


class ExportError(MTCError):
    """An export could not be written (nothing Orbax would read was left at its path)."""


@dataclasses.dataclass(frozen=True)
class ExportReport:
    step: int
    path: str  # <directory>/<step>: the Orbax checkpoint
    items: str  # <path>/items: load_full_state_path / load_parameters_path
    checkpointables: tuple[str, ...]  # items, and iter when the step holds a data position
    arrays: int
    nbytes: int
    groups: int
    largest_group_bytes: int  # the most state held in memory at once
    seconds: float
    bytes_by_tier: dict
    verified: bool = False

    def maxtext_flags(self) -> list[str]:
        return [f"load_full_state_path={self.items}", f"load_parameters_path={self.items}"]


class _Part:
    """Some children of a sequence, namedtuple or registered node, keyed as the whole keys them.

    Orbax names a leaf by its key path (a tuple field and a dict key are recorded alike), so a
    group holding only some of a tuple's children is written exactly as the whole tuple would be.
    """

    def __init__(self, keys: Sequence[Any], children: Sequence[Any]):
        self.keys, self.children = list(keys), list(children)


_K.register_pytree_with_keys(_Part, lambda p: (list(zip(p.keys, p.children)), p.keys),
                             lambda keys, children: _Part(keys, children))


def _nest(pairs: Iterable[tuple[tuple, Any]]) -> Any:
    """The pytree holding each value at its key path (dicts for dict keys, ``_Part`` otherwise)."""
    root: dict = {}
    for path, value in pairs:
        node = root
        for entry in path[:-1]:
            node = node.setdefault(entry, {})
        node[path[-1]] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or not node or not all(isinstance(k, _KEY_TYPES) for k in node):
            return node
        if all(isinstance(k, _K.DictKey) for k in node):
            return {k.key: build(v) for k, v in node.items()}
        return _Part(list(node), [build(v) for v in node.values()])

    return build(root) if pairs else {}


_KEY_TYPES = (_K.DictKey, _K.SequenceKey, _K.GetAttrKey, _K.FlattenedIndexKey)
_FIRST = re.compile(r"^(?:\.([A-Za-z_]\w*)|\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\])")


def _first_entry(rest: str) -> Any:
    m = _FIRST.match(rest)
    if m is None:
        raise ExportError(f"cannot read the key path {rest!r} of a saved array")
    if m.group(1) is not None:
        return _K.GetAttrKey(m.group(1))
    if m.group(2) is not None:
        return _K.SequenceKey(int(m.group(2)))
    return _K.DictKey(m.group(3))


def _paths(manifest: fmt.StepManifest) -> tuple[list[tuple], list[tuple[tuple, Any]]]:
    """Each saved array's key path (jax key entries), and the empty containers and Nones of the tree."""
    keys = [a.key for a in manifest.arrays]
    paths: list[tuple] = [()] * len(keys)
    empties: list[tuple[tuple, Any]] = []

    def walk(d: dict, path: tuple) -> list[int]:
        t = d["t"]
        if t == "leaf":
            paths[d["i"]] = path
            return [d["i"]]
        if t == "none":
            empties.append((path, None))
            return []
        if t == "dict":
            entries = [_K.DictKey(k) for k in d["k"]]
        elif t == "namedtuple":
            entries = [_K.GetAttrKey(f) for f in d["k"]]
        elif t in ("list", "tuple"):
            entries = [_K.SequenceKey(i) for i in range(len(d["v"]))]
        else:  # a registered node: its children's keys are read off the saved keys under it
            entries = [None] * len(d["v"])
        got: list[int] = []
        prefix = _K.keystr(path)
        for i, (entry, child) in enumerate(zip(entries, d["v"])):
            if entry is None:
                first = _first_leaf(child)
                if first is None:
                    continue  # an empty child of a registered node: nothing to write
                entry = _first_entry(keys[first][len(prefix):])
            got += walk(child, path + (entry,))
        if not d["v"]:
            empties.append((path, tree_lib.decode(d, [])))
        return got

    walk(manifest.tree, ())
    return paths, empties


def _first_leaf(d: dict) -> int | None:
    if d["t"] == "leaf":
        return d["i"]
    for child in d.get("v", []):
        i = _first_leaf(child)
        if i is not None:
            return i
    return None


def _iterator_items(manifest: fmt.StepManifest) -> set[str]:
    """Top-level item names that hold a data iterator's position (or JSON) as files."""
    marks = (f"['{byte_items.ITERATOR_META}']", f"['{byte_items.JSON_FILE}']")
    return {m.group(1) for a in manifest.arrays for mark in marks if a.key.endswith(mark) and a.kind == "numpy"
            and (m := re.match(r"^\['([^']+)'\]\['[^']+'\]$", a.key))}


def plan_items(manifest: fmt.StepManifest) -> tuple[tuple, dict[str, tuple]]:
    """(key path of the train state in the step, {checkpointable name: key path} of file items)."""
    files = _iterator_items(manifest)
    top = manifest.tree.get("k", []) if manifest.tree.get("t") == "dict" else []
    arrays = [k for k in top if k not in files]
    state: tuple = (_K.DictKey(arrays[0]),) if arrays in ([LAUNCHER_STATE], ["default"]) else ()
    if ITEMS in files:
        raise ExportError("the step holds a data iterator item named 'items', the name of the train state "
                          "in an Orbax checkpoint; it cannot be exported beside it")
    return state, {n: (_K.DictKey(n),) for n in sorted(files)}


def _under(path: tuple, prefix: tuple) -> bool:
    return path[:len(prefix)] == prefix


# The export writes through orbax-checkpoint's v1 partial save, whose modules are private (``_src``):
# the versions it was tested with. Outside them it is refused, before anything is written.
ORBAX_TESTED = ((0, 12, 8), (0, 13))  # >= 0.12.8, < 0.13


def _orbax_version_problem(version: str) -> str | None:
    """Why ``version`` of orbax-checkpoint is not one the export may use (None: it is)."""
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    low, high = ORBAX_TESTED
    if len(parts) >= 2 and low <= tuple(parts) < high:
        return None
    return (f"mtc export writes with orbax-checkpoint's partial save, whose modules are private and change between "
            f"releases; it is tested with {'.'.join(map(str, low))} up to (not including) {'.'.join(map(str, high))}, "
            f"and this is {version}: pip install 'orbax-checkpoint>=0.12.8,<0.13' (nothing was written)")


@functools.lru_cache(maxsize=1)
def orbax_api() -> Any:
    """orbax-checkpoint's v1 API and the partial-save parts the export uses (refused if missing, or of a
    version outside ``ORBAX_TESTED``)."""
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        problem = _orbax_version_problem(dist_version("orbax-checkpoint"))
    except PackageNotFoundError:
        problem = None  # not installed: the import below says so
    if problem:
        raise ExportError(problem)
    try:
        from orbax.checkpoint import v1 as ocp
        from etils import epath  # orbax-checkpoint's own dependency: imported after it, so a missing one names orbax
        from orbax.checkpoint.experimental.v1._src.handlers import pytree_handler
        from orbax.checkpoint.experimental.v1._src.partial import path as partial_path
        from orbax.checkpoint.experimental.v1._src.partial import saving as partial_saving
        from orbax.checkpoint.experimental.v1._src.saving import execution
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in ("orbax", "etils")
        raise ExportError("mtc export writes with orbax-checkpoint (its v1 API and partial save), which is "
                          + ("not installed here" if missing else f"too old or broken here ({e})")
                          + ": pip install 'mtc[export]' (orbax-checkpoint >= 0.12.8)") from e

    class PyTreeHandler(pytree_handler.PyTreeHandler):
        """Orbax's PyTreeHandler in partial-save mode, recorded under its own name, so the written
        checkpoint names the handler a whole save names (``ocp.metadata`` reads it back)."""

        def __init__(self, **kwargs: Any):
            super().__init__(partial_save_mode=True, **kwargs)

    PyTreeHandler.__module__ = pytree_handler.PyTreeHandler.__module__
    PyTreeHandler.__qualname__ = pytree_handler.PyTreeHandler.__qualname__

    class Files(ocp.StatefulCheckpointable):
        """A checkpointable of files, written as saved (a data iterator's state files)."""

        def __init__(self, files: dict[str, bytes]):
            self.files = files

        async def save(self, directory: Any) -> Any:
            files = self.files

            async def write() -> None:
                path = await directory.await_creation()
                for name, data in files.items():
                    (path / name).write_bytes(data)

            return write()

        async def load(self, directory: Any) -> Any:
            raise NotImplementedError("mtc's export writes these files; read them with the pipeline's loader")

    return SimpleNamespace(epath=epath, ocp=ocp, handler=PyTreeHandler, Files=Files, partial_path=partial_path,
                           partial_saving=partial_saving, execution=execution)


def _partial_context(orbax: Any) -> Any:
    """The Orbax context of the partial saves: ``items`` is written by the partial-save handler."""
    ctx = orbax.ocp.Context()
    registry = orbax.ocp.handlers.local_registry()
    registry.add(orbax.handler, checkpointable_name=ITEMS)
    ctx.checkpointables.registry = registry
    return ctx


def _target(rec: fmt.ArrayRecord, onto: Any) -> Any:
    """The restore target of one saved leaf: its saved sharding where this process has the devices
    (else ``onto``, one device), host arrays as host arrays, scalars as saved."""
    from mtc.head.restore.plan import scalar_value

    if rec.kind == "scalar":
        return scalar_value(rec.value)
    if rec.kind == "numpy":
        return jax.ShapeDtypeStruct(tuple(rec.shape), rec.np_dtype)
    if rec.prng_impl:
        dtype = jax.eval_shape(lambda: jax.random.key(0, impl=rec.prng_impl)).dtype
        return jax.ShapeDtypeStruct(tuple(rec.logical_shape), dtype, sharding=onto)
    sharding = onto
    if rec.sharding is not None and onto is None:
        try:
            sharding = shardings.rebuild(rec.sharding)
        except TargetMismatchError:
            sharding = None
    return jax.ShapeDtypeStruct(tuple(rec.shape), rec.np_dtype,
                                sharding=sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def groups_of(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Consecutive runs of leaves of at most ``max_bytes`` each (a larger leaf alone)."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if out and total + n <= max_bytes:
            out[-1].append(i)
            total += n
        else:
            out.append([i])
            total = n
    return out


def _digest(x: Any) -> str:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return f"{a.dtype}{a.shape}:" + hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).data).hexdigest()
    return f"{type(x).__name__}:{x!r}"


def _refused_backups(manager: Any) -> str:
    """What the backup root holds that no restore takes (damaged, or failing its seal), or ""."""
    from mtc.head.backup.listing import damaged_note

    try:
        return damaged_note({"damaged": manager.refused_backups()})
    except MTCError:  # the root could not be listed: the error stays the one about the step
        return ""


def export(manager: Any, directory: str, step: int | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
           onto: Any = None, custom_metadata: dict | None = None, verify: bool = False,
           progress: Callable[[int, int], None] | None = None) -> ExportReport:
    """Write ``step`` (default: the latest restorable) of ``manager`` to ``directory/<step>``.

    ``onto``: the sharding every array is restored onto before Orbax writes it (default: as saved
    where this process has those devices, else one local device; the checkpoint records it, and a
    reader reshards onto its own mesh). ``verify``: read the written checkpoint back with Orbax
    and compare every array, and every file, bit for bit with the step. ``progress(done, total)``
    is called with bytes after each group.
    """
    t0 = time.perf_counter()
    orbax = orbax_api()
    steps = manager.all_steps()
    if step is None:
        if not steps:
            raise StepNotFoundError("there is no restorable step to export (mtc status shows what each tier holds)"
                                    + _refused_backups(manager))
        step = steps[-1]
    elif step not in steps:
        raise StepNotFoundError(f"step {step} is not restorable; restorable steps: {steps}")
    manifest = manager.manifest(step, shards=False)  # the arrays and the tree: the header alone
    state_path, file_items = plan_items(manifest)
    paths, empties = _paths(manifest)
    leaves = [i for i, p in enumerate(paths) if _under(p, state_path)
              and not any(_under(p, fp) for fp in file_items.values())]
    if not leaves:
        raise ExportError(f"step {step} holds no arrays to export")
    sizes = [manifest.arrays[i].nbytes if manifest.arrays[i].kind != "scalar" else 0 for i in leaves]
    size_of = dict(zip(leaves, sizes))
    plan = [[leaves[j] for j in g] for g in groups_of(sizes, max(1, int(max_bytes)))]
    empties = [(p[len(state_path):], v) for p, v in empties if _under(p, state_path) and len(p) > len(state_path)]

    final = orbax.epath.Path(str(directory)) / str(step)
    partial = orbax.partial_path.add_partial_save_suffix(final)
    _refuse_links(final, partial, step)
    if final.exists():
        raise ExportError(f"{final} already exists: an export of step {step} (or another checkpoint) is there; "
                          "nothing was written. Export to another directory, or remove it first")
    stale = _unfinished(final, partial)
    if stale:
        log.warning("removing %s, an export of step %d that did not finish", ", ".join(map(str, stale)), step)
        _remove(final, partial)
        left = _unfinished(final, partial)
        if left:
            raise ExportError(f"could not remove {', '.join(map(str, left))}, an export of step {step} that did not "
                              "finish (see the warning above); nothing was written. Remove it, or export to another "
                              "directory")
    whole = len(plan) == 1  # one group: Orbax's ordinary save, no partial save
    if not whole and str(final).startswith("gs://"):
        raise ExportError(
            f"step {step} is {sum(sizes):,} bytes, more than max_bytes ({max_bytes:,}) at once, and orbax-checkpoint's "
            "partial save (how an export holds only part of the state at a time) does not write to gs://. "
            "Export to a local directory and copy it (gcloud storage cp -r), or allow the whole state in memory "
            f"(max_bytes / --max-memory >= {sum(sizes):,})")
    final.parent.mkdir(parents=True, exist_ok=True)
    total = sum(sizes)
    done = largest = 0
    by_tier: dict[str, int] = {}
    digests: list[tuple[list, dict]] = []
    before = set(threading.enumerate())
    try:
        with orbax.ocp.Context() if whole else _partial_context(orbax):
            for n, group in enumerate(plan):
                target = _nest((paths[i], _target(manifest.arrays[i], onto)) for i in group)
                restored = manager.restore(step, target=target, partial=True, pull=False)
                rep = manager.last_restore_report
                for tier, b in (rep.bytes_by_tier if rep else {}).items():
                    by_tier[tier] = by_tier.get(tier, 0) + b
                pairs = [(tuple(p)[len(state_path):], v) for p, v in _K.tree_flatten_with_path(restored)[0]]
                if verify:
                    digests.append(([p for p, _ in pairs], {_K.keystr(p): _digest(v) for p, v in pairs}))
                checkpointables: dict[str, Any] = {ITEMS: _nest(pairs + (empties if n == 0 else []))}
                if n == 0:
                    checkpointables.update(_file_items(orbax, manager, step, file_items))
                del restored, pairs
                if whole:
                    orbax.ocp.save_checkpointables(final, checkpointables, custom_metadata=custom_metadata or None)
                else:
                    orbax.execution.save_checkpointables_impl(
                        partial, checkpointables, overwrite=False, custom_metadata=custom_metadata or None,
                        async_origin=False, partial_save=True).result()
                del checkpointables
                gbytes = sum(size_of[i] for i in group)
                largest, done = max(largest, gbytes), done + gbytes
                if progress is not None:
                    progress(done, total)
            if not whole:
                orbax.partial_saving.finalize(final)
        if _is_link(final):  # planted while Orbax wrote: the checkpoint went through it
            raise ExportError(f"{final} became a symbolic link while the export was written; it was removed")
    except BaseException as e:
        _release_orbax(before)
        _remove(final, partial)
        if _is_link(final):
            final.unlink()
        if isinstance(e, MTCError) or not isinstance(e, Exception):
            raise
        raise ExportError(f"writing step {step} to {final} failed ({type(e).__name__}: {e}); nothing was left "
                          "there that Orbax would read") from e
    report = ExportReport(step=step, path=str(final), items=str(final / ITEMS),
                          checkpointables=(ITEMS, *sorted(file_items)), arrays=len(leaves), nbytes=total,
                          groups=len(plan), largest_group_bytes=largest, seconds=time.perf_counter() - t0,
                          bytes_by_tier=by_tier)
    if verify:
        check(report, manifest, digests, paths, state_path, manager, file_items)
        report = dataclasses.replace(report, verified=True, seconds=time.perf_counter() - t0)
    log.info("mtc: exported step %d to %s (%d arrays, %d bytes, %d groups of at most %d bytes) in %.2f s",
             step, final, len(leaves), total, len(plan), largest, report.seconds)
    return report


def _is_link(path: Any) -> bool:
    """A symbolic link at ``path`` (never on gs://, where there are none)."""
    return not str(path).startswith("gs://") and os.path.islink(str(path))


def _unfinished(final: Any, partial: Any) -> list:
    """What an unfinished export of ``final`` left: Orbax's partial-save folder and the pending
    ``.orbax-checkpoint-tmp*`` folders of a whole or a partial save."""
    if not final.parent.exists():
        return []
    return sorted({*final.parent.glob(f"{partial.name}*"), *final.parent.glob(f"{final.name}.orbax-checkpoint-tmp*")})


def _refuse_links(final: Any, partial: Any, step: int) -> None:
    """An export never writes through a symbolic link: its checkpoint would land wherever the link
    points, and ``<step>`` would become the link."""
    for path in [final, *_unfinished(final, partial)]:
        if _is_link(path):
            raise ExportError(f"{path} is a symbolic link (to {os.readlink(str(path))}); an export of step {step} "
                              "never writes through one, and nothing was written. Remove the link, or export to "
                              "another directory")


def _remove(final: Any, partial: Any) -> None:
    """An unfinished export: Orbax's partial-save folder and the pending ``.orbax-checkpoint-tmp*``
    ones (a symbolic link among them is removed, never what it points to)."""
    for path in _unfinished(final, partial):
        try:
            path.unlink() if _is_link(path) or not path.is_dir() else path.rmtree()
        except OSError as e:  # the export's error is the one to raise; this is cleanup
            log.warning("could not remove the unfinished export %s: %s", path, e)


def _release_orbax(before: set) -> None:
    """Let the threads of a failed Orbax save end: Orbax starts a save's writers waiting for signals
    (the folder was created, ...) that a save that failed early never sends, and the interpreter
    would wait for them at exit (Orbax's coordination timeout). Each such thread started since
    ``before`` is cancelled and its signals sent, so it returns without writing."""
    try:
        from orbax.checkpoint._src.futures import future, signaling_client

        waiting = [t for t in threading.enumerate() if t not in before and t.is_alive()
                   and isinstance(t, future._SignalingThread)]
        if not waiting:
            return
        client = signaling_client.get_signaling_client()
        for t in waiting:
            t._cancelled = True
            for sig in t._receive_signals:
                key = future.AwaitableSignalsContract.get_unique_awaitable_singal_key(sig, t._operation_id)
                client.key_value_set(key, "cancelled", allow_overwrite=True)
        for t in waiting:
            threading.Thread.join(t, timeout=10.0)  # Orbax's own join raises for a cancelled thread
        log.info("ended %d threads of the failed Orbax save", len(waiting))
    except (ImportError, AttributeError, TypeError) as e:  # another Orbax: its threads end at its own timeout
        log.warning("the failed Orbax save's threads may keep this process alive until Orbax's timeout: %s", e)


def _file_items(orbax: Any, manager: Any, step: int, file_items: dict[str, tuple]) -> dict[str, Any]:
    """The data-iterator items as Orbax checkpointables of their state files (mtc's own note about
    how to read them back is not one of MaxText's files and stays out)."""
    from mtc.head.restore.plan import AS_SAVED

    if not file_items:
        return {}
    saved = manager.restore(step, target={p[0].key: AS_SAVED for p in file_items.values()}, partial=True,
                            pull=False)
    return {name: orbax.Files({f: np.asarray(b).tobytes() for f, b in saved[path[0].key].items()
                          if f != byte_items.ITERATOR_META})
            for name, path in file_items.items()}


def check(report: ExportReport, manifest: fmt.StepManifest, digests: list, paths: list, state_path: tuple,
          manager: Any, file_items: dict[str, tuple]) -> None:
    """Read the export back with Orbax, group by group, and compare it bit for bit with the step.

    Each read names the whole saved structure, with Orbax's placeholder for the leaves of other
    groups, so no more than one group is in memory."""
    orbax = orbax_api()
    ocp = orbax.ocp
    root = orbax.epath.Path(report.path)
    doc = manifest.tree
    for entry in state_path:
        doc = doc["v"][doc["k"].index(entry.key)]
    if not state_path and file_items:  # the whole tree is the state, but for the file items
        keep = [i for i, k in enumerate(doc["k"]) if k not in file_items]
        doc = {**doc, "k": [doc["k"][i] for i in keep], "v": [doc["v"][i] for i in keep]}
    order = _leaf_order(doc)
    by_path = {tuple(p)[len(state_path):]: i for i, p in enumerate(paths)}
    bad: list[str] = []
    for group_paths, want in digests:
        wanted = {by_path[p] for p in group_paths}
        abstract = tree_lib.decode(doc, [_abstract(manifest.arrays[i]) if i in wanted else ocp.PLACEHOLDER
                                         for i in order])
        got = ocp.load(root, abstract, checkpointable_name=ITEMS)
        for p, v in _K.tree_flatten_with_path(got)[0]:
            k = _K.keystr(tuple(p))
            if k in want and _digest(v) != want[k]:
                bad.append(k)
        del got
    for name, files in _file_items(orbax, manager, report.step, file_items).items():
        for f, data in files.files.items():
            if (root / name / f).read_bytes() != data:
                bad.append(f"{name}/{f}")
    if bad:
        raise ExportError(f"the export at {report.path} does not read back as step {report.step}: "
                          f"{len(bad)} arrays differ ({', '.join(bad[:5])}); do not use it")


def _leaf_order(doc: dict) -> list[int]:
    if doc["t"] == "leaf":
        return [doc["i"]]
    return [i for child in doc.get("v", []) for i in _leaf_order(child)]


def _abstract(rec: fmt.ArrayRecord) -> Any:
    if rec.kind == "numpy":
        return np.empty(tuple(rec.shape), rec.np_dtype)
    return _target(rec, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
