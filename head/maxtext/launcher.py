"""MaxText's own pre-training, with mtc as its multi-tier checkpoint manager.

    python3 -m mtc.head.maxtext <exactly the arguments of python3 -m maxtext.trainers.pre_train.train>

For example, the MaxText guide's Pathways flags::

    python3 -m mtc.head.maxtext maxtext/configs/base.yml run_name=R base_output_directory=gs://B/P \\
        enable_single_controller=True enable_multi_tier_checkpointing=True colocated_python_checkpointing=True \\
        local_checkpoint_directory=/local local_checkpoint_period=20 multi_tier_checkpointing_backup_interval_minutes=30

MaxText's flags build the ``MTCConfig``; mtc's own settings come from ``MTC_*`` variables (as
the rendered JobSet sets them: ``MTC_PEER_PORT``, ``MTC_REPLICATION_FACTOR``, ...;
``MTC_CLUSTER_SPEC`` selects cluster mode). What the launcher changes in MaxText, and only
with ``enable_multi_tier_checkpointing=True``:

- ``train_utils.create_checkpoint_manager`` returns an ``OrbaxCompatibleManager`` instead of
  Orbax's ``ReplicatorCheckpointManager``, which is registered as a virtual subclass of it, so
  MaxText's ``isinstance`` dispatch (save, restore, latest_step, all_steps, ...) takes its
  multi-tier path unchanged;
- ``max_utils.initialize_multi_tier_checkpointing`` (which writes ``replicator.yaml`` and waits
  for GKE's replicator daemon) does nothing: mtc is the replication service;
- ``emergency_checkpointing.save``/``restore`` (which MaxText's ``save_checkpoint`` and
  ``load_state_if_possible`` call for a multi-tier manager) save and restore the Grain data
  iterator too, as the ``iter`` item of the same step (``mtc.head.maxtext.data``): a resumed run
  reads the data from where the step left it;
- a SIGTERM makes ``reached_preemption`` true: MaxText saves the step it reached at the next step
  boundary and stops; the launcher waits for its commit and copies within
  ``MTC_PREEMPTION_GRACE_S`` and exits 0 (``mtc.head.preemption``);
- a run that mtc holds no step of starts from MaxText's own ``load_full_state_path`` /
  ``load_parameters_path`` (a standard Orbax checkpoint), as without mtc, and from then on saves
  and restores through mtc's tiers: a restart resumes from mtc's newest step, not from the path;
- with ``MTC_EXPORT_ON_FINISH`` set (``1``: MaxText's own ``checkpoint_dir``,
  ``<base_output_directory>/<run_name>/checkpoints``; else a directory), a run that finishes
  exports its last step as MaxText's standard checkpoint (``mtc.head.orbax.export``), ``<dir>/<step>/items``.

Those are MaxText internals, so the launcher refuses a MaxText outside ``SUPPORTED``.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Sequence

from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError, MTCError

log = logging.getLogger(__name__)

SUPPORTED = ((0, 2, 5), (0, 3, 0))  # MaxText versions whose internals the hooks were written for: [lo, hi)
SUPPORTED_TEXT = "maxtext >= 0.2.5, < 0.3"

# MaxText flags that are mtc's config too: read from MaxText's parsed config.
MAXTEXT_FLAGS = (
    "enable_checkpointing", "enable_multi_tier_checkpointing", "colocated_python_checkpointing",
    "local_checkpoint_directory", "local_checkpoint_period", "multi_tier_checkpointing_backup_interval_minutes",
    "multi_tier_checkpointing_backup_interval_steps", "base_output_directory", "run_name",
)

# The MaxText attributes the hooks replace or read; a MaxText without one of them is refused.
_HOOKED = (
    ("maxtext.utils.train_utils", "create_checkpoint_manager"),
    ("maxtext.utils.max_utils", "initialize_multi_tier_checkpointing"),
    ("maxtext.common.checkpointing", "EmergencyReplicatorCheckpointManager"),
    ("maxtext.common.emergency_checkpointing", "save"),
    ("maxtext.common.emergency_checkpointing", "restore"),
    ("maxtext.common.checkpointing", "save_checkpoint"),
    ("maxtext.common.checkpointing", "load_state_if_possible"),
    ("maxtext.common.checkpointing", "_should_save_checkpoint_at_step"),
    ("maxtext.trainers.pre_train.train", "main"),
)


class UnsupportedMaxTextError(MTCError):
    """The installed MaxText is not one whose internals the launcher knows."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_maxtext_version(version: str | None = None) -> str:
    """The installed MaxText's version; UnsupportedMaxTextError outside ``SUPPORTED``."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("maxtext")
        except metadata.PackageNotFoundError:
            raise UnsupportedMaxTextError(
                f"MaxText is not installed; install it with pip install 'mtc[maxtext]' ({SUPPORTED_TEXT}, "
                "Python >= 3.12)") from None
    lo, hi = SUPPORTED
    if not lo <= _version_tuple(version) < hi:
        raise UnsupportedMaxTextError(
            f"maxtext {version} is not supported by this mtc: the launcher replaces MaxText internals that it knows "
            f"for {SUPPORTED_TEXT}; install a supported MaxText (pip install 'mtc[maxtext]') or an mtc that "
            "supports this one")
    return version


def config_from_argv(argv: Sequence[str], environ: Any = None) -> MTCConfig:
    """Check the mtc flags of a MaxText command line before anything starts (names the flag)."""
    return MTCConfig.from_flags(list(argv[1:]), ignore_unknown=True, environ=environ)


def config_from_maxtext(config: Any, environ: Any = None) -> MTCConfig:
    """The ``MTCConfig`` of MaxText's parsed config, with mtc's own settings from ``MTC_*``."""
    values = {name: getattr(config, name) for name in MAXTEXT_FLAGS if hasattr(config, name)}
    for name in ("multi_tier_checkpointing_backup_interval_minutes", "multi_tier_checkpointing_backup_interval_steps"):
        if values.get(name) == 0:
            values[name] = None
    values = {k: (str(v) if k in ("local_checkpoint_directory", "base_output_directory", "run_name") else v)
              for k, v in values.items() if v is not None or k.startswith("multi_tier")}
    return MTCConfig.from_flags([], environ=environ, **values)


def _mtc_initialize_multi_tier_checkpointing(*args: Any, **kwargs: Any) -> None:
    log.info("mtc: multi-tier checkpointing needs no replicator daemon (mtc's sidecars replicate); "
             "not waiting for replicator.yaml")


_installed = False
_managers: list = []  # made for MaxText, which never closes its checkpoint manager: closed at the end
_notice = None  # the launcher's PreemptionNotice (SIGTERM), given to every manager it makes
_call = threading.local()  # the data iterator and config of the MaxText save/restore call in progress
_cache = None  # the run's CompileCache (mtc.head.maxtext.compile_cache), when the launcher keeps one
_export: dict = {}  # MTC_EXPORT_ON_FINISH: {"to": directory, "custom_metadata": ...} of the run's config
ENV_EXPORT = "MTC_EXPORT_ON_FINISH"


def export_target(config: Any, environ: Any = None) -> dict:
    """Where a finished run exports its last step (``MTC_EXPORT_ON_FINISH``); {} when it does not."""
    import os

    from mtc.shared.config import FALSE_WORDS, TRUE_WORDS

    value = (environ if environ is not None else os.environ).get(ENV_EXPORT, "").strip()
    if value.lower() in FALSE_WORDS or not value:  # the one rule for on and off (mtc.shared.config.env_flag)
        return {}
    to = str(getattr(config, "checkpoint_dir", "") or "") if value.lower() in TRUE_WORDS else value
    if not to:
        raise ConfigError(f"{ENV_EXPORT}=1 exports to MaxText's checkpoint_dir, which this config does not "
                          f"have; set {ENV_EXPORT} to a directory")
    meta = {"scan_layers": config.scan_layers} if hasattr(config, "scan_layers") else {}
    return {"to": to.rstrip("/") or to, "custom_metadata": meta}


def _close_managers() -> None:
    while _managers:
        m = _managers.pop()
        try:
            m.close()
        except Exception as e:  # the run's result is what MaxText said; this is cleanup
            log.warning("mtc: closing the checkpoint manager: %s: %s", type(e).__name__, e)


def _retire_previous_managers(config: Any) -> None:
    """In MaxText's elastic mode, the managers of the attempt the retry abandoned are closed.

    Each attempt of MaxText's elastic retry (``elastic_utils.elastic_retry`` around ``initialize``
    and the train loop, in the same process) builds its checkpoint manager again, and never closes
    the one before: that one still has the failed save's background work and the lost slice's
    connections, and would keep its threads and replication retries running beside the new one.
    It is closed before the new one is made; its error (the lost host's, already handled by the
    retry) is logged, not raised. Outside elastic mode nothing is closed: MaxText makes one manager.
    """
    if not getattr(config, "elastic_enabled", False) or not _managers:
        return
    log.info("mtc: an elastic retry makes a new checkpoint manager: closing the %d of the attempt before",
             len(_managers))
    _close_managers()


def install() -> None:
    """Put mtc in MaxText's place for multi-tier checkpointing (idempotent); refuses an unknown MaxText."""
    global _installed
    if _installed:
        return
    import importlib

    check_maxtext_version()
    modules = {}
    for module, attr in _HOOKED:
        try:
            modules[module] = importlib.import_module(module)
        except ImportError as e:
            raise UnsupportedMaxTextError(
                f"cannot import {module} ({type(e).__name__}: {e}); MaxText's dependencies are missing: install "
                f"them with pip install 'mtc[maxtext]' (maxtext[tpu], {SUPPORTED_TEXT}) or, on CPU, the smaller set "
                "in mtc's tests/maxtext/requirements-cpu.txt") from e
        if not hasattr(modules[module], attr):
            raise UnsupportedMaxTextError(
                f"{module}.{attr} does not exist in this MaxText; the launcher hooks it and supports {SUPPORTED_TEXT}")
    from orbax.checkpoint.experimental.emergency import replicator_checkpoint_manager as rcm

    from mtc.head.orbax.compat import OrbaxCompatibleManager

    train_utils = modules["maxtext.utils.train_utils"]
    max_utils = modules["maxtext.utils.max_utils"]
    original = train_utils.create_checkpoint_manager

    def create_checkpoint_manager(config: Any, mesh: Any, init_state_fn: Any) -> Any:
        if not getattr(config, "enable_multi_tier_checkpointing", False):
            return original(config, mesh, init_state_fn)
        cfg = config_from_maxtext(config)
        log.info("mtc: multi-tier checkpointing (%s mode) at %s, every %d steps%s", cfg.mode,
                 cfg.local_checkpoint_directory, cfg.local_checkpoint_period,
                 f", backups to {cfg.backup_root}" if cfg.backup_enabled else "")
        _export.update(export_target(config))
        _retire_previous_managers(config)
        if _cache is not None:
            _cache.wait_filled()  # the state's initialisation and the train step compile next
            log.info("mtc: compilation cache in %s: %d entries (%d from the backup)", _cache.local, _cache.entries(),
                     _cache.filled)
        manager = OrbaxCompatibleManager(cfg)
        if _notice is not None:
            manager.mtc_manager.watch_preemption(notice=_notice)
        if cfg.backup_enabled and threading.current_thread() is threading.main_thread():
            manager.mtc_manager.watch_backup_requests()  # SIGUSR1: back the next step up now
        _managers.append(manager)
        return manager

    # MaxText dispatches with isinstance on Orbax's class: make ours one of its (virtual) subclasses.
    rcm.ReplicatorCheckpointManager.register(OrbaxCompatibleManager)
    train_utils.create_checkpoint_manager = create_checkpoint_manager
    max_utils.initialize_multi_tier_checkpointing = _mtc_initialize_multi_tier_checkpointing
    _hook_data_and_preemption(modules["maxtext.common.checkpointing"], modules["maxtext.common.emergency_checkpointing"],
                              OrbaxCompatibleManager)
    _installed = True


