"""Both transports are thin: one table of operations (``mtc.sidecar.ops``), served the same way.

Every operation of the table is driven through both transports, the colocated wrapper and a real
daemon on a real socket, with the same bad arguments, and must fail with the same error type;
with good arguments they call the same service method and answer the same result.
"""

from __future__ import annotations

import os
import socket

import pytest

from helpers import control_connection
from mtc.shared import colocated_codec, protocol
from mtc.sidecar import ops
from mtc.sidecar.colocated import ColocatedSidecar
from mtc.sidecar.daemon import SidecarDaemon
from mtc.sidecar.service import SidecarService

pytestmark = pytest.mark.unit

TOKEN = "transports-test-token-0123456789"

# Arguments each operation must refuse (ProtocolError), in both transports.
BAD = {
    "ping": None,  # takes no arguments: nothing to get wrong
    "fingerprint": None,
    "lease": None,
    "close": None,
    "inventory": {"devices": "all"},
    "manifest": {"step": "latest"},
    "part": {"step": -1},
    "commit": {"step": 1, "keepers": "h1"},
    "abort": {"step": 1.5},
    "verify": {"step": None},
    "claim": {"generation": 3, "head": "me"},
    "configure": {"settings": {"local_max_to_keep": 0}},
    "job": {"job": "../etc"},
    "backup_upload": {"blobs": "b1"},
    "backup_finalize": {"name": 7},
    "backup_listing": {"deadline_s": -1},
    "backup_manifest": {"root": "/r", "name": None},
    "backup_fetch": {"name": "x", "blobs": [1]},
    "peer_pull": {"step": 1, "pulls": [["not-a-blob", 1, ["h"]]], "peers": {}},
    "backup_scrub": {"root": "/r", "blobs": ["b1"], "bytes_per_s": 0},
}
BAD_DATA = {"write": {"step": "one", "part": 0, "shards": []}, "read": {"step": 1, "reads": "all"}}


def test_the_table_names_a_service_method_for_every_operation(tmp_path):
    svc = SidecarService(tmp_path / "r", host_id="h0")
    try:
        for name, method in ops.SERVICE_METHODS.items():
            assert callable(ops.method_of(svc, name)), (name, method)
    finally:
        svc.close()
    assert set(BAD) | set(BAD_DATA) == set(ops.OPS), "every operation of the table has a bad-argument case here"
    assert set(BAD_DATA) == ops.DATA_OPS == {name for name, op in ops.OPS.items() if op.spec.data}
    assert ops.LONG_OPS == {"backup_upload", "backup_fetch", "peer_pull", "backup_scrub"}
    assert {"write", "commit", "abort", "configure", "peer_pull", "backup_finalize"} <= ops.MUTATING_OPS
    for name, op in ops.OPS.items():
        spec = op.spec
        assert set(spec.modes) == {"colocated", "cluster"} or spec.why, f"{name} is in one mode without saying why"


@pytest.fixture
def both(tmp_path, monkeypatch):
    """The same kind of host behind each transport: (colocated serve, daemon serve)."""
    monkeypatch.setenv("MTC_PEER_TOKEN", TOKEN)
    col = ColocatedSidecar(f'{{"ramdisk_root": "{tmp_path / "col"}", "host_id": "h0"}}')
    svc = SidecarService(tmp_path / "dmn", host_id="h0", awaits_head=True)
    daemon = SidecarDaemon(svc, TOKEN)
    daemon.start()
    conn = control_connection(daemon.address, TOKEN)
    ids = iter(range(10, 10**6))

    def colocated(op: str, args: dict):
        result, payloads, error = colocated_codec.decode_reply(
            colocated_codec.encode_reply(lambda: col._dispatch({"op": op, **args}), host="h0"))
        return (result, payloads) if error is None else error

    def cluster(op: str, args: dict):
        protocol.send_request(conn, protocol.Request(op, next(ids), args))
        reply = protocol.recv_reply(conn)
        return (reply.result, [bytes(p) for p in reply.payloads]) if reply.error is None else (
            reply.error.type, reply.error.message)

    yield colocated, cluster
    conn.close()
    daemon.close()
    col._dispatch({"op": "close"})


def test_every_operation_refuses_the_same_bad_arguments_with_the_same_error_in_both_transports(both):
    colocated, cluster = both
    for name, args in {**BAD, **BAD_DATA}.items():
        if args is None:
            continue
        modes = ops.OPS[name].spec.modes if name in ops.OPS else ("colocated", "cluster")
        got = {}
        if "cluster" in modes:
            got["cluster"] = cluster(name, args)
        if "colocated" in modes and name not in BAD_DATA:  # colocated data ops take arrays (below)
            got["colocated"] = colocated(name, args)
        for mode, answer in got.items():
            assert isinstance(answer, tuple) and answer[0] == "ProtocolError", (name, mode, answer)
    # Arguments for some hosts only, malformed (colocated mode sends one request to every host).
    assert colocated("abort", {"step": 1, "per_host": ["h0"]})[0] == "ProtocolError"
    assert colocated("abort", {"step": 1, "per_host": {"h0": 3}})[0] == "ProtocolError"
    # An operation that is not in the table, and one that is not served in a mode.
    assert colocated("format_disk", {})[0] == cluster("format_disk", {})[0] == "ProtocolError"
    assert cluster("close", {})[0] == "ProtocolError"


