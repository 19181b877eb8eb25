"""An Orbax-compatible checkpoint manager backed by mtc (README, "MaxText").

``OrbaxCompatibleManager`` has the surface of Orbax's ``AbstractCheckpointManager`` as Orbax
and MaxText users call it, so switching is one constructor::

    import orbax.checkpoint as ocp
    from mtc.head import MTCConfig, OrbaxCompatibleManager

    mngr = OrbaxCompatibleManager(MTCConfig(local_checkpoint_directory="/local", local_checkpoint_period=10))
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args))).state

Every item of the ``Composite`` is saved in one mtc step (a tree ``{name: item}``), in one
commit: array trees (``PyTreeSave``/``StandardSave``) and the items that are not (a data
iterator's position: Grain's ``CheckpointSave`` or mtc's ``IteratorSave``; Orbax's ``JsonSave``),
which become small byte items of the step (``mtc.head.items``). Orbax is not imported: the
``args`` objects are read by their attributes (``item``, ``restore_args``, ``partial_restore``),
and ``restore`` answers with the ``Composite`` class it was given.

Steps in flight: as in Orbax, a step is listed by ``all_steps``/``latest_step`` from the
moment its (asynchronous) save starts, and a second ``save`` of it (MaxText's forced final
save of a step it just saved) returns False without writing anything.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import jax
import numpy as np

from mtc.head import items as byte_items
from mtc.head.manager import CheckpointManager
from mtc.head.restore.plan import AS_SAVED, NothingSavedError
from mtc.shared.config import MTCConfig
from mtc.shared.errors import HostUnreachableError, MTCError

log = logging.getLogger(__name__)

DEFAULT_ITEM = "default"  # the item name of a save/restore given one args object, not a Composite


class UnsupportedOperationError(MTCError, NotImplementedError):
    """An Orbax manager method that mtc does not provide; the message says what to use instead."""


def _attr(obj: Any, name: str) -> Any:
    """``obj.name`` or None (Orbax's Composite raises KeyError for a name it lacks)."""
    try:
        return getattr(obj, name, None)
    except KeyError:
        return None


def _is_composite(args: Any) -> bool:
    return isinstance(args, Mapping) or (callable(getattr(type(args), "keys", None))
                                         and callable(getattr(type(args), "__getitem__", None)))


def _is_item_args(args: Any) -> bool:
    """A PyTreeSave/PyTreeRestore/StandardSave/StandardRestore (a dataclass with an ``item``)."""
    return not _is_composite(args) and "item" in getattr(type(args), "__dataclass_fields__", {})


def _items(args: Any, what: str) -> dict[str, Any]:
    """name -> item args of a Composite (or of one args object, under DEFAULT_ITEM)."""
    if args is None:
        raise TypeError(f"{what} needs args=ocp.args.Composite(state=ocp.args.PyTree{what.capitalize()}(...))")
    if _is_composite(args):
        names = list(args.keys())
        if not names:
            raise TypeError(f"{what}: args is an empty Composite; name at least one item")
        items = {str(n): args[n] for n in names}
        for name, item_args in items.items():
            if byte_items.byte_item(item_args) is None and not _is_item_args(item_args):
                raise TypeError(f"{what}: item {name!r} is a {type(item_args).__name__}; pass args=ocp.args."
                                f"Composite({name}=ocp.args.PyTree{what.capitalize()}(item=...)) (or "
                                f"ocp.args.Standard{what.capitalize()})")
        return items
    if byte_items.byte_item(args) is not None or _is_item_args(args):
        return {DEFAULT_ITEM: args}
    raise TypeError(f"{what}: args must be an ocp.args.Composite of PyTree{what.capitalize()}/Standard"
                    f"{what.capitalize()} items, got {type(args).__name__}")


def _restore_leaf(abstract: Any, restore_arg: Any) -> Any:
    """A ShapeDtypeStruct for one target leaf: its shape and dtype, the sharding restore_args asks for."""
    sharding = getattr(restore_arg, "sharding", None) if restore_arg is not None else None
    if sharding is None:
        sharding = getattr(abstract, "sharding", None)
    if isinstance(abstract, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)
    return abstract  # numpy leaves and Python scalars: restored as saved


def _cast(x: Any, restore_arg: Any) -> Any:
    dtype = getattr(restore_arg, "dtype", None) if restore_arg is not None else None
    if dtype is None or not hasattr(x, "dtype") or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return x.astype(dtype) if np.dtype(x.dtype) != np.dtype(dtype) else x


class OrbaxCompatibleManager:
    """Orbax's ``CheckpointManager`` surface over mtc's multi-tier ``CheckpointManager``.

    ``config`` is an ``MTCConfig`` (keyword arguments build or amend one); ``manager`` wraps an
    existing mtc manager instead (closed with this one).
    """

    def __init__(self, config: MTCConfig | None = None, *, manager: CheckpointManager | None = None,
                 **kwargs: Any):
        if manager is not None and (config is not None or kwargs):
            raise TypeError("pass either manager= or a config, not both")
        self._mgr = manager if manager is not None else CheckpointManager(config, **kwargs)
        self._listed: list[int] | None = None  # the last listing of the tiers ...
        self._listed_at: Any = None  # ... and the save report it saw (a newer commit makes it stale)
        self._committed: set[int] = set()  # steps this manager's saves committed

    # --- what it wraps ---------------------------------------------------------------------

    @property
    def mtc_manager(self) -> CheckpointManager:
        """The mtc manager underneath (reports: last_save_report, last_restore_report, ...)."""
        return self._mgr

    @property
    def directory(self) -> Any:
        """The local checkpoint directory (the ramdisk), as an ``epath.Path`` when etils is installed."""
        path = os.fspath(self._mgr.config.local_checkpoint_directory)
        try:
            from etils import epath

            return epath.Path(path)
        except ImportError:
            from pathlib import Path

            return Path(path)

    # --- steps -----------------------------------------------------------------------------

    def all_steps(self, read: bool = False) -> list[int]:
        """Restorable steps (hosts and backups), plus the step being saved now, ascending.

        As in Orbax, the listing is cached: it is asked of the sidecars and the backup root
        again with ``read=True``, after ``reload()``, and once one of this manager's saves has
        committed since (MaxText asks ``latest_step()`` and ``all_steps()`` before each save:
        one listing, not two).
        """
        report = self._mgr.last_save_report
        if report is not None and report.committed:
            self._committed.add(report.step)
        if read or self._listed is None or report is not self._listed_at:
            try:
                self._listed, self._listed_at = self._mgr.all_steps(), report
            except HostUnreachableError as e:
                if self._listed is None:
                    raise  # nothing known yet: "unconfirmed" must never read as "no step"
                # A sidecar is briefly gone while training runs (MaxText asks before each save):
                # what this manager listed before, and what it has committed since, still hold.
                log.warning("mtc: the hosts could not all be asked which steps they hold (%s); using the last "
                            "listing and this run's own commits", e)
                self._listed = sorted(set(self._listed) | self._committed)
        steps = set(self._listed)
        inflight = self._mgr.in_flight_step
        if inflight is not None:
            steps.add(inflight)
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """mtc keeps no metrics: the latest step."""
        return self.latest_step()

    def reload(self) -> None:
        """Forget the cached listing: the next ``all_steps``/``latest_step`` asks the tiers again."""
        self._listed = None

    def should_save(self, step: int) -> bool:
        return self._mgr.should_save(step) and not self._mgr.has_step(step)

    def reached_preemption(self, step: int) -> bool:
        """Whether a SIGTERM came (``mtc_manager.watch_preemption()``), or JAX's preemption sync point
        is reached at ``step`` (False without a distributed runtime)."""
        if self._mgr.reached_preemption(step):
            return True
        from jax.experimental import multihost_utils

        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:  # no preemption sync manager: a single process, or Pathways' single controller
            return False

    # --- save / restore ----------------------------------------------------------------------

    def save(self, step: int, args: Any = None, *, force: bool = False, metrics: Any = None,
             custom_metadata: Any = None, backup: bool = False) -> bool:
        """Save every item of ``args`` as ``step`` if due (or ``force``); whether a save started.
        ``backup`` (as Orbax's): save it and back it up now, whatever the interval
        (``CheckpointManager.save``); so does a backup asked for by signal, at the next step.

        Returns after the device-to-host copy. A step that is committed or being saved is not
        saved again (False). An earlier background save's error is raised here, as Orbax does;
        a lost host raises ``HostLostError`` (a ``jax.errors.JaxRuntimeError``).
        """
        items = _items(args, "save")
        if metrics is not None:
            log.debug("mtc keeps no metrics; best_step() is latest_step()")
        self._mgr.check_for_errors()
        if self._mgr.has_step(int(step)):
            log.info("step %d is already saved or being saved; not saving it again", step)
            return False
        if not (force or backup or self._mgr.backup_requested or self._mgr.should_save(int(step))):
            return False
        # Byte items are taken now, with the arrays: the iterator's position at this step.
        state = {name: (byte_items.save_tree(kind, item_args) if (kind := byte_items.byte_item(item_args))
                        else item_args.item) for name, item_args in items.items()}
        return self._mgr.save(int(step), state, force=force, backup=backup)

    def restore(self, step: int | None = None, args: Any = None, directory: Any = None) -> Any:
        """Restore ``step`` (default: the latest) into the items ``args`` names.

        Each item's ``item`` gives the tree (abstract or concrete leaves), ``restore_args`` the
        shardings (``ArrayRestoreArgs(sharding=...)``; a ``dtype`` casts after the restore);
        ``partial_restore=True`` lets the item hold only some of the saved leaves. Returns the
        Composite class of ``args`` (``.state``), or the tree itself for a lone args object.
        """
        if directory is not None:
            raise UnsupportedOperationError(
                "restore(directory=...) is not supported: mtc restores from its tiers; to restore a given "
                "backup, pin it with `mtc restore-version set NAME`")
        items = _items(args, "restore")
        self._listed = None  # a restore may refill hosts (and lists the tiers itself)
        kinds = {name: kind for name, item_args in items.items() if (kind := byte_items.byte_item(item_args))}
        try:
            restored = self._restore_items(step, items, kinds)
            absent: list[str] = []
        except NothingSavedError as e:  # a step saved without an item that is asked for
            absent = [n for n in kinds if jax.tree_util.keystr((jax.tree_util.DictKey(n),)) in e.keys]
            iterators = [n for n in absent if kinds[n] == "iterator"]
            optional = [n for n in iterators if _attr(byte_items.as_iterator_args(items[n]), "missing_ok")]
            if iterators and optional != absent:
                raise byte_items.DataPositionError(
                    f"{e}: the step was saved without its data iterator's position, and restoring it would "
                    "start the data over. Restore a step saved with it, or restart the data on purpose "
                    "(IteratorRestore(missing_ok=True); MTC_DATA_RESTART=1 under the MaxText launcher)") from e
            if not absent or optional != absent:
                raise
            log.warning("step %s holds no data iterator position (%s): the data starts over", step, ", ".join(absent))
            restored = self._restore_items(step, {n: a for n, a in items.items() if n not in absent},
                                           {n: k for n, k in kinds.items() if n not in absent})
        done = self._mgr.last_restore_report.step if self._mgr.last_restore_report else step
        for name, kind in kinds.items():
            restored[name] = (_attr(items[name], "item") if name in absent
                              else byte_items.restore_item(kind, items[name], restored[name], name, done))
        rep = self._mgr.last_restore_report
        if rep is not None:
            log.info("mtc: restored step %d (%s) in %.2f s (inventory %.2f s, pull %.2f s, load %.2f s%s): %s",
                     rep.step, "backup " + rep.source if rep.source != "cluster" else "from the hosts", rep.total_s,
                     rep.inventory_s, rep.pull_s, rep.load_s, ", prefetched at start" if rep.prefetched else "",
                     ", ".join(f"{tier} {rep.bytes_by_tier.get(tier, 0)} bytes" for tier in ("ram", "peer", "backup")))
        if not _is_composite(args):
            return restored[DEFAULT_ITEM]
        return type(args)(**{n: restored[n] for n in items})

    def _restore_items(self, step: int | None, items: dict[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
        """One mtc restore of the named items: array trees into their targets, byte items as saved."""
        target: dict[str, Any] = {}
        casts: dict[str, Any] = {}
        whole: list[str] = []
        partial = False
        for name, item_args in items.items():
            item = _attr(item_args, "item")
            if name in kinds:
                target[name] = AS_SAVED
                continue
            if item is None:
                whole.append(name)
                continue
            restore_args = _attr(item_args, "restore_args")
            partial = partial or bool(_attr(item_args, "partial_restore"))
            if restore_args is None:
                target[name] = jax.tree.map(lambda a: _restore_leaf(a, None), item)
                continue
            target[name] = jax.tree.map(_restore_leaf, item, restore_args)
            casts[name] = restore_args
        if whole and not target:
            restored = self._mgr.restore(step)
            restored = {n: restored[n] for n in whole} if isinstance(restored, Mapping) else restored
        else:
            # An item without a tree comes back as saved; items the caller did not name are not
            # read; within a named item every saved leaf must be in its tree unless it asked for
            # partial_restore.
            target.update({n: AS_SAVED for n in whole})
            required = True if partial else tuple(jax.tree_util.keystr((jax.tree_util.DictKey(n),)) for n in target)
            restored = self._mgr.restore(step, target=target, partial=required)
        for name, restore_args in casts.items():
            restored[name] = jax.tree.map(_cast, restored[name], restore_args)
        return restored

    def item_metadata(self, step: int) -> Any:
        raise UnsupportedOperationError(
            "item_metadata() is not supported by mtc; restore(step) without an item tree gives the saved "
            "arrays with their saved shardings, and `mtc restore-version show` lists the backups")

    def metadata(self, step: int | None = None) -> Any:
        raise UnsupportedOperationError(
            "metadata() is not supported by mtc; the step manifests on the ramdisk "
            "(<local_checkpoint_directory>/mtc/steps/) describe every saved array")

    def metrics(self, step: int) -> Any:
        """mtc keeps no metrics: None."""
        return None

    def delete(self, step: int) -> None:
        raise UnsupportedOperationError(
            f"delete({step}) is not supported: mtc keeps steps by policy (local_max_to_keep on the ramdisks, "
            "backup_max_to_keep in the backup root); to restore an older backup, pin it with "
            "`mtc restore-version set NAME`")

    # --- lifecycle ---------------------------------------------------------------------------

    def is_saving_in_progress(self) -> bool:
        return self._mgr.in_flight_step is not None

    def wait_until_finished(self) -> None:
        """Block until the background save is done; raise its error (HostLostError for a lost host)."""
        self._mgr.wait_until_finished()

    def check_for_errors(self) -> None:
        self._mgr.check_for_errors()

    def close(self) -> None:
        self._mgr.close()

    def __enter__(self) -> "OrbaxCompatibleManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
