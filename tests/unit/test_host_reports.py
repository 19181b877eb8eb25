"""The host reports (mtc.shared.host_reports): what a sidecar answers and the head parses, one
definition of the fields and their checks; a round trip through JSON, and malformed answers."""

from __future__ import annotations

import json

import pytest

from mtc.shared.errors import ProtocolError
from mtc.shared.hashing import blob_name
from mtc.shared.host_reports import HostInventory, PullResult, StepHolding
from mtc.sidecar.service import SidecarService

pytestmark = pytest.mark.unit


def _wire(value) -> dict:
    return json.loads(json.dumps(value.to_wire()))


def test_an_inventory_round_trips_through_json():
    a, b = blob_name(b"a"), blob_name(b"b")
    inv = HostInventory("h1", (
        StepHolding(3, 2, 1, 4, "d" * 64, "c0", manifest="m" * 64, own="o" * 64, copies=("o" * 64, "p" * 64),
                    parts=("s1-h0",), pieces=(("s0-h1", 5, "a0"),)),
        StepHolding(4, 2, 2, 2, "e" * 64, "c0", manifest="n" * 64, part=True, own=a + b)),
        damaged=(2,), pull_failures=((4, "ramdisk full", 2.5),), ramdisk=(10, 100))
    assert HostInventory.from_wire("h1", _wire(inv)) == inv
    bare = HostInventory("h1")
    assert HostInventory.from_wire("h1", _wire(bare)) == bare


def test_a_pull_result_round_trips_through_json():
    res = PullResult("h2", pulled=2, pulled_bytes=10, failed=((blob_name(b"x"), (("h0", "timeout"), ("h1", "gone"))),),
                     bad_copies=((blob_name(b"y"), "h0", "hash"),), removed_bad_copies=((blob_name(b"y"), "h0"),),
                     asked_bytes=30, already=1, adopted=True, seconds=0.25)
    assert PullResult.from_wire("h2", _wire(res)) == res


def test_the_head_note_of_an_unreachable_host_is_never_an_answer():
    with pytest.raises(ValueError, match="host h1"):
        HostInventory.unreachable("h1", "down").to_wire()
    with pytest.raises(ValueError, match="host h1"):
        PullResult.unreachable("h1", "down").to_wire()


def test_a_sidecar_answers_what_the_head_parses(ramdisk):
    import jax

    from mtc.head import CheckpointManager, MTCConfig

    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        m.save(1, {"w": jax.numpy.arange(32, dtype=jax.numpy.float32)})
        m.wait_until_finished()
    svc = SidecarService(ramdisk / "mtc", host_id="h")
    try:
        inv = HostInventory.from_wire("h", json.loads(json.dumps(svc.committed.inventory())))
        (held,) = inv.steps
        assert (held.step, held.blobs, held.local_blobs, held.part) == (1, held.step_blobs, held.step_blobs, False)
        assert inv.error is None and inv.ramdisk is not None and inv.ramdisk[1] > 0
        assert inv.to_wire() == json.loads(json.dumps(svc.committed.inventory()))
    finally:
        svc.close()


@pytest.mark.parametrize("doc, field", [
    ({"steps": [], "surprise": 1}, r"unknown fields \['surprise'\]"),
    ({"host": "h9", "steps": []}, "that of host 'h9'"),
    ({"steps": [], "ramdisk": {"free_bytes": -1, "size_bytes": 1}}, "'ramdisk'"),
    ({"steps": [], "damaged": ["3"]}, "'damaged'"),
    ({"steps": [{"step": 1, "blobs": -1, "local_blobs": 0, "step_blobs": 1, "digest": "", "held": ""}]},
     "step 1: 'blobs' must be an integer >= 0"),
    ({"steps": [{"step": 1, "blobs": 1, "local_blobs": 0, "step_blobs": 1, "digest": "", "held": "", "part": 1}]},
     "step 1: 'part' must be true or false"),
    ({"steps": [{"step": 1, "blobs": 1, "local_blobs": 0, "step_blobs": 1, "digest": "", "held": "", "x": 0}]},
     r"step 1: unknown fields \['x'\]"),
    ({"steps": [{"step": 1, "blobs": 1, "local_blobs": 0, "step_blobs": 1, "digest": "", "held": "", "parts": [3]}]},
     "step 1: 'parts' must list host ids"),
    ({"steps": [{"step": 1, "blobs": 1, "local_blobs": 0, "step_blobs": 1, "digest": "", "held": "",
                 "pieces": [["s0-h1", 5]]}]}, "step 1: 'pieces' must list"),
    ({"steps": [{"step": 1, "blobs": 1, "local_blobs": 0, "step_blobs": 1, "digest": "", "held": "",
                 "pieces": [["s0-h1", 5, "f"]]}]}, "step 1: 'pieces' of writer 's0-h1': bitmap 'f' is not 2"),
])
def test_a_malformed_inventory_names_the_host_and_the_field(doc, field):
    with pytest.raises(ProtocolError, match=f"host h1: .*{field}"):
        HostInventory.from_wire("h1", doc)


@pytest.mark.parametrize("doc, field", [
    ({"pulled": -1}, "'pulled' must be an integer >= 0"),
    ({"asked_bytes": 1.5}, "'asked_bytes' must be an integer >= 0"),
    ({"adopted": "yes"}, "'adopted' must be true or false"),
    ({"seconds": "1"}, "'seconds' must be a number"),
    ({"failed": [["b", [["h0"]]]]}, "'failed' must be a list of"),
    ({"removed_bad_copies": [["b", 1]]}, "'removed_bad_copies' must be a list of"),
    ({"host": "h9"}, "it is that of host 'h9'"),
    ({"pulled": 1, "later": True}, r"unknown fields \['later'\]"),
])
def test_a_malformed_pull_answer_names_the_host_and_the_field(doc, field):
    with pytest.raises(ProtocolError, match=f"host h1: malformed peer pull answer: {field}"):
        PullResult.from_wire("h1", doc)