class SaveFailures:
    """Training goes on while a sidecar is briefly gone: the policy for a save whose host was lost.

    A background save that failed because a host stopped answering raises at the next save (the
    manager's ``check_for_errors``), and MaxText's save path turns any error into
    ``RuntimeError("Checkpointing failed")``, which ends the job: a sidecar container that
    restarts in seconds would cost a whole restart. Outside MaxText's elastic mode (where the
    error is what the elastic retry acts on, and is raised as it is), such a failure is logged
    and the save is tried again at once, for up to ``MTC_SAVE_FAILURE_GRACE_S`` seconds (default
    300) from the first failure of a run of them; after that the error is raised. The last
    committed step stays the restore point meanwhile. A forced save (the run's last step, a
    preemption's) is waited for and saved again until it commits, within the same grace: no later
    save would retry it. MaxText's own waits for the pending save (after a forced save, and when
    training ends) go through ``wait``, under the same rule. Any other save error is raised as
    before.
    """

    ENV = "MTC_SAVE_FAILURE_GRACE_S"

    def __init__(self, environ: Any = None) -> None:
        import os

        from mtc.shared.config import env_number

        self.grace_s = env_number(self.ENV, environ if environ is not None else os.environ, default=300.0,
                                  inclusive=True, why="seconds, e.g. 300 (0 raises at once)")
        self.failing_since: float | None = None
        self.tolerated = 0
        self._last: tuple[int, Any] | None = None  # the last save started: (step, its args)
        self._elastic = False  # whether that save was made in MaxText's elastic mode

    def tolerate(self, e: BaseException, *, elastic: bool) -> bool:
        """Whether training goes on after ``e``, a save's lost host (logged), or it is raised."""
        import time

        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if elastic or now - self.failing_since >= self.grace_s:
            return False
        self.tolerated += 1
        log.warning("mtc: a save failed because a host stopped answering (%s); training goes on from the last "
                    "committed step, and saves go on (for %.0f s more, %s)", e,
                    self.grace_s - (now - self.failing_since), self.ENV)
        return True

    def save(self, manager: Any, step: int, args: Any, force: bool, *, elastic: bool) -> bool:
        from mtc.head.elastic import HostLostError

        self._last, self._elastic = (step, args), elastic
        try:
            saved = manager.save(step, args=args, force=force)
        except HostLostError as e:
            if not self.tolerate(e, elastic=elastic):
                raise
            try:
                saved = manager.save(step, args=args, force=force)
            except HostLostError as again:  # the host is still gone: this step is not saved now
                if not force or elastic:
                    log.warning("mtc: step %d not saved: %s", step, again)
                    return False
                return self._finish_forced(manager, step, args, resave=True)
        else:
            if self.failing_since is not None and saved:
                self.failing_since = None
        if saved and force and not elastic:
            saved = self._finish_forced(manager, step, args, resave=False)
        return saved

    def wait(self, manager: Any) -> None:
        """MaxText's wait for the pending save (after a forced save, and when training ends).

        A lost host's error there is a background save's. When that save was the last one this
        run started and its step is not committed (the run's last step, saved by the loop), it
        is saved again until it commits, as a forced save is; an older step's failure is
        tolerated within the grace (a later step committed, or will). In elastic mode (as the
        last save was made) it is raised as it is."""
        from mtc.head.elastic import HostLostError

        try:
            manager.wait_until_finished()
        except HostLostError as e:
            if self._elastic:
                raise
            last = self._last
            if last is not None and not manager.mtc_manager.has_step(last[0]) and _alive(last[1]):
                log.warning("mtc: the save of step %d failed because a host stopped answering (%s); saving it "
                            "again", last[0], e)
                self._finish_forced(manager, *last, resave=True)
            elif not self.tolerate(e, elastic=False):
                raise
        else:
            self.failing_since = None

    def _finish_forced(self, manager: Any, step: int, args: Any, *, resave: bool) -> bool:
        """A forced save (the run's last step, or the step a preemption notice found) is waited
        for: no later save would retry it. One whose host was lost (or, with ``resave``, one that
        could not start) is saved again, once a second, until it commits or the grace has passed
        since the first failure; then the error is raised, as MaxText's own final save would
        raise it."""
        import time

        from mtc.head.elastic import HostLostError

        while True:
            try:
                if resave:
                    manager.save(step, args=args, force=True)
                manager.wait_until_finished()
                self.failing_since = None
                return True
            except HostLostError as e:
                now = time.monotonic()
                self.failing_since = self.failing_since or now
                left = self.grace_s - (now - self.failing_since)
                if left <= 0:
                    raise
                self.tolerated += 1
                log.warning("mtc: the forced save of step %d failed because a host stopped answering (%s); "
                            "saving it again (for %.0f s more, %s)", step, e, left, self.ENV)
                time.sleep(min(1.0, left))
                resave = True


