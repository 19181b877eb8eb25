"""Restores that map blobs (zero copy) and saves that recycle blob files, end to end.

A restored array maps its blob's file; later saves collect that file and write blobs of the
same size: the restored array must never change, and restores stay bit for bit.
"""

from __future__ import annotations

import errno
import gc

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import as_bytes, assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.sidecar import ram, reads
from test_save_restore import abstract, make_state, mesh1d

pytestmark = pytest.mark.unit

MiB = 1 << 20


def manager(dirpath, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(dirpath), enable_multi_tier_checkpointing=True,
                                       local_checkpoint_period=1, **kw))


def big_state(seed: int) -> dict:
    """Shards of 1 MiB and more, so restores map them."""
    rng = np.random.default_rng(seed)
    rows = NamedSharding(mesh1d(), P("x"))
    grid = NamedSharding(Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")), P("a", "b"))
    return {
        "w": jax.device_put(rng.random((2048, 1024), dtype=np.float32), rows),       # 8 x 1 MiB
        "g": jax.device_put(rng.integers(0, 2**31, (2048, 1024), dtype=np.int32), grid),  # 8 x 1 MiB
        "r": jax.device_put(rng.random((512, 1024), dtype=np.float32), NamedSharding(mesh1d(), P())),  # replicated
    }


def snapshot(tree) -> dict:
    return {k: as_bytes(v) for k, v in tree.items()}


def test_restored_arrays_never_change_after_later_saves(ramdisk):
    saved = big_state(1)
    expect = snapshot(saved)
    mapped_before = ram.in_use()
    with manager(ramdisk, local_max_to_keep=1) as m:
        m.save(1, saved)
        m.wait_until_finished()
        out = m.restore(1, target=abstract(saved))
        assert ram.in_use() - mapped_before, "the restore did not map its blobs: this test checks nothing"
        assert snapshot(out) == expect
        for step in range(2, 6):  # step 1 is collected; the new blobs have its sizes
            m.save(step, big_state(step))
            m.wait_until_finished()
            assert snapshot(out) == expect, f"restored arrays changed after saving step {step}"
        assert m.last_save_report.bytes_written > 0
    # Another manager (another store object on the same ramdisk) saving more: still unchanged.
    with manager(ramdisk, local_max_to_keep=1) as m2:
        for step in range(6, 9):
            m2.save(step, big_state(step))
            m2.wait_until_finished()
        assert snapshot(out) == expect
        assert_trees_bitwise_equal(big_state(8), m2.restore(8, target=abstract(saved)))
    del out
    gc.collect()
    assert ram.in_use() <= mapped_before  # unmapped with the last array


def test_restored_arrays_can_be_donated_and_changed(ramdisk):
    saved = big_state(2)
    with manager(ramdisk, local_max_to_keep=1) as m:
        m.save(1, saved)
        m.wait_until_finished()
        out = m.restore(1, target=abstract(saved))
        step = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
        new = step(out)
        jax.block_until_ready(new)
        assert np.array_equal(np.asarray(new["w"]), np.asarray(saved["w"]) + 1)
        # The blobs are untouched: the step restores bit for bit again.
        assert_trees_bitwise_equal(saved, m.restore(1, target=abstract(saved)))


def test_every_kind_of_leaf_round_trips_through_mappings(ramdisk, monkeypatch):
    monkeypatch.setattr(reads, "_MAP_MIN", 1)  # map every shard, however small
    state = make_state(3)
    with manager(ramdisk) as m:
        m.save(1, state)
        m.wait_until_finished()
        assert_trees_bitwise_equal(state, m.restore(1, target=abstract(state)))
        # Another sharding: target boxes are cut out of mapped shards.
        m1 = mesh1d()
        other = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
                m1, P() if x.ndim == 0 else P(*([None] * (x.ndim - 1)), "x" if x.shape[-1] % 8 == 0 else None)))
            if isinstance(x, jax.Array) else x, state)
        out = m.restore(1, target=other)
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                 jax.tree_util.tree_flatten_with_path(out)[0]):
        assert as_bytes(a) == as_bytes(b), jax.tree_util.keystr(path)


def test_resharded_restore_of_big_shards(ramdisk):
    saved = big_state(4)
    cols = NamedSharding(mesh1d(), P(None, "x"))
    with manager(ramdisk) as m:
        m.save(1, saved)
        m.wait_until_finished()
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=cols) for k, v in saved.items()}
        out = m.restore(1, target=target)
    assert snapshot(out) == snapshot(saved)
    assert out["w"].sharding.spec == P(None, "x")


def test_a_blob_that_cannot_be_mapped_is_read(ramdisk, monkeypatch):
    def no_maps(self, name, nbytes=None):
        raise OSError(errno.ENOMEM, "Cannot allocate memory (vm.max_map_count)")

    monkeypatch.setattr(ram.blobs.BlobFiles, "map", no_maps)
    saved = big_state(5)
    with manager(ramdisk) as m:
        m.save(1, saved)
        m.wait_until_finished()
        assert_trees_bitwise_equal(saved, m.restore(1, target=abstract(saved)))


def test_equal_shards_in_one_save_are_written_once(ramdisk):
    sh = NamedSharding(mesh1d(), P("x"))
    zeros = np.zeros((1024, 256), np.float32)
    state = {"mu": jax.device_put(zeros, sh), "nu": jax.device_put(zeros, sh)}
    with manager(ramdisk) as m:
        m.save(1, state)
        m.wait_until_finished()
        assert m.last_save_report.bytes_written == zeros.nbytes // 8  # one shard's blob, once
        assert m.last_save_report.blobs_total == 1
        assert_trees_bitwise_equal(state, m.restore(1))
