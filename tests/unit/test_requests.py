"""The typed requests (``mtc.shared.requests``): what the head builds is what the sidecar decodes,
and a refusal names the argument by its path in the request, its bound and what was sent."""

from __future__ import annotations

import pytest

from mtc.head.dispatch.interface import wire, wire_per_host
from mtc.shared import op_table, requests
from mtc.shared.errors import ProtocolError

pytestmark = pytest.mark.unit

BLOB = "0123456789abcdef0123456789abcdef"
BOOK = {"s0-h0": "127.0.0.1:7001", "s0-h1": "127.0.0.1:7002"}


def test_every_row_names_a_request_type():
    for name, spec in op_table.SPECS.items():
        assert issubclass(spec.request, requests.Request), name
        assert spec.failure in op_table.FAILURES, name
    assert op_table.SPECS["read"].request_type("colocated") is requests.Load


@pytest.mark.parametrize("op,req", [
    ("claim", requests.Claim(generation=7, head={"host": "h", "pid": 1})),
    ("manifest", requests.Manifest(step=3, here_only=True)),
    ("commit", requests.Commit(step=3, digest="d", keepers=[("s0-h0", "127.0.0.1:7001")])),
    ("backup_finalize", requests.BackupFinalize(name="n", step=3, digest="d")),
    ("backup_listing", requests.BackupListing(root="gs://b/p", deadline_s=5.0)),
    ("backup_manifest", requests.BackupManifest(name="n", among=[BLOB])),
    ("backup_scrub", requests.BackupScrub(root="/r", blobs=[BLOB],
                                          damaged={"20260101T000000Z-step-000000000004": "x"})),
    ("backup_fetch", requests.BackupFetch(name="n", blobs=[], parts=["s0-h1"], wants=[
        requests.Wanted(["params.w", "opt.mu.w"], [[requests.Span(0, 8), requests.Span(4, 12)]]),
        requests.Wanted(["rng"])])),
    ("peer_pull", requests.PeerPull(step=3, peers=BOOK, pulls=[requests.Pull(BLOB, 5, ("s0-h1",))],
                                    shares=[requests.Share("s0-h1", ("s0-h0",))],
                                    adopt=requests.Adopt(digest="d", keepers=["s0-h1"]))),
])
def test_what_the_head_sends_is_what_the_sidecar_decodes(op, req):
    assert requests.decode(op, wire(op, req), type(req)) == req


def test_the_head_sends_each_operation_its_own_type():
    with pytest.raises(TypeError, match="requests.Claim"):
        wire("claim", requests.StepRequest(step=1))


def test_requests_for_several_hosts_travel_as_what_they_share_and_each_ones_own():
    shared, own = wire_per_host("peer_pull", {
        "s0-h0": requests.PeerPull(step=3, peers=BOOK, pulls=[requests.Pull(BLOB, 5, ("s0-h1",))]),
        "s0-h1": requests.PeerPull(step=3, peers=BOOK, shares=[requests.Share("s0-h0", ("s0-h0",))])})
    assert shared == {"step": 3, "peers": BOOK}
    assert own == {"s0-h0": {"pulls": [[BLOB, 5, ("s0-h1",)]]}, "s0-h1": {"shares": [["s0-h0", ("s0-h0",)]]}}
    assert wire_per_host("backup_fetch", {"s0-h0": requests.BackupFetch(name="n", blobs=[])}) == (
        {"name": "n"}, {"s0-h0": {"blobs": []}})  # a required field is sent even when empty
    with pytest.raises(ValueError, match="differ"):
        wire_per_host("backup_fetch", {"a": requests.BackupFetch(name="n", blobs=[]),
                                       "b": requests.BackupFetch(name="m", blobs=[])})


@pytest.mark.parametrize("op,args,said", [
    ("write", {"step": 1, "arrays": [{"index": 0, "shape": [4]}, {"index": 1, "shape": [4, -1]}]},
     r"write: arrays\[1\]: 'shape' must be a list of at most 64 sizes .*, got \[4, -1\]"),
    ("write", {"step": 1, "arrays": [{"shape": [4]}]}, r"write: arrays\[0\]: 'index' .*, got nothing"),
    ("peer_pull", {"step": 1, "peers": {}, "pulls": [[BLOB, 1, ["h"]], [BLOB, -1, ["h"]]]},
     r"peer_pull: pulls\[1\] is not \[blob name, size >= 0"),
    ("peer_pull", {"step": 1, "peers": {"s0-h0": "nowhere"}}, r"peer_pull: peers\['s0-h0'\]: address 'nowhere'"),
    ("read", {"step": 1, "reads": [["w", [[3, 2]]]]}, r"read: reads\[0\]\[1\]\[0\]: \[3, 2\] has start > stop"),
    ("backup_upload", {"blobs": [BLOB], "step": 1}, "give 'blobs' or 'step', not both"),
    ("backup_upload", {"blobs": [BLOB], "stand_in": [["s1-h1", "s0-h1"]]}, "'stand_in' goes with 'step'"),
    ("backup_upload", {"step": 1, "stand_in": [["s1-h1"]]},
     r"backup_upload: 'stand_in' must list \[writer, part\] host ids \(and whether it holds pieces only\), got"),
    ("backup_fetch", {"name": "n", "blobs": [], "parts": ["s0-h0"], "wants": [[["w"], [[[4, 2]]]]]},
     r"backup_fetch: wants\[0\]\[1\]\[0\]\[0\]: \[4, 2\] has start > stop"),
    ("backup_fetch", {"name": "n", "blobs": [], "parts": ["s0-h0"], "wants": [[["w"], [[4, 2]]]]},
     r"backup_fetch: wants\[0\]: boxes is not a list of boxes .*, got \[\[4, 2\]\]"),
    ("backup_fetch", {"name": "n", "blobs": [], "wants": [{"keys": ["w"]}]}, r"backup_fetch: wants\[0\] is not \[keys, boxes or null\]"),
    ("backup_manifest", {"name": "n", "among": [BLOB, "x"]}, r"backup_manifest: 'among' must be a list of blob names"),
    ("job", {"job": "j1", "wait_s": 11}, r"'wait_s' must be a number in \[0, 10\], got 11"),
    ("claim", {"head": {}}, "'generation' must be the head's generation.*got nothing"),
])
def test_a_refusal_names_the_argument_by_its_path(op, args, said):
    with pytest.raises(ProtocolError, match=said):
        requests.decode(op, args, op_table.SPECS[op].request)