def _alive(args: Any) -> bool:
    """Whether every array of a save's ``args`` (a Composite of PyTreeSave) still holds its buffers:
    a train step that donated its inputs deletes those of an older state."""
    import jax

    items = [args[k].item for k in args.keys()] if hasattr(args, "keys") else [args]
    return not any(getattr(a, "is_deleted", lambda: False)() for a in jax.tree.leaves(items))


_saves: SaveFailures | None = None  # made in main() (it reads the environment), else at the first save


def _hook_data_and_preemption(checkpointing: Any, emergency: Any, ours: type) -> None:
    """The data iterator into mtc's steps and out of them; SIGTERM as a save of the step reached.

    MaxText's ``save_checkpoint``/``load_state_if_possible`` have the data iterator, and call
    ``emergency_checkpointing.save``/``restore`` without it for a multi-tier manager: the first
    two note it for the call, the second two use it (only for mtc's manager).
    """
    import orbax.checkpoint as ocp

    from mtc.head.maxtext import data as maxtext_data

    save_checkpoint, load_state = checkpointing.save_checkpoint, checkpointing.load_state_if_possible
    wait_until_finished = checkpointing.wait_until_finished
    emergency_save, emergency_restore = emergency.save, emergency.restore
    should_save = checkpointing._should_save_checkpoint_at_step

    def save_checkpoint_noting(checkpoint_manager, step, state, config=None, data_iterator=None, force=False):
        from mtc.head.elastic import HostLostError

        global _saves
        _call.data_iterator = data_iterator
        try:
            try:
                return save_checkpoint(checkpoint_manager, step, state, config, data_iterator, force)
            except HostLostError as e:
                # MaxText waits for the previous save before it saves: that wait raises a background
                # save's lost host. Within the grace (outside elastic mode) this save goes on.
                _saves = _saves or SaveFailures()
                if not isinstance(checkpoint_manager, ours) or not _saves.tolerate(
                        e, elastic=bool(getattr(config, "elastic_enabled", False))):
                    raise
                return save_checkpoint(checkpoint_manager, step, state, config, data_iterator, force)
        finally:
            _call.data_iterator = None

    def save(checkpoint_manager, step, state, config, force):
        if not isinstance(checkpoint_manager, ours):
            return emergency_save(checkpoint_manager, step, state, config, force)
        items = {"state": ocp.args.PyTreeSave(item=state)}
        iterator = getattr(_call, "data_iterator", None)
        if config is not None and maxtext_data.keeps_position(config, iterator):
            items[maxtext_data.ITEM] = maxtext_data.save_args(config, iterator)
        global _saves
        force = force or checkpoint_manager.reached_preemption(step)
        _saves = _saves or SaveFailures()
        saved = _saves.save(checkpoint_manager, step, ocp.args.Composite(**items), force,
                            elastic=bool(getattr(config, "elastic_enabled", False)))
        if saved and _cache is not None:
            _cache_ran()
            _cache.sync_in_background()  # what compiled since the last save, to the backup
        return saved

    def restore(checkpoint_manager, step, abstract_state):
        if not isinstance(checkpoint_manager, ours):
            return emergency_restore(checkpoint_manager, step, abstract_state)
        target = abstract_state.to_pure_dict() if hasattr(abstract_state, "to_pure_dict") else abstract_state
        import jax

        items = {"state": ocp.args.PyTreeRestore(
            item=target, partial_restore=True,
            restore_args=jax.tree.map(lambda a: ocp.type_handlers.ArrayRestoreArgs(sharding=a.sharding), target))}
        iterator, config = getattr(_call, "data_iterator", None), getattr(_call, "config", None)
        if config is not None and maxtext_data.keeps_position(config, iterator):
            if maxtext_data.restart_requested():
                log.warning("mtc: MTC_DATA_RESTART is set: step %d's state is restored, its data position is not "
                            "(the data starts over)", step)
            else:
                items[maxtext_data.ITEM] = maxtext_data.restore_args(config, iterator)
        restored = checkpoint_manager.restore(step, args=ocp.args.Composite(**items))
        if maxtext_data.ITEM in items:
            log.info("mtc: step %d's data position restored (%s)", step, maxtext_data.ITEM)
        return restored.state

    def load_state_if_possible(checkpoint_manager, data_iterator, *args, **kwargs):
        if not isinstance(checkpoint_manager, ours):
            return load_state(checkpoint_manager, data_iterator, *args, **kwargs)
        config = kwargs.get("maxtext_config")
        if config is not None:
            skip = maxtext_data.describe_skip(config, data_iterator)
            log.info("%s", skip or f"mtc: the data iterator's position is saved with every step (item "
                                   f"{maxtext_data.ITEM!r}, dataset_type=grain)")
        _call.data_iterator, _call.config = data_iterator, config
        try:
            restored, params = load_state(checkpoint_manager, data_iterator, *args, **kwargs)
        finally:
            _call.data_iterator = _call.config = None
        if (isinstance(restored, dict) and list(restored) == ["items"]
                and checkpoint_manager.mtc_manager.last_restore_report is None):
            # mtc held no step: MaxText read its load_full_state_path, and hands the state back the
            # way its standard manager does; for a multi-tier manager it expects the state itself.
            log.info("mtc: no step of this run in mtc's tiers: started from load_full_state_path; the run saves "
                     "and resumes through mtc from now on")
            restored = restored["items"]
        return restored, params

    def should_save_at(checkpoint_manager, step, config, force):
        # MaxText asks after every step, and reads a step's metrics at the next one: by the second ask the
        # programs this start copied into the compilation cache have run. Not waiting for a save keeps a
        # start that a failure struck between saves from condemning good entries.
        if isinstance(checkpoint_manager, ours) and _cache is not None and _cache.step_seen():
            _cache_ran()
        if isinstance(checkpoint_manager, ours) and checkpoint_manager.reached_preemption(step):
            return True  # the step a SIGTERM found the job at, whatever the periods say
        return should_save(checkpoint_manager, step, config, force)

    def wait_for_saves(checkpoint_manager):
        if not isinstance(checkpoint_manager, ours):
            return wait_until_finished(checkpoint_manager)
        global _saves
        _saves = _saves or SaveFailures()
        return _saves.wait(checkpoint_manager)

    checkpointing.save_checkpoint = save_checkpoint_noting
    checkpointing.wait_until_finished = wait_for_saves
    checkpointing.load_state_if_possible = load_state_if_possible
    checkpointing._should_save_checkpoint_at_step = should_save_at
    emergency.save, emergency.restore = save, restore


