"""The controller side of mtc: the checkpoint manager, dispatch, restore planning, CLI."""

from mtc.head.manager import CheckpointManager
from mtc.shared.config import MTCConfig

__all__ = ["CheckpointManager", "MTCConfig"]
