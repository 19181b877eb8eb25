"""Python's cyclic garbage collector, held off while a reader makes millions of objects at once.

The collector walks every tracked object made so far each time a few hundred more are made, so a
read that builds one container per shard row (a whole step manifest, every blob's holders) spends
about as long in the collector as in its own work, and more as it grows. Nothing such a read makes
is cyclic garbage, so the collector is held off for its duration (``paused``) and runs as usual
after."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block; only a collector that was on is turned on again after (so
    nested and concurrent blocks leave it as the outermost found it, at worst on a little early)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