def test_the_colocated_data_operations_check_their_headers_as_the_daemon_does(tmp_path):
    from mtc.shared.errors import ProtocolError

    with pytest.raises(ProtocolError, match="'step' must be an integer"):
        ops.parse_write(BAD_DATA["write"], 0, "cluster")
    with pytest.raises(ProtocolError, match="'reads' must be a list"):
        ops.parse_read(BAD_DATA["read"])


@pytest.mark.parametrize("args,match", [
    ({"step": "one", "arrays": []}, "'step' must be an integer"),
    ({"step": 1, "arrays": "all"}, "'arrays' must be a list"),
    ({"step": 1, "shardings": [{}], "arrays": [{"key": 3}]}, r"arrays\[0\] is not an object with a 'key'"),
    ({"step": 1, "shardings": [{}], "arrays": [{"key": "a", "shape": [-1], "dtype": "float32", "sharding": 0}]}, "'shape'"),
    ({"step": 1, "shardings": [{}], "arrays": [{"key": "a", "shape": [2], "dtype": "no-such-type", "sharding": 0}]}, "no-such-type"),
    ({"step": 1, "shardings": [{}], "arrays": [{"key": "a", "shape": [2], "dtype": "float32", "sharding": "all"}]}, "'sharding'"),
    ({"step": 1, "shardings": [{}], "arrays": [{"key": "a", "shape": [2], "dtype": "float32", "sharding": 1}]},
     "index into 'shardings'"),
    ({"step": 1, "arrays": [{"key": "a", "shape": [2], "dtype": "float32", "sharding": 0}]}, "'shardings' must be a list"),
    ({"step": 1, "shardings": [{}], "arrays": [{"key": "a", "shape": [2], "dtype": "float32", "sharding": 0, "as_bytes": 1}]},
     "'as_bytes'"),
    ({"step": 1, "shardings": [], "arrays": [], "manifest": 5}, "'manifest'"),
    ({"step": 1, "shardings": [], "arrays": [], "keepers": {"s0-h0": 7001}}, "'keepers'"),
])
def test_the_colocated_load_checks_its_header_with_the_table(tmp_path, args, match):
    """The colocated ``load`` (the ``read`` of colocated mode), driven as the head drives it: a request
    array on a device, decoded and checked by the table's ``parse_load`` before anything is read."""
    import jax
    import numpy as np

    from mtc.shared.colocated_codec import encode_request
    from mtc.shared.errors import ProtocolError

    col = ColocatedSidecar(f'{{"ramdisk_root": "{tmp_path / "col"}", "host_id": "h0"}}')
    try:
        request = jax.device_put(np.ascontiguousarray(encode_request(args)[None, :]), jax.devices()[0])
        with pytest.raises(ProtocolError, match=match):
            col.load(request)
    finally:
        col._dispatch({"op": "close"})


def test_a_mesh_over_consecutive_devices_travels_as_runs():
    from mtc.shared import shardings
    from mtc.shared.errors import ManifestError

    desc = {"type": "named", "mesh_shape": [2, 8], "axis_names": ["d", "f"], "device_ids": list(range(16)), "spec": ["f"]}
    packed = shardings.pack(desc)
    assert packed["device_runs"] == [[0, 16]] and "device_ids" not in packed
    assert shardings.unpack(packed, "x") == desc
    odd = {**desc, "device_ids": [0, 5, 2, 7, 1, 9, 3, 11, 4, 13, 6, 15, 8, 10, 12, 14]}
    assert shardings.pack(odd) == odd  # runs would not be shorter: sent as they are
    with pytest.raises(ManifestError, match="device_runs"):
        shardings.unpack({**packed, "device_runs": [[0, -1]]}, "x")
    with pytest.raises(ManifestError, match="at most"):
        shardings.unpack({**packed, "device_runs": [[0, 1 << 30]]}, "x")


