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
