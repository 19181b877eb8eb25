"""Both transports are thin: each operation calls one sidecar service method, the same one."""

from __future__ import annotations

import inspect

import pytest

from mtc.shared import protocol
from mtc.sidecar import colocated, daemon
from mtc.sidecar.service import MUTATING_OPS, SidecarService

pytestmark = pytest.mark.unit

# The same service method, reached under another operation name by each transport.
SAME = {"load": "read"}


def _source(fn) -> str:
    return inspect.getsource(fn) if fn is not None else ""


def test_each_daemon_op_calls_its_service_method():
    assert set(daemon.SERVICE_METHODS) == set(daemon._HANDLERS) == protocol.OPS
    for op, method in daemon.SERVICE_METHODS.items():
        if method is None:
            continue
        assert callable(getattr(SidecarService, method, None)), (op, method)
        assert f".{method}(" in _source(daemon._HANDLERS[op]), f"daemon op {op} does not call {method}"


def test_each_colocated_op_calls_its_service_method():
    data_ops = {"write": colocated.ColocatedSidecar.write, "load": colocated.ColocatedSidecar.load}
    assert set(colocated.SERVICE_METHODS) == set(colocated._OPS) | set(data_ops)
    for op, method in colocated.SERVICE_METHODS.items():
        assert callable(getattr(SidecarService, method, None)), (op, method)
        fn = data_ops.get(op) or colocated._OPS[op] or colocated.ColocatedSidecar._dispatch
        src = _source(fn)  # called, or run as a job the head polls (start_job(svc.method, ...))
        assert f".{method}(" in src or f"start_job(svc.{method}," in src, f"colocated op {op} does not call {method}"


def test_both_transports_map_shared_operations_to_the_same_methods():
    for op, method in colocated.SERVICE_METHODS.items():
        other = daemon.SERVICE_METHODS.get(SAME.get(op, op))
        if other is not None:
            assert other == method, f"{op}: colocated calls {method}, the daemon {other}"
    # Every changing operation exists in both, so fencing guards the same set everywhere.
    assert MUTATING_OPS <= set(daemon.SERVICE_METHODS) and MUTATING_OPS <= set(colocated.SERVICE_METHODS)
    assert {"abort", "claim", "lease"} <= set(colocated.SERVICE_METHODS)