def _cache_ran() -> None:
    """The programs this start copied into the compilation cache ran (two steps, or a save): off probation."""
    if _cache is not None and (report := _cache.first_report()) is not None:
        _cache.passed()
        log.info("mtc: compilation cache: %s", report)


def _export_last_step(manager: Any) -> None:
    """The run finished: its last step as MaxText's standard checkpoint (MTC_EXPORT_ON_FINISH)."""
    manager.wait_until_finished()
    step = manager.latest_step()
    if step is None:
        log.warning("mtc: %s is set but the run saved no step; nothing exported", ENV_EXPORT)
        return
    report = manager.export(_export["to"], step, custom_metadata=_export["custom_metadata"] or None)
    log.info("mtc: exported step %d as a standard checkpoint: %s (%s)", step, report.path,
             " ".join(report.maxtext_flags()))


def main(argv: Sequence[str] | None = None) -> int:
    global _notice, _cache, _saves
    from mtc.head.maxtext import compile_cache
    from mtc.head.items import DataPositionError
    from mtc.head.preemption import PreemptionNotice

    from mtc.shared.config import misspelled_env

    for message in misspelled_env():  # MTC_STANBY=0 would do nothing: said, as MaxText says a misspelled flag
        log.warning("mtc: %s", message)
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2:
        print("usage: python3 -m mtc.head.maxtext <MaxText config.yml> key=value ... "
              "(the arguments of python3 -m maxtext.trainers.pre_train.train)", file=sys.stderr)
        return 2
    try:
        cfg = config_from_argv(argv)
        if cfg.enable_multi_tier_checkpointing and not cfg.backup_enabled:
            raise ConfigError("enable_multi_tier_checkpointing=True needs one backup interval: set "
                              "multi_tier_checkpointing_backup_interval_minutes or "
                              "multi_tier_checkpointing_backup_interval_steps (MaxText requires exactly one)")
        _saves = SaveFailures()
        _cache = compile_cache.for_launcher(argv, cfg)
        if _cache is not None:  # filled from the backup while MaxText imports
            _cache.start_fill()
            argv.append(f"jax_cache_dir={_cache.local}")
        install()
        if _cache is not None:
            _cache.enable()
        _notice = PreemptionNotice().install()  # SIGTERM: save the step reached, then exit (MTC_PREEMPTION_GRACE_S)
    except (ConfigError, UnsupportedMaxTextError) as e:
        print(f"mtc: {e}", file=sys.stderr)
        return 2
    from absl import app

    from maxtext.trainers.pre_train import train

    def main_then_close(args: Sequence[str]) -> None:
        try:
            try:
                train.main(args)
            except DataPositionError as e:  # bad input, named: a message, not a traceback
                print(f"mtc: {e}", file=sys.stderr)
                sys.exit(2)
            if _notice.received:
                for m in list(_managers):
                    m.mtc_manager.finish_preemption()
            elif _export and _managers:
                _export_last_step(_managers[-1].mtc_manager)
        finally:
            _close_managers()
            if _cache is not None:
                _cache.close(timeout=0 if _notice.received else 30)
                log.info("mtc: compilation cache: %s", _cache.summary())
            _notice.done()  # closed in time: no exit by the budget's timer

    app.run(main_then_close, argv=argv)
    return 0