def test_good_requests_answer_the_same_in_both_transports(both):
    colocated, cluster = both
    # Unconfigured sidecars refuse what needs the head's settings, with one type.
    assert colocated("commit", {"step": 1})[0] == cluster("commit", {"step": 1})[0] == "NotConfiguredError"
    settings = {"local_max_to_keep": 3, "backup_url": None, "backup_max_to_keep": 2,
                "backup_scrub_bytes_per_s": 2**20}
    for serve in both:
        assert serve("claim", {"generation": 5, "head": {"host": "t", "pid": 1}})[0]["generation"] == 5
        assert serve("configure", {"settings": settings, "gen": 5})[0]["settings"] == settings
        assert serve("configure", {"settings": settings, "gen": 4})[0] == "FencedError"
    for op, args in (("lease", {}), ("inventory", {"devices": [0, 1]}), ("abort", {"step": 3, "gen": 5})):
        a, b = colocated(op, args), cluster(op, args)
        if op == "inventory":  # each its own ramdisk's room, which other writers on the disk change
            assert set(a[0].pop("ramdisk")) == set(b[0].pop("ramdisk")) == {"free_bytes", "size_bytes"}
        assert a == b, (op, a, b)
    assert colocated("ping", {})[0]["host"] == cluster("ping", {})[0]["host"] == "h0"
    # No backup root: the same ConfigError from both, typed.
    assert colocated("backup_listing", {"root": None})[0] == cluster("backup_listing", {"root": None})[0] == "ConfigError"
    # A step nobody wrote: the same StepNotFoundError from both.
    assert colocated("manifest", {"step": 9})[0] == cluster("manifest", {"step": 9})[0] == "StepNotFoundError"


def test_arguments_past_their_bounds_are_refused_the_same_in_both_transports(both, tmp_path):
    """Numbers and strings past what a parser accepts (``ops``: steps of 12 digits, device ids of 31
    bits, absolute roots without NUL): one ProtocolError from either transport, nothing created."""
    for op, args in (("verify", {"step": 10**12}), ("abort", {"step": 10**13}), ("inventory", {"devices": [2**40]}),
                     ("claim", {"generation": 5, "head": {"pad": "x" * 5000}}),
                     ("backup_listing", {"root": "relative/root"}), ("backup_listing", {"root": "/a\x00b"}),
                     ("backup_manifest", {"root": "/r", "name": "n" * 300}),
                     ("configure", {"settings": {"backup_url": "relative"}}),
                     ("backup_listing", {"deadline_s": 10**9}),
                     ("peer_pull", {"step": 1, "pulls": [], "peers": {}, "adopt": {"digest": "d" * 200, "keepers": []}}),
                     ("peer_pull", {"step": 1, "pulls": [], "peers": {}, "adopt": {"digest": "d", "keepers": "h0"}})):
        for serve in both:
            answer = serve(op, args)
            assert answer[0] == "ProtocolError", (op, args, answer)
    # Where a record host finds the keepers now: at most 64 of them, host id -> address, both text.
    _, cluster = both
    for keepers in ({"s0-h0": 7001}, {f"h{i}": "127.0.0.1:1" for i in range(65)}, ["s0-h0"]):
        answer = cluster("read", {"step": 1, "reads": [], "keepers": keepers})
        assert answer[0] == "ProtocolError" and "'keepers'" in answer[1], (keepers, answer)
    assert not (tmp_path / "relative").exists() and not os.path.exists("relative")


def test_every_operation_of_the_table_has_a_row_in_the_architecture():
    """docs/architecture.md lists the operations; a new one in the table needs its row there."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    rows = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    missing = [name for name in [*ops.OPS, *ops.DATA_OPS] if name not in rows]
    assert not missing, f"operations without a row in docs/architecture.md: {missing}"
    for name, op in ops.OPS.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        spec = op.spec
        assert (cells[2] == "yes") == spec.mutating and (cells[3] == "yes") == spec.long, (name, cells)
        assert cells[1].startswith("(data") == spec.data and cells[4:6] == [spec.lane, spec.timeout], (name, cells)


def test_the_cluster_head_takes_each_operations_lane_and_timeout_from_the_table():
    """``lane_of`` and ``Timeouts.for_op`` read the rows of ``mtc.shared.op_table``, which
    ``ops.OPS`` is built on; an operation outside the table is a control one."""
    from mtc.head.dispatch.cluster.client import Timeouts
    from mtc.head.dispatch.cluster.lanes import LANES, lane_of
    from mtc.shared import op_table

    assert set(op_table.SPECS) == set(ops.OPS) and set(LANES) == {op.spec.lane for op in ops.OPS.values()}
    timeouts = Timeouts(data_s=1.0, control_s=2.0, connect_s=3.0, backup_s=4.0, peer_s=5.0)
    seconds = {"data": 1.0, "control": 2.0, "backup": 4.0, "peer": 5.0}
    for name, op in ops.OPS.items():
        assert op.spec is op_table.SPECS[name]
        assert lane_of(name) == op.spec.lane and timeouts.for_op(name) == seconds[op.spec.timeout], name
    assert {n for n, op in ops.OPS.items() if op.spec.timeout == "data"} == {"write", "commit", "read"}
    assert ({n for n, op in ops.OPS.items() if op.spec.lane == "backup"}
            == {n for n in ops.OPS if n.startswith("backup_")})
    assert {n for n, op in ops.OPS.items() if op.spec.lane == "peer"} == {"peer_pull"}
    assert lane_of("no_such_op") == "control" and timeouts.for_op("no_such_op") == 2.0
