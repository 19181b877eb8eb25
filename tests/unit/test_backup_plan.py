"""Backup scheduling and upload assignment as values (no processes)."""

from __future__ import annotations

import pytest

from mtc.head.backup.plan import assign_uploads, backup_due
from mtc.shared import format as fmt
from mtc.shared.config import MTCConfig
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.unit


def test_due_by_steps_and_by_minutes():
    by_steps = MTCConfig(local_checkpoint_directory="/l", local_checkpoint_period=2, base_output_directory="/b",
                         multi_tier_checkpointing_backup_interval_steps=6)
    assert backup_due(by_steps, 2, None, 0.0)  # the first committed step at once
    assert not backup_due(by_steps, 4, (2, 0.0), 0.0) and backup_due(by_steps, 6, (2, 0.0), 0.0)
    assert not backup_due(by_steps, 10, (6, 0.0), 0.0) and backup_due(by_steps, 12, (6, 0.0), 0.0)
    by_minutes = by_steps.replace(multi_tier_checkpointing_backup_interval_steps=None,
                                  multi_tier_checkpointing_backup_interval_minutes=30)
    assert not backup_due(by_minutes, 8, (2, 100.0), 100.0 + 1799) and backup_due(by_minutes, 8, (2, 100.0), 1900.0)
    assert not backup_due(by_steps.replace(multi_tier_checkpointing_backup_interval_steps=None), 2, None, 0.0)


def _manifest(rows):
    """rows: (blob, nbytes, devices) of one array's shards."""
    shards = tuple(fmt.ShardRecord(((i, i + 1),), b, n, d) for i, (b, n, d) in enumerate(rows))
    return fmt.StepManifest(step=1, arrays=(fmt.ArrayRecord("['x']", "jax", "uint8", (len(rows),), None, shards),),
                            tree={})


def test_each_blob_once_by_a_holder_spread_by_bytes():
    a, b, c, d = (blob_name(bytes([i])) for i in range(4))
    host_of = {0: "s0-h0", 1: "s0-h1", 2: "s1-h0", 3: "s1-h1"}.__getitem__
    # a and b are data-parallel twins (held on both slices); c only on s0-h1; d on s1-h1.
    m = _manifest([(a, 100, (0, 2)), (b, 90, (1, 3)), (c, 80, (1,)), (d, 10, (3,)), (a, 100, (0, 2))])
    out = assign_uploads(m, ["s0-h0", "s0-h1", "s1-h0", "s1-h1"], host_of)
    assert sorted(x for bs in out.values() for x in bs) == sorted([a, b, c, d])  # each once
    # Largest first, each to its least loaded holder (ties by name): a -> s0-h0, b -> s0-h1, c -> s0-h1
    # (its only holder), d -> s1-h1.
    assert out == {"s0-h0": [a], "s0-h1": [b, c], "s1-h0": [], "s1-h1": [d]}
    # A lost slice: blobs whose holders are all gone go to a live host (the backup must stay whole).
    out = assign_uploads(m, ["s0-h0", "s0-h1"], host_of)
    assert sorted(x for bs in out.values() for x in bs) == sorted([a, b, c, d])


def test_assign_scrub_gives_each_blob_to_one_host_and_spreads_the_bytes():
    from mtc.head.backup.plan import assign_scrub

    sizes = {f"{i:032x}": (i + 1) * 100 for i in range(10)}
    out = assign_scrub(sizes, ["h0", "h1", "h2"])
    got = [b for bl in out.values() for b in bl]
    assert sorted(got) == sorted(sizes)  # each once
    loads = [sum(sizes[b] for b in bl) for bl in out.values()]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert assign_scrub({}, ["h0"]) == {"h0": []}


def test_assign_parts_gives_each_writer_its_own_part_and_spreads_the_parts_of_writers_gone():
    from mtc.head.backup.plan import assign_parts

    assert assign_parts(["h0", "h1"], ["h0", "h1"]) == {"h0": ["h0"], "h1": ["h1"]}
    # A resized job: h2 and h3 are gone, their parts read by the hosts that remain, one each.
    assert assign_parts(["h0", "h1", "h2", "h3"], ["h1", "h0"]) == {"h0": ["h0", "h2"], "h1": ["h1", "h3"]}
    assert assign_parts(["h0"], ["n0", "n1"]) == {"n0": ["h0"]}  # every host new
    assert assign_parts(["h0"], []) == {}
