"""Items of a step that are not array trees: a Grain iterator's position and JSON, with the arrays.

The data is real and different at every position (a Grain pipeline over distinct records), so
an iterator that started over, skipped or repeated would show: after every restore the next
batches must be exactly those the uninterrupted iterator gives.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

ocp = pytest.importorskip("orbax.checkpoint")  # in the test extra: runs in CI
grain = pytest.importorskip("grain")
pygrain = pytest.importorskip("grain.python")

from helpers import assert_trees_bitwise_equal  # noqa: E402
from test_orbax_compat import abstract_of, restore_args_of, train_state  # noqa: E402

from mtc.head import AS_SAVED, CheckpointManager, DataPositionError, IteratorRestore, IteratorSave, MTCConfig  # noqa: E402
from mtc.head import OrbaxCompatibleManager  # noqa: E402
from mtc.head.restore.plan import NothingSavedError  # noqa: E402

pytestmark = pytest.mark.unit

RECORDS = 1000


def dataset_iterator(batch: int = 4, seed: int = 7):
    """Grain's dataset API (what MaxText builds): shuffled distinct records, mapped, batched."""
    ds = grain.MapDataset.range(RECORDS).shuffle(seed=seed).map(lambda i: np.array([i, i * i % 9973], np.int64))
    return iter(ds.to_iter_dataset().batch(batch))


def loader_iterator(seed: int = 3):
    """Grain's DataLoader API (a bytes state)."""
    source = pygrain.RangeDataSource(0, RECORDS, 1)
    sampler = pygrain.IndexSampler(RECORDS, shard_options=pygrain.NoSharding(), shuffle=True,
                                        num_epochs=1, seed=seed)
    return iter(pygrain.DataLoader(data_source=source, sampler=sampler, worker_count=0,
                                        operations=[pygrain.Batch(5)]))


def take(it, n):
    return [np.asarray(next(it)).copy() for _ in range(n)]


@pytest.fixture
def mngr(ramdisk):
    m = OrbaxCompatibleManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1,
                                          local_max_to_keep=3))
    yield m
    m.close()


@pytest.mark.parametrize("make", [dataset_iterator, loader_iterator], ids=["dataset", "dataloader"])
def test_composite_of_a_pytree_json_and_grain_iterator_round_trips(mngr, make):
    state, meta = train_state(1), {"epoch": 3, "name": "run", "lr": [0.1, None], "nested": {"a": True}}
    reference = make()
    it = make()
    take(it, 7)
    take(reference, 7)
    assert mngr.save(7, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(item=state), meta=ocp.args.JsonSave(meta),
        iter=pygrain.PyGrainCheckpointSave(it)))
    mngr.wait_until_finished()
    expected = take(reference, 5)
    take(it, 3)  # the iterator moves on after the save: the restore must take it back to step 7's position

    fresh = make()  # as a restarted job builds it: at the start of the data
    abstract = abstract_of(state)
    out = mngr.restore(7, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args_of(abstract)),
        meta=ocp.args.JsonRestore(), iter=pygrain.PyGrainCheckpointRestore(fresh)))
    assert_trees_bitwise_equal(out.state, state)
    assert out.meta == meta
    assert out.iter is fresh
    got = take(fresh, 5)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_iterator_position_comes_back_from_the_backup_after_every_ramdisk_is_lost(ramdisk, tmp_path):
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk / "a"), local_checkpoint_period=1,
                    base_output_directory=str(tmp_path / "bucket"), run_name="r",
                    multi_tier_checkpointing_backup_interval_steps=1)
    it, reference = dataset_iterator(), dataset_iterator()
    take(it, 11), take(reference, 11)
    state = train_state(2)
    with OrbaxCompatibleManager(cfg) as m:
        m.save(11, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state), iter=IteratorSave(it)))
        m.wait_until_finished()
        m.mtc_manager.wait_for_backup()
    with OrbaxCompatibleManager(cfg.replace(local_checkpoint_directory=str(ramdisk / "b"))) as m:  # a new ramdisk
        fresh = dataset_iterator()
        out = m.restore(None, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract_of(state)),
                                                      iter=IteratorRestore(fresh)))
        assert m.mtc_manager.last_restore_report.source != "cluster"  # from the backup
    assert_trees_bitwise_equal(out.state, state)
    for a, b in zip(take(fresh, 4), take(reference, 4)):
        np.testing.assert_array_equal(a, b)


