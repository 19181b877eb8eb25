"""The controller side of mtc: the checkpoint manager, dispatch, restore planning, CLI."""

from mtc.head.elastic import HostLostError
from mtc.head.manager import CheckpointManager
from mtc.head.orbax_compat import OrbaxCompatibleManager
from mtc.shared.config import MTCConfig

__all__ = ["CheckpointManager", "HostLostError", "MTCConfig", "OrbaxCompatibleManager"]
