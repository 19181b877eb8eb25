"""Requests whose numbers or strings no parser should accept, sent by the job's own (authenticated)
head to a real daemon: each is one typed ProtocolError naming the argument, with no traceback in
the daemon's log, nothing created, nothing changed, and the daemon serving as before.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import control_connection
from mtc.shared import protocol
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

STEP_PAST_RANGE = 10**13  # fits in 64 bits, past the 12 digits of a step's name
HUGE = 10**30  # does not fit in 64 bits
NUL_ROOT = "/tmp/mtc-bounds\x00root"
SURROGATE_ROOT = "/tmp/mtc-bounds-\udcff"
BLOB = "0" * 32

ATTACKS = [
    # A step past the parser's range: every operation that takes one.
    ("manifest", {"step": STEP_PAST_RANGE}), ("part", {"step": STEP_PAST_RANGE}),
    ("verify", {"step": STEP_PAST_RANGE}), ("abort", {"step": STEP_PAST_RANGE}),
    ("commit", {"step": STEP_PAST_RANGE}), ("read", {"step": STEP_PAST_RANGE, "reads": []}),
    ("write", {"step": STEP_PAST_RANGE, "part": 0, "shards": []}),
    ("peer_pull", {"step": STEP_PAST_RANGE, "pulls": [], "peers": {}}),
    ("manifest", {"step": HUGE}), ("inventory", {"devices": [HUGE]}),
    # Roots with a NUL, a lone surrogate, or relative to the daemon's working directory.
    ("backup_listing", {"root": NUL_ROOT}), ("backup_listing", {"root": SURROGATE_ROOT}),
    ("backup_listing", {"root": "mtc-bounds-relative/root"}),
    ("backup_manifest", {"root": NUL_ROOT, "name": "x"}), ("backup_manifest", {"root": SURROGATE_ROOT, "name": "x"}),
    ("backup_scrub", {"root": NUL_ROOT}), ("backup_scrub", {"root": SURROGATE_ROOT}),
    ("backup_fetch", {"name": "n\x00", "blobs": [BLOB]}), ("backup_fetch", {"name": "n", "blobs": ["b\udcff"]}),
    ("configure", {"settings": {"backup_url": NUL_ROOT}}), ("configure", {"settings": {"backup_url": "relative"}}),
    ("configure", {"settings": {"backup_url": SURROGATE_ROOT}}),
    # Numbers no parser should take.
    ("claim", {"generation": int("9" * 4000), "head": {"host": "h", "pid": 1}}),
    ("claim", {"generation": 2**63, "head": {"host": "h", "pid": 1}}),
    ("configure", {"gen": HUGE, "settings": {}}), ("backup_listing", {"deadline_s": float("inf")}),
    ("job", {"job": "0" * 32, "wait_s": float("nan")}),
]


def _send(s, op: str, args: dict) -> protocol.Reply:
    """One request as a head would send it, with the JSON as given (``allow_nan``: a head could)."""
    header = json.dumps({"v": protocol.PROTOCOL_VERSION, "kind": "request", "op": op, "id": 7, "args": args,
                         "payloads": []}).encode()
    s.sendall(protocol.MAGIC + len(header).to_bytes(4, "big") + header)
    return protocol.recv_reply(s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(*roots: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for r in roots for p in sorted(r.rglob("*"))
            if p.is_file()}


@pytest.fixture
def cluster(ramdisk):
    with LocalCluster(ramdisk / "cluster", 1, 1, devices_per_host=2) as c:
        yield c


def test_requests_out_of_every_parsers_range_are_one_protocol_error_and_change_nothing(cluster, ramdisk):
    addr = cluster.address("s0-h0")
    cwd = Path(f"/proc/{cluster.pid('s0-h0')}/cwd").resolve()
    before_cwd = set(p.name for p in cwd.iterdir())
    with control_connection(addr, cluster.peer_token) as s:
        lease = _send(s, "lease", {}).result
    before = _files(cluster.ramdisk("s0-h0"))
    for op, args in ATTACKS:
        with control_connection(addr, cluster.peer_token) as s:
            reply = _send(s, op, args)
        assert reply.error is not None and reply.error.type == "ProtocolError", (op, repr(args)[:80], reply)
        assert len(reply.error.message) < 400 and "Traceback" not in reply.error.message, (op, reply.error)
    log = cluster.log_path("s0-h0").read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:3000]
    assert set(p.name for p in cwd.iterdir()) == before_cwd, "a request made a folder under the cwd"
    assert not Path(SURROGATE_ROOT).exists() and not (cwd / "mtc-bounds-relative").exists()
    assert _files(cluster.ramdisk("s0-h0")) == before
    with control_connection(addr, cluster.peer_token) as s:  # the lease is as it was, and the daemon serves
        assert _send(s, "lease", {}).result == lease
        assert _send(s, "ping", {}).result["host"] == "s0-h0"


def test_the_messages_name_the_argument_and_its_bound(cluster):
    for op, args, said in (
            ("verify", {"step": STEP_PAST_RANGE}, "'step' must be an integer in [0, 999999999999]"),
            ("claim", {"generation": HUGE, "head": {}}, "does not fit in 64 bits"),
            ("claim", {"generation": 0, "head": {}}, "'generation' must be the head's generation"),
            ("backup_listing", {"root": "rel/root"}, "is not absolute; give the backup root as an absolute path"),
            ("backup_listing", {"root": SURROGATE_ROOT}, "lone UTF-16 surrogate"),
            ("backup_listing", {"root": NUL_ROOT}, "without NUL"),
            ("backup_listing", {"deadline_s": float("inf")}, "Infinity is not a number of the protocol")):
        with control_connection(cluster.address("s0-h0"), cluster.peer_token) as s:
            reply = _send(s, op, args)
        assert said in reply.error.message, (op, reply.error)


def test_a_listing_of_a_root_that_does_not_exist_creates_nothing(cluster, tmp_path):
    root = tmp_path / "no" / "backups"
    with control_connection(cluster.address("s0-h0"), cluster.peer_token) as s:
        reply = _send(s, "backup_listing", {"root": str(root)})
        assert reply.error is None and reply.result["backups"] == [], reply
        assert _send(s, "backup_manifest", {"root": str(root), "name": "19700101T000000Z-step-000000000001"}).error
    assert not (tmp_path / "no").exists(), "a read-only operation created the backup root"


def test_a_huge_generation_never_breaks_the_metrics(ramdisk, tmp_path):
    port, ready, token = _free_port(), tmp_path / "ready.json", "bounded-inputs-metrics-token-0123"
    proc = subprocess.Popen([sys.executable, "-m", "mtc.sidecar", "serve", "--root", str(ramdisk / "d0"),
                             "--host-id", "s0-h0", "--ready-file", str(ready), "--metrics-port", str(port),
                             "--log-file", str(tmp_path / "d0.log")], env={**os.environ, "MTC_PEER_TOKEN": token})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "d0.log").read_text()
            time.sleep(0.05)
        addr = json.loads(ready.read_text())["address"]
        with control_connection(addr, token) as s:
            assert _send(s, "claim", {"generation": int("9" * 4000), "head": {"host": "h", "pid": 1}}).error
        with control_connection(addr, token) as s:
            assert _send(s, "claim", {"generation": 5, "head": {"host": "h", "pid": 1}}).error is None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and 'mtc_sidecar_lease_generation{host="s0-h0"} 5.0' in r.read().decode()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
