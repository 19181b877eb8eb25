"""The transport a config asks for: one of the two dispatchers, chosen at the manager's start.

Apart from ``mtc.head.dispatch.interface`` because it imports both implementations, which
import the interface.
"""

from __future__ import annotations

from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.head.dispatch.colocated import ColocatedDispatcher
from mtc.head.dispatch.interface import Dispatcher
from mtc.shared.config import MTCConfig


def make_dispatcher(config: MTCConfig) -> Dispatcher:
    """The transport ``config`` asks for: cluster mode with a cluster spec (``MTC_CLUSTER_SPEC``
    says so without touching the training script), colocated Python otherwise."""
    config = config.with_cluster_spec_from_env()
    if config.cluster_spec:
        return ClusterDispatcher(config)
    return ColocatedDispatcher(config)
