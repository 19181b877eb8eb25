"""The checkpoint manager: the Orbax-style surface the training script uses.

``save`` validates and flattens the state, copies it to host memory (the only time training
waits), then writes it in the background: phase 1 on every sidecar, the step manifest built
from their answers, phase 2 on every sidecar. ``restore`` picks the newest step committed on
every host (or the one asked for) and brings it back with the target's shardings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from mtc.head import tree as tree_lib
from mtc.head.dispatch import Dispatcher, Leaf, LoadRequest
from mtc.shared import format as fmt
from mtc.shared import backup_layout, shardings, version
from mtc.shared.config import MTCConfig
from mtc.shared.errors import (
    ConfigError,
    MTCError,
    SaveError,
    StepNotFoundError,
    TargetMismatchError,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """What one save did: sizes, blob counts and the time of each phase (seconds)."""

    step: int
    bytes_total: int = 0
    bytes_written: int = 0
    blobs_total: int = 0
    hosts: int = 0
    waited_for_previous_s: float = 0.0
    blocked_s: float = 0.0  # time save() kept the caller (mostly the device-to-host copy)
    stage_s: float = 0.0
    phase1_s: float = 0.0
    phase2_s: float = 0.0
    total_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """What one restore did: bytes and blobs by tier, and the time of each phase (seconds)."""

    step: int
    bytes_by_tier: dict = dataclasses.field(default_factory=dict)
    blobs_by_tier: dict = dataclasses.field(default_factory=dict)
    source: str = "cluster"  # "cluster", or the name of the backup restored
    inventory_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class BackupReport:
    """What one backup did, or why it did not run."""

    step: int
    name: str | None = None
    uploaded_bytes: int = 0
    uploaded_blobs: int = 0
    skipped_blobs: int = 0  # already in the store (incremental backups)
    bytes_by_host: dict = dataclasses.field(default_factory=dict)
    skipped_because_running: int = 0  # due backups skipped while this one ran
    error: str | None = None
    seconds: float = 0.0


def _classify(key: str, leaf: Any) -> str:
    if isinstance(leaf, jax.Array):
        return "jax"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "numpy"
    if isinstance(leaf, (bool, int, float, str)):
        return "scalar"
    raise TargetMismatchError(
        f"leaf {key!r} is a {type(leaf).__name__}; mtc saves jax.Array, numpy arrays and Python "
        "scalars (bool, int, float, str): convert it or leave it out of the state")


def _scalar_doc(v: Any) -> dict:
    if isinstance(v, bool):
        return {"type": "bool", "v": v}
    if isinstance(v, int):
        return {"type": "int", "v": v}
    if isinstance(v, float):
        return {"type": "float", "v": v.hex()}
    return {"type": "str", "v": v}


def _scalar_value(doc: dict) -> Any:
    t, v = doc["type"], doc["v"]
    return {"bool": bool, "int": int, "float": float.fromhex, "str": str}[t](v)


class CheckpointManager:
    """Save and restore JAX training state through mtc's sidecars.

    Usable as a context manager. ``config`` is an ``MTCConfig``; keyword arguments build one.
    """

    def __init__(self, config: MTCConfig | None = None, *, dispatcher: Dispatcher | None = None,
                 **kwargs: Any):
        if config is None:
            config = MTCConfig(**kwargs)
        elif kwargs:
            config = config.replace(**kwargs)
        if not config.local_checkpoint_directory:
            raise ConfigError(
                "local_checkpoint_directory is empty: set it to the ramdisk path "
                "(e.g. local_checkpoint_directory=/tmp/mtc_checkpoints)")
        self._config = config
        self._dispatch = dispatcher or _make_dispatcher(config)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-save")
        self._pending: Future | None = None
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._checked_versions = False
        self._known_steps: set[int] | None = None  # committed steps, to refuse a duplicate save cheaply
        self._closed = False
        self.last_save_report: SaveReport | None = None
        self.last_restore_report: RestoreReport | None = None
        self.last_backup_report: BackupReport | None = None
        self._backup_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-backup")
        self._backup_pending: Future | None = None
        self._backup_skipped = 0
        self._last_backup: tuple[int, float] | None = None  # (step, monotonic time) of the last started

    @property
    def config(self) -> MTCConfig:
        return self._config

    # --- versions ------------------------------------------------------------------------

    def _check_versions(self) -> None:
        if not self._checked_versions:
            version.check_fingerprints(version.fingerprint(), self._dispatch.fingerprints())
            self._checked_versions = True

    # --- save ----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True when ``step`` is due under ``local_checkpoint_period``."""
        return self._config.enable_checkpointing and self._config.should_save(step)

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Save ``state`` as ``step`` if due (or ``force``); returns whether a save started.

        Returns once the state is copied to host memory; the write continues in the
        background (see ``wait_until_finished`` and ``check_for_errors``).
        """
        self._check_open()
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        step = int(step)
        if not self._config.enable_checkpointing:
            return False
        if not (force or self.should_save(step)):
            return False
        t0 = time.perf_counter()
        waited = self._wait_previous()
        self._check_versions()
        if self._known_steps is None:
            self._known_steps = set(self._cluster_steps())
        if step in self._known_steps:
            raise ValueError(f"step {step} is already committed; save a new step number "
                             "(or restore it: checkpoints are immutable)")
        leaves, tree_doc = self._flatten(state)
        t_stage = time.perf_counter()
        staged = self._dispatch.stage(leaves)
        stage_s = time.perf_counter() - t_stage
        blocked = time.perf_counter() - t0
        self._pending = self._executor.submit(self._write, step, leaves, tree_doc, staged, waited,
                                              blocked, stage_s, t0)
        return True

    def _wait_previous(self) -> float:
        pending = self._pending
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            pending.result(timeout=self._config.max_save_wait_s)
        except Exception:  # recorded by _write; reported by check_for_errors
            pass
        return time.perf_counter() - t0

    def _flatten(self, state: Any) -> tuple[list[Leaf], Any]:
        keys, values, _ = tree_lib.flatten(state)
        leaves = []
        for i, (key, value) in enumerate(zip(keys, values)):
            kind = _classify(key, value)
            leaf = Leaf(index=i, key=key, kind=kind, value=value)
            if kind == "jax":
                leaf.dtype = fmt.dtype_name(value.dtype)
                leaf.shape = tuple(value.shape)
                leaf.sharding = value.sharding
                if not value.is_fully_addressable:
                    raise TargetMismatchError(f"leaf {key!r} is not fully addressable from this process")
                leaf.device_boxes = shardings.device_boxes(value.sharding, leaf.shape)
            elif kind == "numpy":
                value = np.asarray(value)
                leaf.value = value
                leaf.dtype = fmt.dtype_name(value.dtype)
                leaf.shape = tuple(value.shape)
            leaves.append(leaf)
        return leaves, tree_lib.encode(state)

    def _write(self, step, leaves, tree_doc, staged, waited, blocked, stage_s, t0) -> SaveReport:
        try:
            t1 = time.perf_counter()
            result = self._dispatch.write(step, staged)
            t2 = time.perf_counter()
            manifest = self._build_manifest(step, leaves, tree_doc, result)
            committed = self._dispatch.commit(step, manifest)
            if self._known_steps is not None:
                self._known_steps.add(step)
            self._maybe_backup(step, manifest)
            t3 = time.perf_counter()
            written = sum(h.get("written_bytes", 0) for h in committed.values())
            report = SaveReport(
                step=step, bytes_total=manifest.nbytes, bytes_written=written,
                blobs_total=len(manifest.blob_names()), hosts=len(committed),
                waited_for_previous_s=waited, blocked_s=blocked, stage_s=stage_s,
                phase1_s=t2 - t1, phase2_s=t3 - t2, total_s=t3 - t0,
            )
            self.last_save_report = report
            log.info("- save step %d; duration=%.3fs; size=%d bytes @ %.2f GB/s", step, report.total_s,
                     report.bytes_total, report.bytes_total / max(report.total_s, 1e-9) / 1e9)
            return report
        except BaseException as e:
            if not isinstance(e, SaveError):
                hosts = getattr(e, "hosts", None) or {}
                e2 = SaveError(f"save of step {step} failed: {e}", step=step, hosts=hosts)
                e2.__cause__ = e
                e = e2
            with self._lock:
                self._errors.append(e)
            log.error("save of step %d failed: %s", step, e)
            raise e

    def _build_manifest(self, step, leaves: list[Leaf], tree_doc, result) -> fmt.StepManifest:
        records = []
        for leaf in leaves:
            if leaf.kind == "scalar":
                records.append(fmt.ArrayRecord(key=leaf.key, kind="scalar", value=_scalar_doc(leaf.value)))
                continue
            dt = fmt.dtype_from_name(leaf.dtype)
            if leaf.kind == "numpy":
                box = tuple((0, n) for n in leaf.shape)
                boxes = [box]
                sharding = None
            else:
                boxes = sorted(set(leaf.device_boxes.values()))
                sharding = shardings.describe(leaf.sharding)
            shards = []
            for box in boxes:
                blob = result.blobs.get((leaf.index, box))
                if blob is None:
                    raise SaveError(f"step {step}: no host wrote array {leaf.key!r} shard {fmt.box_str(box)}",
                                    step=step)
                nbytes = int(np.prod(fmt.box_shape(box), dtype=np.int64)) * dt.itemsize
                shards.append(fmt.ShardRecord(box, blob, nbytes,
                                              tuple(result.box_devices.get((leaf.index, box), ()))))
            records.append(fmt.ArrayRecord(key=leaf.key, kind=leaf.kind, dtype=leaf.dtype, shape=leaf.shape,
                                           sharding=sharding, shards=tuple(shards)))
        return fmt.StepManifest(
            step=step, arrays=tuple(records), tree=tree_doc, created=time.time(),
            topology={"hosts": sorted(result.hosts)}, fingerprint=version.fingerprint(),
        )

    # --- backup --------------------------------------------------------------------------

    def _backup_due(self, step: int) -> bool:
        cfg = self._config
        if not cfg.backup_enabled:
            return False
        if self._last_backup is None:
            return True  # a job's first committed step is backed up at once
        last_step, last_t = self._last_backup
        if cfg.multi_tier_checkpointing_backup_interval_steps:
            n = cfg.multi_tier_checkpointing_backup_interval_steps
            return step // n > last_step // n
        return time.monotonic() - last_t >= cfg.multi_tier_checkpointing_backup_interval_minutes * 60

    def _maybe_backup(self, step: int, manifest: fmt.StepManifest) -> None:
        if not self._backup_due(step):
            return
        running = self._backup_pending
        if running is not None and not running.done():
            self._backup_skipped += 1
            log.warning("backup of step %d skipped: the previous backup is still running", step)
            return
        self._last_backup = (step, time.monotonic())
        skipped, self._backup_skipped = self._backup_skipped, 0
        self._backup_pending = self._backup_executor.submit(self._backup, manifest, skipped)

    def _assign_uploads(self, manifest: fmt.StepManifest) -> dict[str, list[str]]:
        """Each unique blob to one of its holders, largest first to the least loaded holder."""
        holders: dict[str, set[str]] = {}
        sizes: dict[str, int] = {}
        for rec in manifest.arrays:
            for sh in rec.shards:
                sizes[sh.blob] = sh.nbytes
                hs = holders.setdefault(sh.blob, set())
                hs.update(self._dispatch.host_of_device(d) for d in sh.devices)
        load = {h: 0 for h in self._dispatch.hosts()}
        out: dict[str, list[str]] = {h: [] for h in load}
        for blob in sorted(sizes, key=lambda b: (-sizes[b], b)):
            cands = sorted(holders[blob] & set(load)) or sorted(load)
            host = min(cands, key=lambda h: (load[h], h))
            load[host] += sizes[blob]
            out[host].append(blob)
        return out

    def _backup(self, manifest: fmt.StepManifest, skipped: int) -> BackupReport:
        t0 = time.perf_counter()
        step = manifest.step
        try:
            up = self._dispatch.backup_upload(self._assign_uploads(manifest))
            name = backup_layout.backup_name(step)
            host = sorted(up)[0] if up else self._dispatch.hosts()[0]
            self._dispatch.backup_finalize(host, name, manifest, self._config.backup_max_to_keep)
            report = BackupReport(
                step=step, name=name,
                uploaded_bytes=sum(u.get("uploaded_bytes", 0) for u in up.values()),
                uploaded_blobs=sum(u.get("uploaded", 0) for u in up.values()),
                skipped_blobs=sum(u.get("skipped", 0) for u in up.values()),
                bytes_by_host={h: u.get("uploaded_bytes", 0) for h, u in up.items()},
                skipped_because_running=skipped, seconds=time.perf_counter() - t0)
            log.info("- backup %s; duration=%.3fs; uploaded=%d bytes", name, report.seconds, report.uploaded_bytes)
        except Exception as e:  # training must never fail because the bucket did
            report = BackupReport(step=step, skipped_because_running=skipped, error=f"{type(e).__name__}: {e}",
                                  seconds=time.perf_counter() - t0)
            log.error("backup of step %d failed (the next due backup retries): %s", step, e)
        self.last_backup_report = report
        return report

    def wait_for_backup(self) -> BackupReport | None:
        """Block until the running backup (if any) is done; returns its report."""
        pending = self._backup_pending
        if pending is not None:
            pending.result()
        return self.last_backup_report

    def backups(self) -> list[dict]:
        """Backups in the backup tier, newest first ({"name", "step"}); [] without one."""
        if not self._config.base_output_directory:
            return []
        return self._dispatch.backup_listing()["backups"]

    def wait_until_finished(self) -> None:
        """Block until the background save is done; raise its error if it failed."""
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except BaseException:
                pass
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raise (once) the error of a background save that failed since the last check."""
        with self._lock:
            errs, self._errors = self._errors, []
        if errs:
            if len(errs) == 1:
                raise errs[0]
            raise SaveError("; ".join(str(e) for e in errs),
                            hosts={h: m for e in errs for h, m in getattr(e, "hosts", {}).items()})

    # --- inventory -----------------------------------------------------------------------

    def _cluster_steps(self) -> list[int]:
        """Steps committed (and whole) on every host of the current topology, ascending."""
        inv = self._dispatch.inventories()
        # A host that could not be asked (cluster mode: its daemon is down) confirms no step.
        self._unreachable = {h: i["error"] for h, i in inv.items() if i.get("error")}
        per_host = [
            {s["step"] for s in h["steps"] if s["local_blobs"] == s["blobs"]} for h in inv.values()
        ]
        if not per_host:
            return []
        return sorted(set.intersection(*per_host))

    def _unreachable_note(self) -> str:
        bad = getattr(self, "_unreachable", None) or {}
        if not bad:
            return ""
        return ("; hosts that could not be asked, so no step is confirmed on them: "
                + "; ".join(f"{h} ({e})" for h, e in sorted(bad.items())))

    def _backup_listing(self) -> dict:
        if not self._config.base_output_directory:
            return {"backups": [], "restore_version": None}
        return self._dispatch.backup_listing()

    def all_steps(self) -> list[int]:
        """Restorable steps, ascending: committed on every host, or in a complete backup.

        When ``restore.version`` names a backup, only that backup's step.
        """
        listing = self._backup_listing()
        if listing["restore_version"]:
            return [self._pinned_backup(listing)[1]]
        return sorted(set(self._cluster_steps()) | {b["step"] for b in listing["backups"]})

    def latest_step(self) -> int | None:
        """The newest restorable step (see ``all_steps``), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _pinned_backup(self, listing: dict) -> tuple[str, int]:
        rv = listing["restore_version"]
        step = backup_layout.parse_backup_name(rv)
        names = [b["name"] for b in listing["backups"]]
        if rv not in names:
            raise StepNotFoundError(
                f"restore.version in {self._config.backup_root} names backup {rv!r}, which does not exist "
                f"(backups: {names[:5]}); fix it with `mtc restore-version set NAME` or remove it with "
                "`mtc restore-version clear`; nothing was restored")
        return rv, step

    # --- restore -------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Restore ``step`` (default: the latest) into the structure and shardings of ``target``.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` (with ``sharding``) or of arrays;
        without it, arrays come back with the shardings they were saved with.
        """
        self._check_open()
        t0 = time.perf_counter()
        self._wait_previous()
        self._check_versions()
        listing = self._backup_listing()
        backup_name = None
        if listing["restore_version"]:
            backup_name, pinned = self._pinned_backup(listing)
            if step is not None and step != pinned:
                raise StepNotFoundError(f"restore.version pins backup {backup_name} (step {pinned}); "
                                        f"step {step} was asked for; clear restore.version to restore it")
            step = pinned
        else:
            cluster = self._cluster_steps()
            in_backup = {}
            for b in listing["backups"]:  # newest first: keep the newest backup of each step
                in_backup.setdefault(b["step"], b["name"])
            steps = sorted(set(cluster) | set(in_backup))
            if step is None:
                if not steps:
                    raise StepNotFoundError(
                        f"no committed step in {self._config.ramdisk_root}"
                        + (f" nor in {self._config.backup_root}" if self._config.base_output_directory else "")
                        + "; nothing to restore (save a step first, or check local_checkpoint_directory)"
                        + self._unreachable_note())
                step = steps[-1]
            elif step not in steps:
                raise StepNotFoundError(f"step {step} is not committed on every host; committed steps: {steps}"
                                        + self._unreachable_note())
            if step not in cluster:
                backup_name = in_backup[step]
        t1 = time.perf_counter()
        if backup_name is None:
            manifest = self._dispatch.manifest(step)
        else:
            manifest = self._dispatch.backup_manifest(backup_name)
        requests, finish = self._plan(manifest, target)
        fetched: dict[str, dict] = {}
        needed_bytes, needed_blobs = sum(r.record.nbytes for r in requests), len(manifest.blob_names())
        if backup_name is not None:
            needs = self._needs(manifest, requests)
            sizes = manifest.blob_sizes()
            # Counted per host: a blob two hosts need is two transfers.
            needed_bytes = sum(sizes[b] for bs in needs.values() for b in bs)
            needed_blobs = sum(len(bs) for bs in needs.values())
            fetched = self._dispatch.backup_fetch(backup_name, needs)
        arrays = self._dispatch.load(step, requests)
        t2 = time.perf_counter()
        result = finish(arrays)
        nbytes = sum(r.record.nbytes for r in requests)
        from_backup = sum(f.get("downloaded_bytes", 0) for f in fetched.values())
        blobs_backup = sum(f.get("downloaded", 0) for f in fetched.values())
        by_tier = {"ram": needed_bytes - from_backup}
        blobs = {"ram": needed_blobs - blobs_backup}
        if backup_name is not None:
            by_tier["backup"], blobs["backup"] = from_backup, blobs_backup
        self.last_restore_report = RestoreReport(
            step=step, bytes_by_tier=by_tier, blobs_by_tier=blobs, source=backup_name or "cluster",
            inventory_s=t1 - t0, load_s=t2 - t1, total_s=time.perf_counter() - t0)
        log.info("- restore step %d; duration=%.3fs; size=%d bytes", step, time.perf_counter() - t0, nbytes)
        return result

    def _needs(self, manifest: fmt.StepManifest, requests: list[LoadRequest]) -> dict[str, list[str]]:
        """host -> the blobs it needs to assemble its shards of the restore target."""
        out: dict[str, set[str]] = {h: set() for h in self._dispatch.hosts()}
        for r in requests:
            rec = r.record
            if r.sharding is None:
                for h in out:
                    out[h].update(sh.blob for sh in rec.shards)
                continue
            for dev_id, box in shardings.device_boxes(r.sharding, rec.shape).items():
                host = self._dispatch.host_of_device(dev_id)
                out.setdefault(host, set()).update(
                    sh.blob for sh in rec.shards if fmt.box_intersect(sh.box, box) is not None)
        return {h: sorted(b) for h, b in out.items()}

    def _plan(self, manifest: fmt.StepManifest, target: Any):
        by_key = {a.key: a for a in manifest.arrays}
        if target is None:
            keys = [a.key for a in manifest.arrays]
            targets = [None] * len(keys)
            rebuild = lambda leaves: tree_lib.decode(manifest.tree, leaves)  # noqa: E731
        else:
            keys, targets, treedef = tree_lib.flatten(target)
            missing = sorted(set(by_key) - set(keys))
            extra = sorted(set(keys) - set(by_key))
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
        for key, tgt in zip(keys, targets):
            rec = by_key[key]
            if rec.kind == "scalar":
                slots.append(("value", _scalar_value(rec.value)))
                continue
            sharding = self._target_sharding(rec, tgt)
            slots.append(("array", len(requests)))
            requests.append(LoadRequest(rec, sharding))

        def finish(arrays: list[Any]) -> Any:
            leaves = [v if kind == "value" else arrays[v] for kind, v in slots]
            return rebuild(leaves)

        return requests, finish

    def _target_sharding(self, rec: fmt.ArrayRecord, tgt: Any) -> Any:
        if tgt is not None and not isinstance(tgt, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            if isinstance(tgt, (bool, int, float, str)):
                raise TargetMismatchError(f"array {rec.key!r}: target is a Python scalar but a {rec.kind} "
                                          "array was saved")
            raise TargetMismatchError(f"array {rec.key!r}: unsupported target leaf {type(tgt).__name__}")
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

    # --- lifecycle -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise MTCError("this CheckpointManager is closed; create a new one")

    def close(self) -> None:
        """Wait for the background save, then release the sidecars."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._backup_executor.shutdown(wait=True)
            self._dispatch.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _make_dispatcher(config: MTCConfig) -> Dispatcher:
    if not config.cluster_spec and os.environ.get("MTC_CLUSTER_SPEC"):
        # The launcher's way to say "cluster mode" without touching the training script.
        config = config.replace(cluster_spec=os.environ["MTC_CLUSTER_SPEC"])
    if config.cluster_spec:
        from mtc.head.cluster import ClusterDispatcher

        return ClusterDispatcher(config)
    from mtc.head.colocated import ColocatedDispatcher

    return ColocatedDispatcher(config)
