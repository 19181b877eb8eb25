"""Which writer's part holds which saved box, from a step's header alone (``mtc.shared.format.writers``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mtc.shared import format as fmt
from mtc.shared import shardings
from mtc.shared.format import writers

pytestmark = pytest.mark.unit


def mesh(shape, names, ids, spec):
    return {"type": "named", "mesh_shape": list(shape), "axis_names": list(names), "device_ids": list(ids),
            "spec": list(spec)}


# 2 slices x 2 hosts x 2 devices; the slices are data-parallel twins (host k of each wrote the same boxes).
DEVICES = {"s0-h0": (0, 1), "s0-h1": (2, 3), "s1-h0": (4, 5), "s1-h1": (6, 7)}
TWINS = mesh((2, 4), ("data", "model"), range(8), ["model"])
SPLIT = mesh((2, 4), ("data", "model"), range(8), [("data", "model")])


def header(*arrays, devices=DEVICES, listed=frozenset()) -> fmt.StepHeader:
    recs = tuple(fmt.ArrayRecord(key=k, kind="jax", dtype="float32", shape=shape, sharding=desc)
                 for k, shape, desc in arrays)
    return fmt.StepHeader(step=1, digest="d", arrays=recs, tree=None, parts=tuple((h, "p") for h in DEVICES),
                          topology={} if devices is None else {"devices": {h: list(d) for h, d in devices.items()}},
                          fingerprint={}, listed=listed)


def requests(h: fmt.StepHeader, target) -> list:
    return [SimpleNamespace(record=r, sharding=target) for r in h.arrays]


def whole(*hosts: str) -> dict[str, tuple[str, ...]]:
    """writer -> the hosts that hold its part whole: each of ``hosts`` its own."""
    return {h: (h,) for h in hosts}


def host_of(d: int) -> str:
    return next(h for h, ids in DEVICES.items() if d in ids)


def test_a_lost_slice_is_covered_by_its_twins_not_where_it_wrote_alone():
    twins, split = header(("w", (64, 8), TWINS)), header(("w", (64, 8), SPLIT))
    left = whole("s0-h0", "s0-h1")
    assert writers.cover(twins, left) and writers.cover(twins, whole(*DEVICES))
    assert not writers.cover(split, left) and writers.cover(split, whole(*DEVICES))
    assert not writers.cover(twins, whole("s0-h0"))  # model chunks 2 and 3: s0-h1 or s1-h1 only
    # Slice 1's parts as peer copies on slice 0: covered, and each reader pulls what it does not keep.
    copies = {**left, "s1-h0": ("s0-h1",), "s1-h1": ("s0-h0",)}
    assert writers.cover(split, copies)


def test_each_reader_reads_its_own_part_on_the_smaller_mesh():
    h = header(("w", (64, 8), TWINS))
    small = mesh((4,), ("model",), range(4), ["model"])
    needs = writers.plan(h, requests(h, small), whole("s0-h0", "s0-h1"), host_of, ["s0-h0", "s0-h1"])
    assert needs == {"s0-h0": set(), "s0-h1": set()}


def test_a_lost_writers_part_is_read_from_its_copy_or_pulled():
    """FSDP over both slices, slice 1 gone: its rows are in peer copies on slice 0 (s0-h0 keeps s1-h1's,
    s0-h1 keeps s1-h0's). On the smaller mesh each reader needs half of slice 1's rows."""
    h = header(("w", (64, 8), SPLIT))
    small = mesh((4,), ("x",), range(4), ["x"])  # 16 rows per device: devices 0-1 on s0-h0, 2-3 on s0-h1
    copies = {"s0-h0": ("s0-h0",), "s0-h1": ("s0-h1",), "s1-h0": ("s0-h1",), "s1-h1": ("s0-h0",)}
    needs = writers.plan(h, requests(h, small), copies, host_of, ["s0-h0", "s0-h1"])
    # s0-h0 reads rows 0-32: saved devices 0-3 (s0-h0, s0-h1); s0-h1 rows 32-64: devices 4-7 (slice 1).
    assert needs == {"s0-h0": {"s0-h1"}, "s0-h1": {"s1-h1"}}


def test_a_resharded_target_names_the_parts_each_reader_needs():
    """Target rows split over the reversed devices: every box's saved chunks, by arithmetic, checked
    against a brute-force overlap of the two box sets."""
    h = header(("w", (64, 8), SPLIT))
    target = mesh((8,), ("x",), range(7, -1, -1), [None, "x"])  # columns, reversed
    needs = writers.plan(h, requests(h, target), whole(*DEVICES), host_of, sorted(DEVICES))
    saved = shardings.described_device_boxes(SPLIT, (64, 8))
    want = {r: set() for r in DEVICES}
    for dev, box in shardings.described_device_boxes(target, (64, 8)).items():
        reader = host_of(dev)
        for sdev, sbox in saved.items():
            if fmt.box_intersect(box, sbox) is not None and host_of(sdev) != reader:
                want[reader].add(host_of(sdev))
    assert needs == want and all(needs.values())


def test_a_reader_that_lost_its_part_reads_its_twins():
    h = header(("w", (64, 8), TWINS))
    needs = writers.plan(h, requests(h, TWINS), whole("s0-h0", "s1-h0", "s1-h1"), host_of, sorted(DEVICES))
    assert needs == {"s0-h0": set(), "s0-h1": {"s1-h1"}, "s1-h0": set(), "s1-h1": set()}


@pytest.mark.parametrize("case", ["no devices", "listed boxes", "uncovered"])
def test_where_the_header_cannot_say_the_rows_decide(case):
    kw = {"devices": None} if case == "no devices" else {"listed": frozenset({"w"})} if case == "listed boxes" else {}
    h = header(("w", (64, 8), SPLIT if case == "uncovered" else TWINS), **kw)
    held = whole("s0-h0", "s0-h1") if case == "uncovered" else whole(*DEVICES)
    assert writers.plan(h, requests(h, TWINS), held, host_of, sorted(DEVICES)) is None
    assert not writers.cover(h, held)


def test_the_grid_is_the_described_boxes():
    g = writers.saved_grid(SPLIT, (64, 8))
    boxes = shardings.described_device_boxes(SPLIT, (64, 8))
    for piece, devs in g.writers.items():
        for d in devs:
            assert boxes[d] == tuple((i * c, (i + 1) * c) for i, c in zip(piece, g.chunk))
    assert sorted(d for ds in g.writers.values() for d in ds) == list(np.arange(8))


def test_what_each_host_loads_is_its_devices_boxes_by_target_and_the_host_leaves_whole():
    h = header(("w", (64, 8), SPLIT), ("v", (64, 8), SPLIT), ("u", (16,), mesh((8,), ("x",), range(8), ["x"])))
    numpy = SimpleNamespace(record=fmt.ArrayRecord(key="rng", kind="numpy", dtype="uint32", shape=(4,)), sharding=None)
    scalar = SimpleNamespace(record=fmt.ArrayRecord(key="step", kind="scalar", value=3), sharding=None)
    target = mesh((8,), ("x",), range(7, -1, -1), [None, "x"])  # columns, reversed
    reqs = [SimpleNamespace(record=h.arrays[0], sharding=target), SimpleNamespace(record=h.arrays[1], sharding=target),
            SimpleNamespace(record=h.arrays[2], sharding=h.arrays[2].sharding), numpy, scalar]
    loads = writers.loads(reqs, host_of, sorted(DEVICES))
    cols = shardings.described_device_boxes(target, (64, 8))
    rows = shardings.described_device_boxes(h.arrays[2].sharding, (16,))
    for host, devs in DEVICES.items():  # one group per (target, shape): its keys once, the host's boxes
        assert loads[host] == [(["w", "v"], sorted(cols[d] for d in devs)), (["u"], sorted(rows[d] for d in devs)),
                               (["rng"], None)], host
    assert writers.loads(reqs, lambda d: None if d == 7 else host_of(d), sorted(DEVICES)) is None


def test_the_blobs_a_host_loads_are_those_whose_boxes_overlap_its_own():
    shards = tuple(fmt.ShardRecord(box=((r, r + 16), (0, 8)), blob=f"{i:032x}", nbytes=16 * 8 * 4)
                   for i, r in enumerate(range(0, 64, 16)))
    w = fmt.ArrayRecord(key="w", kind="jax", dtype="float32", shape=(64, 8), shards=shards)
    e = fmt.ArrayRecord(key="e", kind="jax", dtype="float32", shape=(0, 8),
                        shards=(fmt.ShardRecord(box=((0, 0), (0, 8)), blob="e" * 32, nbytes=0),))
    rng = fmt.ArrayRecord(key="rng", kind="numpy", dtype="uint32", shape=(4,),
                          shards=(fmt.ShardRecord(box=((0, 4),), blob="f" * 32, nbytes=16),))
    m = fmt.StepManifest(step=1, arrays=(w, e, rng), tree=None)
    assert m.blob_sizes_for({"w": [((10, 20), (0, 8))]}) == {shards[0].blob: 512, shards[1].blob: 512}
    assert m.blob_sizes_for({"w": [((16, 32), (4, 8))]}) == {shards[1].blob: 512}  # edges touch: no overlap
    assert m.blob_sizes_for({"w": [((0, 64), (8, 8))]}) == {}
    assert m.blob_sizes_for({"w": None, "rng": None}) == {**{s.blob: 512 for s in shards}, "f" * 32: 16}
    assert m.blob_sizes_for({"e": [((0, 0), (0, 4))]}) == {"e" * 32: 0}  # nothing to overlap: all of it
    assert m.blob_sizes_for({}) == {} and m.blob_sizes_for({"x": None}) == {}


def test_a_steps_copies_count_each_box_where_its_twins_and_the_peer_copies_are():
    """``copies``: the fewest slices on which some saved box is in a part held whole. Twins: a box is on
    both slices while both hold their parts, on one once a slice's host lost its part; FSDP over both
    slices: a box of a lost writer counts its peer copy only; None where the header cannot say."""
    def slice_of(h):
        return int(h[1])

    twins, split = header(("w", (64, 8), TWINS)), header(("w", (64, 8), SPLIT))
    assert writers.copies(twins, whole(*DEVICES), slice_of) == 2
    assert writers.copies(twins, whole("s0-h0", "s0-h1", "s1-h0"), slice_of) == 1  # s1-h1's boxes: s0-h1's twin
    assert writers.copies(split, whole(*DEVICES), slice_of) == 1
    assert writers.copies(split, {**whole(*DEVICES), "s1-h0": ("s1-h0", "s0-h1")}, slice_of) == 1  # others: one
    copies = {w: (w, f"s{1 - int(w[1])}-h{w[-1]}") for w in DEVICES}  # each part copied to the other slice
    assert writers.copies(split, copies, slice_of) == 2
    assert writers.copies(split, {**copies, "s1-h0": ("s0-h0",)}, slice_of) == 1  # s1-h0 gone, its copy left
    assert writers.copies(split, {**copies, "s1-h0": ()}, slice_of) == 0
    assert writers.copies(header(("w", (64, 8), SPLIT), devices=None), copies, slice_of) is None


def test_a_part_held_in_pieces_is_pulled_by_its_readers_and_counts_its_fewest_domains():
    """FSDP over both slices, s1-h0 gone: no host holds its part whole, s0-h0 and s0-h1 hold a piece each
    (``StepView.pieces``). Its boxes count as held (``cover``), but neither holder reads them from its own
    ramdisk: the reader of s1-h0's boxes pulls the part, and a holder of a piece is no holder of it."""
    split = header(("w", (64, 8), SPLIT))
    left = whole("s0-h0", "s0-h1", "s1-h1")
    pieces = {"s1-h0": {"s0-h0": [True, False, True], "s0-h1": [False, True, True]}}
    assert not writers.cover(split, left) and writers.cover(split, {**left, **pieces})
    # The saving mesh, with a new node in s1-h0's place: it pulls its own part from the pieces.
    needs = writers.plan(split, requests(split, SPLIT), {**left, **pieces}, host_of, sorted(DEVICES),
                         pieced=pieces)
    assert needs == {"s0-h0": set(), "s0-h1": set(), "s1-h0": {"s1-h0"}, "s1-h1": set()}
    # A smaller mesh on slice 0: s0-h1 reads rows 32-64 (devices 4-7): it holds a piece of s1-h0's part, not
    # the part, so it pulls it (and s1-h1's, which s1-h1 holds).
    small = mesh((4,), ("x",), range(4), ["x"])
    needs = writers.plan(split, requests(split, small), {**left, **pieces}, host_of, ["s0-h0", "s0-h1"],
                         pieced=pieces)
    assert needs == {"s0-h0": {"s0-h1"}, "s0-h1": {"s1-h0", "s1-h1"}}, needs

    def slice_of(h):
        return int(h[1])

    # Every other part on both slices; s1-h0's blobs: the third on both, the first two on slice 0 only.
    two = {"s0-h0": ("s0-h0", "s1-h1"), "s0-h1": ("s0-h1", "s1-h1"), "s1-h1": ("s1-h1", "s0-h0")}
    assert writers.copies(split, two, slice_of) == 0  # without the pieces: s1-h0's boxes nowhere
    assert writers.copies(split, two, slice_of, {"s1-h0": {**pieces["s1-h0"], "s1-h1": [False, False, True]}}) == 1
    assert writers.copies(split, two, slice_of, {"s1-h0": {"s0-h0": [True, True, True], "s1-h1": [True] * 3}}) == 2


def test_twins_are_the_writers_of_exactly_the_same_boxes():
    twins = writers.twins(header(("w", (64, 8), TWINS), ("v", (8,), TWINS)))
    assert twins == {"s0-h0": ("s1-h0",), "s1-h0": ("s0-h0",), "s0-h1": ("s1-h1",), "s1-h1": ("s0-h1",)}
    # One array split over both slices: no writer wrote another's boxes.
    assert writers.twins(header(("w", (64, 8), TWINS), ("e", (64, 8), SPLIT))) == {h: () for h in DEVICES}
    assert writers.twins(header(("w", (64, 8), TWINS), devices=None)) is None
    assert writers.twins(header(("w", (64, 8), TWINS), listed=frozenset({"w"}))) is None
