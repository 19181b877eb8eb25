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
  for GKE's replicator daemon) does nothing: mtc is the replication service.

Those are MaxText internals, so the launcher refuses a MaxText outside ``SUPPORTED``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence

from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError, MTCError

log = logging.getLogger(__name__)

SUPPORTED = ((0, 2, 5), (0, 3, 0))  # MaxText versions whose internals the hooks were written for: [lo, hi)
SUPPORTED_TEXT = "maxtext >= 0.2.5, < 0.3"

# MaxText flags that are mtc's config too (DESIGN section 7): read from MaxText's parsed config.
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


def _close_managers() -> None:
    while _managers:
        m = _managers.pop()
        try:
            m.close()
        except Exception as e:  # the run's result is what MaxText said; this is cleanup
            log.warning("mtc: closing the checkpoint manager: %s: %s", type(e).__name__, e)


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

    from mtc.head.orbax_compat import OrbaxCompatibleManager

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
        manager = OrbaxCompatibleManager(cfg)
        _managers.append(manager)
        return manager

    # MaxText dispatches with isinstance on Orbax's class: make ours one of its (virtual) subclasses.
    rcm.ReplicatorCheckpointManager.register(OrbaxCompatibleManager)
    train_utils.create_checkpoint_manager = create_checkpoint_manager
    max_utils.initialize_multi_tier_checkpointing = _mtc_initialize_multi_tier_checkpointing
    _installed = True


def main(argv: Sequence[str] | None = None) -> int:
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
        install()
    except (ConfigError, UnsupportedMaxTextError) as e:
        print(f"mtc: {e}", file=sys.stderr)
        return 2
    from absl import app

    from maxtext.trainers.pre_train import train

    def main_then_close(args: Sequence[str]) -> None:
        try:
            train.main(args)
        finally:
            _close_managers()

    app.run(main_then_close, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
