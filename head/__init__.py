"""The controller side of mtc: the checkpoint manager, dispatch, restore planning, CLI."""

from mtc.head.elastic import HostLostError
from mtc.head.items import DataPositionError, IteratorRestore, IteratorSave
from mtc.head.manager import CheckpointManager
from mtc.head.orbax.compat import OrbaxCompatibleManager
from mtc.head.restore.plan import AS_SAVED
from mtc.shared.config import MTCConfig

__all__ = ["AS_SAVED", "CheckpointManager", "DataPositionError", "HostLostError", "IteratorRestore", "IteratorSave",
           "MTCConfig", "OrbaxCompatibleManager"]
