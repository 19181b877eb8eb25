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
        src = _source(daemon._HANDLERS[op])
        assert f".{method}(" in src or f"start_job({_svc(src)}.{method}," in src, f"daemon op {op} does not call {method}"


def _svc(src: str) -> str:
    return "self.service" if "self.service.start_job(" in src else "svc"


def test_each_colocated_op_calls_its_service_method():
    data_ops = {"write": colocated.ColocatedSidecar.write, "load": colocated.ColocatedSidecar.load}
    assert set(colocated.SERVICE_METHODS) == set(colocated._OPS) | set(data_ops)
    for op, method in colocated.SERVICE_METHODS.items():
        assert callable(getattr(SidecarService, method, None)), (op, method)
        fn = data_ops.get(op) or colocated._OPS[op] or colocated.ColocatedSidecar._dispatch
        src = _source(fn)  # called, or run as a job the head polls (start_job(svc.method, ...))
        assert f".{method}(" in src or f"start_job(svc.{method}," in src, f"colocated op {op} does not call {method}"


LONG_OPS = {"backup_upload", "backup_fetch", "peer_pull"}


def test_long_operations_are_jobs_in_both_transports():
    """One job model: a long operation answers with a job id at once, and ``job`` reports its end."""
    for op in LONG_OPS:
        assert "start_job(" in _source(daemon._HANDLERS[op]), f"daemon op {op} is not run as a job"
        assert "start_job(" in _source(colocated._OPS[op]), f"colocated op {op} is not run as a job"
    assert daemon.SERVICE_METHODS["job"] == colocated.SERVICE_METHODS["job"] == "job"


def test_both_transports_map_shared_operations_to_the_same_methods():
    for op, method in colocated.SERVICE_METHODS.items():
        other = daemon.SERVICE_METHODS.get(SAME.get(op, op))
        if other is not None:
            assert other == method, f"{op}: colocated calls {method}, the daemon {other}"
    # Every changing operation exists in both, so fencing guards the same set everywhere.
    assert MUTATING_OPS <= set(daemon.SERVICE_METHODS) and MUTATING_OPS <= set(colocated.SERVICE_METHODS)
    assert {"abort", "claim", "lease"} <= set(colocated.SERVICE_METHODS)
