"""Restore plans as values, without processes: a lost slice, a resized mesh, a bad holder."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head.dispatch.box_reads import box_reads, shard_holders
from mtc.head.restore.plan import make_plan, plan_target
from mtc.shared import format as fmt
from mtc.shared import shardings
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.unit

OLD_HOSTS = {"s0-h0": (0, 1), "s0-h1": (2, 3), "s1-h0": (4, 5), "s1-h1": (6, 7)}
BLOCKS = [blob_name(bytes([i]) * 64) for i in range(4)]  # the 4 column blocks of w, one blob each


def _manifest():
    """w (16, 8) float32 saved on a (2 slices, 4) mesh, P(None, "model"): each slice holds every block."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    sh = NamedSharding(Mesh(np.array(devices).reshape(2, 4), ("data", "model")), P(None, "model"))
    shards = []
    for box in sorted(set(shardings.device_boxes(sh, (16, 8)).values())):
        i = box[1][0] // 2
        devs = tuple(d for d, b in shardings.device_boxes(sh, (16, 8)).items() if b == box)
        shards.append(fmt.ShardRecord(box, BLOCKS[i], 16 * 2 * 4, devs))
    rec = fmt.ArrayRecord(key="['w']", kind="jax", dtype="float32", shape=(16, 8), sharding=shardings.describe(sh),
                          shards=tuple(shards))
    return fmt.StepManifest(step=7, arrays=(rec,), tree={"t": "dict", "k": ["w"], "v": [{"t": "leaf", "i": 0}]})


def _host_of(hosts: dict):
    of = {d: h for h, ds in hosts.items() for d in ds}
    return lambda d: of[d]


def _target(n_devices: int, rows: int):
    devices = sorted(jax.devices(), key=lambda d: d.id)[:n_devices]
    mesh = Mesh(np.array(devices).reshape(rows, -1), ("data", "model"))
    return {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P(None, "model")))}


def _old_holders():
    return {BLOCKS[0]: {"s0-h0", "s1-h0"}, BLOCKS[1]: {"s0-h0", "s1-h0"},
            BLOCKS[2]: {"s0-h1", "s1-h1"}, BLOCKS[3]: {"s0-h1", "s1-h1"}}


def test_lost_slice_restores_from_the_live_one_with_nothing_to_pull():
    m = _manifest()
    requests, _ = plan_target(m, _target(4, 1))
    live = {h: d for h, d in OLD_HOSTS.items() if h.startswith("s0")}
    holders = {b: hs & set(live) for b, hs in _old_holders().items()}  # slice 1's hosts are gone
    plan = make_plan(7, m, requests, list(live), _host_of(live), holders)
    assert plan.needs == {"s0-h0": sorted(BLOCKS[:2]), "s0-h1": sorted(BLOCKS[2:])}
    assert plan.lacking == {} and plan.unavailable == []
    assert plan.nbytes(m.blob_sizes()) == (4 * 128, 4)


def test_resized_mesh_every_new_host_pulls_the_blocks_its_shards_overlap():
    m = _manifest()
    requests, _ = plan_target(m, _target(8, 1))  # one slice of 8 devices: 1-column blocks
    new = {f"n{i}": (2 * i, 2 * i + 1) for i in range(4)}
    plan = make_plan(7, m, requests, list(new), _host_of(new), _old_holders())
    assert plan.needs == {f"n{i}": [BLOCKS[i]] for i in range(4)}
    assert plan.lacking == plan.needs  # no new host holds anything yet: all from peers


def test_a_bad_copy_leaves_its_host_lacking_and_an_only_copy_unavailable():
    m = _manifest()
    requests, _ = plan_target(m, _target(4, 1))
    live = {h: d for h, d in OLD_HOSTS.items() if h.startswith("s0")}
    holders = _old_holders()
    holders[BLOCKS[2]] = {"s1-h1"}  # s0-h1's copy failed its hash and was removed
    plan = make_plan(7, m, requests, list(live), _host_of(live), holders)
    assert plan.lacking == {"s0-h1": [BLOCKS[2]]}
    holders[BLOCKS[3]] = set()  # no good copy anywhere: only a backup can give it
    plan = make_plan(7, m, requests, list(live), _host_of(live), holders)
    assert plan.unavailable == [BLOCKS[3]]


# --- the per-box reads the cluster dispatcher runs ----------------------------------------------


def _w():
    return _manifest().arrays[0]


def test_a_box_saved_as_is_is_one_read_from_its_owner_first():
    rec = _w()
    box = ((0, 16), (2, 4))  # block 1, held by s0-h0 and s1-h0
    host_of = _host_of(OLD_HOSTS)
    (read,) = box_reads(rec, box, ["s1-h0"], list(OLD_HOSTS), _old_holders(), host_of)
    assert read.whole and read.region == box and read.key == "['w']"
    assert read.candidates == ("s1-h0", "s0-h0")  # the owner first, then the other holder; nobody else


def test_a_resharded_box_no_host_holds_whole_is_one_read_per_saved_shard():
    rec = _w()
    box = ((0, 16), (2, 6))  # blocks 1 and 2: s0-h0/s1-h0 hold block 1, s0-h1/s1-h1 block 2
    reads = box_reads(rec, box, ["s0-h0"], list(OLD_HOSTS), _old_holders(), _host_of(OLD_HOSTS))
    assert [(r.region, r.candidates) for r in reads] == [
        (((0, 16), (2, 4)), ("s0-h0", "s1-h0")), (((0, 16), (4, 6)), ("s0-h1", "s1-h1"))]
    assert [r.offsets() for r in reads] == [(slice(0, 16), slice(0, 2)), (slice(0, 16), slice(2, 4))]
    assert not any(r.whole for r in reads)


def test_reads_follow_the_holders_after_a_pull_not_the_devices_that_wrote_the_shard():
    m = _manifest()
    rec = m.arrays[0]
    box = ((0, 16), (0, 2))  # block 0, written by devices 0 and 4 (s0-h0, s1-h0)
    live = {"s0-h0": (0, 1), "s0-h1": (2, 3)}  # slice 1 is gone; s0-h0 was replaced and lost its ramdisk
    holders = {BLOCKS[0]: set(), BLOCKS[1]: set(), BLOCKS[2]: {"s0-h1"}, BLOCKS[3]: {"s0-h1"}}
    requests, _ = plan_target(m, _target(4, 1))
    plan = make_plan(7, m, requests, list(live), _host_of(live), holders)
    assert plan.unavailable == sorted(BLOCKS[:2])  # only a backup has them
    after = plan.after_fetch({"s0-h0": BLOCKS[:2]})  # ... which s0-h0 fetched
    assert after.holders[BLOCKS[0]] == {"s0-h0"} and after.lacking == {} and after.unavailable == []
    assert plan.holders[BLOCKS[0]] == frozenset()  # a new value; the old one is unchanged
    gone = lambda d: {0: "s0-h0", 1: "s0-h0", 2: "s0-h1", 3: "s0-h1"}.get(d)  # noqa: E731
    (read,) = box_reads(rec, box, ["s0-h0"], list(live), after.holders, gone)
    assert read.candidates == ("s0-h0",)
    # A holder that is not a device's host (a peer copy) is still a candidate; unknown blobs: everyone.
    (read,) = box_reads(rec, box, ["s0-h0"], list(live), {BLOCKS[0]: {"s0-h1"}}, gone)
    assert read.candidates == ("s0-h1",)
    assert shard_holders(rec.shards[0], None, gone, list(live)) == ["s0-h0"]
    assert shard_holders(rec.shards[0], {}, lambda d: None, list(live)) == list(live)
