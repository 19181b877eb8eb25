"""The transport a config asks for: one of the two dispatchers, chosen at the manager's start.

Apart from ``mtc.head.dispatch.interface`` because it imports both implementations, which
import the interface.
"""

from __future__ import annotations

import os

from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.head.dispatch.colocated import ColocatedDispatcher
from mtc.head.dispatch.interface import Dispatcher
from mtc.shared.config import MTCConfig


def make_dispatcher(config: MTCConfig) -> Dispatcher:
    """The transport ``config`` asks for: cluster mode with a cluster spec (``MTC_CLUSTER_SPEC``
    says so without touching the training script), colocated Python otherwise."""
    if not config.cluster_spec and os.environ.get("MTC_CLUSTER_SPEC"):
        config = config.replace(cluster_spec=os.environ["MTC_CLUSTER_SPEC"])
    if config.cluster_spec:
        return ClusterDispatcher(config)
    return ColocatedDispatcher(config)
