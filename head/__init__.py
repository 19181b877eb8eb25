"""The controller side of mtc: the checkpoint manager, dispatch, restore planning, CLI.

Its names are imported when first used (``from mtc.head import CheckpointManager`` as ever): a process
that needs only a corner of the head, such as the pod's supervisor (``mtc.head.supervisor``), which
must not import JAX, does not pay for the rest.
"""

import importlib

_WHERE = {
    "AS_SAVED": "mtc.head.restore.plan",
    "CheckpointManager": "mtc.head.manager",
    "DataPositionError": "mtc.head.items",
    "HostLostError": "mtc.head.elastic",
    "IteratorRestore": "mtc.head.items",
    "IteratorSave": "mtc.head.items",
    "MTCConfig": "mtc.shared.config",
    "OrbaxCompatibleManager": "mtc.head.orbax.compat",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mtc.head' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_WHERE})
