"""The head's one-thread fan-out (``HostLanes.call_each``) against real daemons: every
host's failure is its own, a hung host costs its deadline and no more, a restarted one is
reconnected within the same call, and a large request still goes out on threads."""

from __future__ import annotations

import signal
import threading
import time

import jax
import numpy as np
import psutil
import pytest

from mtc.head import MTCConfig
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.head.dispatch.cluster.lanes import _INLINE_BYTES
from mtc.shared.errors import HostUnreachableError

pytestmark = pytest.mark.integration


def dispatcher(cluster, **kw) -> ClusterDispatcher:
    cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path))
    return ClusterDispatcher(cfg, jax.devices(), **kw)


def test_a_hung_host_fails_alone_at_its_deadline(local_cluster):
    d = dispatcher(local_cluster, control_timeout_s=1.0)
    try:
        replies, failures = d.lanes.call_each("ping")
        assert not failures and {h: r.result["host"] for h, r in replies.items()} == {h: h for h in d.hosts()}
        local_cluster.kill("s1-h0", signal.SIGSTOP, wait=False)
        stopped = psutil.Process(local_cluster.pid("s1-h0"))
        deadline = time.monotonic() + 10
        while stopped.status() != psutil.STATUS_STOPPED:  # the signal takes effect a moment after kill()
            assert time.monotonic() < deadline, "the daemon did not stop"
            time.sleep(0.01)
        try:
            t = time.monotonic()
            replies, failures = d.lanes.call_each("ping")
            took = time.monotonic() - t
        finally:
            local_cluster.kill("s1-h0", signal.SIGCONT, wait=False)
        assert set(failures) == {"s1-h0"} and set(replies) == set(d.hosts()) - {"s1-h0"}
        assert isinstance(failures["s1-h0"], HostUnreachableError) and "no answer within 1s" in str(failures["s1-h0"])
        assert took < 10, took  # its deadline, not one per host
        replies, failures = d.lanes.call_each("ping")  # the late answer went with the dropped connection
        assert not failures and all(r.result["host"] == h for h, r in replies.items())
    finally:
        d.close()


def test_a_restarted_host_is_reconnected_in_the_same_call(local_cluster):
    d = dispatcher(local_cluster)
    try:
        assert not d.lanes.call_each("ping")[1]
        old = local_cluster.pid("s0-h1")
        local_cluster.kill("s0-h1")
        local_cluster.restart("s0-h1")
        # Its connection is stale: the call makes a new one (authenticated, fingerprinted) and tries once more.
        replies, failures = d.lanes.call_each("ping")
        assert not failures, failures
        assert replies["s0-h1"].result["pid"] == local_cluster.pid("s0-h1") != old
        local_cluster.kill("s0-h1")
        replies, failures = d.lanes.call_each("ping")
        assert set(failures) == {"s0-h1"} and "connection refused" in str(failures["s0-h1"])
        assert set(replies) == set(d.hosts()) - {"s0-h1"}
    finally:
        d.close()


def test_large_requests_go_out_on_threads_and_small_ones_inline(local_cluster):
    def pool_threads() -> int:
        return sum(t.name.startswith("mtc-cluster_") for t in threading.enumerate())

    d = dispatcher(local_cluster)
    try:
        small, big = np.zeros(16, np.uint8), np.zeros(_INLINE_BYTES + 1, np.uint8)
        # "ping" takes no payload: the daemon answers whatever it was sent with.
        assert not d.lanes.call_each("ping", payloads=lambda h: [small])[1]
        assert pool_threads() == 0  # the pool makes its threads when first used
        assert not d.lanes.call_each("ping", payloads=lambda h: [big])[1]
        assert pool_threads() > 0
    finally:
        d.close()