def test_a_smaller_batch_after_a_resize_continues_at_the_next_record(mngr):
    """What holds when the global batch changes (fewer devices after a lost slice): the position
    is in records, so the resumed run neither repeats nor skips one."""
    it = dataset_iterator(batch=4)
    seen = np.concatenate(take(it, 3))[:, 0]
    mngr.save(3, args=ocp.args.Composite(iter=IteratorSave(it)))
    mngr.wait_until_finished()
    smaller = dataset_iterator(batch=2)
    mngr.restore(3, args=ocp.args.Composite(iter=IteratorRestore(smaller)))
    rest = np.concatenate(take(smaller, (RECORDS - 12) // 2))[:, 0]
    assert len(set(seen) | set(rest)) == RECORDS and not set(seen) & set(rest)


def test_a_position_from_another_pipeline_is_refused_naming_both(mngr):
    it = dataset_iterator()
    take(it, 2)
    saved = {"files": ["data-train-00000.parquet"], "shuffle_seed": 7}
    mngr.save(2, args=ocp.args.Composite(iter=IteratorSave(it, pipeline=saved)))
    mngr.wait_until_finished()
    other = dataset_iterator()
    with pytest.raises(DataPositionError) as e:
        mngr.restore(2, args=ocp.args.Composite(iter=IteratorRestore(
            other, pipeline={"files": ["other-00000.parquet"], "shuffle_seed": 7})))
    assert "data-train-00000.parquet" in str(e.value) and "other-00000.parquet" in str(e.value)
    assert np.asarray(next(other))[0, 0] == np.asarray(next(dataset_iterator()))[0, 0]  # left untouched
    # The same description restores; and more iterators than were saved are refused, naming the files.
    mngr.restore(2, args=ocp.args.Composite(iter=IteratorRestore(dataset_iterator(), pipeline=dict(saved))))
    with pytest.raises(DataPositionError, match="process_0-of-1.json"):
        mngr.restore(2, args=ocp.args.Composite(iter=IteratorRestore([dataset_iterator(), dataset_iterator()])))


def test_a_step_without_an_iterator_is_refused_unless_the_restart_is_asked_for(mngr):
    state = train_state(3)
    mngr.save(4, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
    mngr.wait_until_finished()
    restore = dict(state=ocp.args.PyTreeRestore(item=abstract_of(state)))
    with pytest.raises(DataPositionError, match="start the data over"):
        mngr.restore(4, args=ocp.args.Composite(**restore, iter=IteratorRestore(dataset_iterator())))
    fresh = dataset_iterator()
    out = mngr.restore(4, args=ocp.args.Composite(**restore, iter=IteratorRestore(fresh, missing_ok=True)))
    assert_trees_bitwise_equal(out.state, state)
    assert out.iter is fresh


def test_a_position_without_its_pipeline_description_is_refused_unless_the_data_restarts(mngr):
    """Saved without a description (or with it stripped from its mtc_iterator.json): nothing says the
    position belongs to this run's pipeline, so a restore that describes its pipeline refuses it."""
    it = dataset_iterator()
    take(it, 6)
    state = train_state(5)
    mngr.save(6, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state), iter=IteratorSave(it)))
    mngr.wait_until_finished()
    restore = dict(state=ocp.args.PyTreeRestore(item=abstract_of(state)))
    other = dataset_iterator()
    with pytest.raises(DataPositionError, match="without a description of its input pipeline") as e:
        mngr.restore(6, args=ocp.args.Composite(**restore, iter=IteratorRestore(
            other, pipeline={"files": ["other-00000.parquet"]})))
    assert "MTC_DATA_RESTART=1" in str(e.value) and "without the iterator item" in str(e.value)
    assert np.asarray(next(other))[0, 0] == np.asarray(next(dataset_iterator()))[0, 0]  # left untouched
    # The restart on purpose: the state without the position.
    assert_trees_bitwise_equal(mngr.restore(6, args=ocp.args.Composite(**restore)).state, state)


@pytest.mark.parametrize("meta", [b"[1, 2]", b'{"format": "mtc-iterator/1", "states": "json"}', b"{not json",
                                  b"\xff\xfe", b'{"format": "other/9", "states": {}}',
                                  b'{"format": "mtc-iterator/1", "states": {"process_0-of-1.json": 7}}',
                                  b"[" * 100000],
                         ids=["list", "states-string", "garbage", "not-utf8", "format", "encoding", "deep"])
def test_a_malformed_data_position_is_the_typed_error(mngr, meta):
    """An mtc_iterator.json (or a state file) that mtc did not write: DataPositionError, naming the
    file, and the iterator is left as it was."""
    raw = lambda b: np.frombuffer(b, np.uint8).copy()  # noqa: E731
    mngr.mtc_manager.save(3, {"iter": {"mtc_iterator.json": raw(meta), "process_0-of-1.json": raw(b"{}")}})
    mngr.mtc_manager.wait_until_finished()
    fresh = dataset_iterator()
    with pytest.raises(DataPositionError, match="mtc_iterator.json"):
        mngr.restore(3, args=ocp.args.Composite(iter=IteratorRestore(fresh)))
    assert np.asarray(next(fresh))[0, 0] == np.asarray(next(dataset_iterator()))[0, 0]
    state = b'{"format": "mtc-iterator/1", "states": {"process_0-of-1.json": "json"}}'
    mngr.mtc_manager.save(4, {"iter": {"mtc_iterator.json": raw(state), "process_0-of-1.json": raw(b"{oops")}})
    mngr.mtc_manager.wait_until_finished()
    with pytest.raises(DataPositionError, match="process_0-of-1.json"):
        mngr.restore(4, args=ocp.args.Composite(iter=IteratorRestore(dataset_iterator())))


def test_as_saved_restores_a_subtree_without_knowing_it(ramdisk):
    state = train_state(4)
    extra = {"a": np.arange(5, dtype=np.int16), "b": [np.zeros((2, 3), np.float32), 7]}
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        m.save(1, {"state": state, "extra": extra})
        m.wait_until_finished()
        out = m.restore(1, target={"state": abstract_of(state), "extra": AS_SAVED})
        assert_trees_bitwise_equal(out, {"state": state, "extra": extra})
        with pytest.raises(NothingSavedError, match=r"\['nope'\]"):
            m.restore(1, target={"state": abstract_of(state), "extra": AS_SAVED, "nope": AS_SAVED})
        # Orbax's bytes live in the step as host byte arrays: a JSON item is its file's bytes.
        m.save(2, {"meta": {"metadata": np.frombuffer(json.dumps({"x": 1}).encode(), np.uint8).copy()}})
        m.wait_until_finished()
        assert json.loads(m.restore(2)["meta"]["metadata"].tobytes()) == {"x": 1}
    assert jax.tree.structure(out["extra"]) == jax.tree.structure(extra)


class _Config:
    """The MaxText settings maxtext_data reads (a MaxText config object has these attributes)."""

    def __init__(self, **kw):
        self.dataset_type, self.grain_file_type, self.grain_train_files = "grain", "parquet", "/d/data-train-*.parquet"
        self.expansion_factor_real_data, self.data_shuffle_seed = -1, 0
        self.__dict__.update(kw)


def test_maxtext_names_and_shard_rules(mngr):
    """The launcher's layout of the iter item follows MaxText's grain_utility rules (one process)."""
    from mtc.head.maxtext import data as maxtext_data

    one, two = dataset_iterator(), [dataset_iterator(), dataset_iterator()]
    assert maxtext_data.save_args(_Config(), one).names == ["process_0-of-1.json"]
    assert maxtext_data.save_args(_Config(), two).names == ["process_0-of-2.json", "process_1-of-2.json"]
    take(two[0], 3), take(two[1], 5)
    mngr.save(1, args=ocp.args.Composite(iter=maxtext_data.save_args(_Config(), two)))
    mngr.wait_until_finished()
    # Two saved shards onto one iterator: MaxText cannot map them; refused with the way out.
    with pytest.raises(DataPositionError, match="expansion_factor_real_data"):
        mngr.restore(1, args=ocp.args.Composite(iter=maxtext_data.restore_args(_Config(), dataset_iterator())))
    # Onto two iterators again: each comes back at its own position.
    fresh = [dataset_iterator(), dataset_iterator()]
    mngr.restore(1, args=ocp.args.Composite(iter=maxtext_data.restore_args(_Config(), fresh)))
    ref = [dataset_iterator(), dataset_iterator()]
    take(ref[0], 3), take(ref[1], 5)
    for f, r in zip(fresh, ref):
        np.testing.assert_array_equal(next(f), next(r))
    # Another shuffle seed is another stream: refused, naming the setting.
    with pytest.raises(DataPositionError, match="data_shuffle_seed: saved 0, now 1"):
        mngr.restore(1, args=ocp.args.Composite(iter=maxtext_data.restore_args(_Config(data_shuffle_seed=1), fresh)))
    assert maxtext_data.describe_skip(_Config(dataset_type="synthetic"), None).startswith("mtc: dataset_type=synthetic")
    assert maxtext_data.describe_skip(_Config(), one) is None
