"""The Orbax-compatible manager, used as an Orbax user uses Orbax's CheckpointManager."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

ocp = pytest.importorskip("orbax.checkpoint")  # in the test extra: runs in CI

from helpers import assert_trees_bitwise_equal, random_array  # noqa: E402
from mtc.head import MTCConfig, OrbaxCompatibleManager  # noqa: E402
from mtc.head.orbax.compat import UnsupportedOperationError  # noqa: E402
from mtc.shared.errors import TargetMismatchError  # noqa: E402

pytestmark = pytest.mark.unit


def train_state(seed: int):
    """A state with what a training state holds: typed keys, bfloat16, ints, 0-d arrays, scalars."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(seed)

    def put(shape, dtype, spec):
        return jax.device_put(random_array(rng, shape, dtype), NamedSharding(mesh, spec))

    return {
        "params": {"w": put((16, 8), ml_dtypes.bfloat16, P("data", "model")),
                   "b": put((8,), np.float32, P())},
        "opt_state": {"count": put((), np.int32, P()), "mu": put((16, 8), np.float32, P(None, "model"))},
        "step": put((), np.int64, P()),
        "rng": jax.device_put(jax.random.split(jax.random.key(seed, impl="unsafe_rbg"), 4),
                              NamedSharding(mesh, P("data"))),
        "dropout_rng": jax.device_put(jax.random.key(seed + 1, impl="threefry2x32"), NamedSharding(mesh, P())),
        "epoch": seed,
        "lr": 3e-4,
    }


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, state)


def restore_args_of(abstract):
    return jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding) if hasattr(x, "sharding")
                        else ocp.RestoreArgs(), abstract)


@pytest.fixture
def mngr(ramdisk):
    m = OrbaxCompatibleManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=2,
                                          local_max_to_keep=3))
    yield m
    m.close()


def test_save_and_restore_as_an_orbax_user(mngr):
    states = {}
    for step in range(5):
        states[step] = train_state(step)
        saved = mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=states[step])))
        assert saved == mngr.mtc_manager.should_save(step) or saved is False
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 2, 4]
    assert mngr.latest_step() == 4 and mngr.best_step() == 4
    abstract = abstract_of(states[4])
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args_of(abstract))))
    assert isinstance(restored, ocp.args.Composite)
    assert_trees_bitwise_equal(states[4], restored.state)
    assert str(jax.random.key_impl(restored.state["rng"])) == "unsafe_rbg"
    older = mngr.restore(2, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract_of(states[2]))))
    assert_trees_bitwise_equal(states[2], older.state)
    assert str(mngr.directory) == mngr.mtc_manager.config.local_checkpoint_directory


def test_standard_args_and_several_items(mngr):
    state, extra = train_state(7), {"data_step": np.int64(123), "note": "hello"}
    assert mngr.save(8, args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.PyTreeSave(extra)))
    mngr.wait_until_finished()
    got = mngr.restore(8, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_of(state))))
    assert list(got.keys()) == ["state"]  # only the items asked for
    assert_trees_bitwise_equal(state, got.state)
    both = mngr.restore(8, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_of(state)),
                                                   extra=ocp.args.PyTreeRestore(extra)))
    assert_trees_bitwise_equal(extra, both.extra)


def test_partial_restore_and_missing_leaves(mngr):
    state = train_state(3)
    mngr.save(2, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
    mngr.wait_until_finished()
    params_only = {"params": abstract_of(state)["params"]}
    got = mngr.restore(2, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=params_only, restore_args=restore_args_of(params_only), partial_restore=True)))
    assert_trees_bitwise_equal({"params": state["params"]}, got.state)
    with pytest.raises(TargetMismatchError, match=r"missing \[\"\['state'\]\['dropout_rng'\]"):
        mngr.restore(2, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=params_only)))


def test_restore_args_dtype_casts_after_restore(mngr):
    state = train_state(4)
    mngr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)), force=True)
    mngr.wait_until_finished()
    abstract = abstract_of(state)
    rargs = restore_args_of(abstract)
    rargs["params"]["w"] = ocp.ArrayRestoreArgs(sharding=abstract["params"]["w"].sharding, dtype=jnp.float32)
    got = mngr.restore(0, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract, restore_args=rargs)))
    assert got.state["params"]["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got.state["params"]["w"]),
                                  np.asarray(state["params"]["w"]).astype(np.float32))


def test_a_step_in_flight_is_listed_and_not_saved_twice(mngr):
    state = train_state(5)
    assert mngr.save(6, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
    # Listed from the moment its save started (as Orbax does), whether or not it committed yet.
    assert 6 in mngr.all_steps() and mngr.latest_step() == 6
    # MaxText's forced final save of the step it just saved: neither an error nor a second write.
    assert mngr.save(6, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=train_state(99))), force=True) is False
    mngr.wait_until_finished()
    assert not mngr.is_saving_in_progress()
    assert mngr.save(6, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)), force=True) is False
    got = mngr.restore(6, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract_of(state))))
    assert_trees_bitwise_equal(state, got.state)  # the first save's state, not the second's
    assert mngr.mtc_manager.last_save_report.step == 6


def test_unsupported_methods_say_what_to_use(mngr):
    with pytest.raises(UnsupportedOperationError, match="local_max_to_keep"):
        mngr.delete(0)
    with pytest.raises(UnsupportedOperationError, match="without an item tree"):
        mngr.item_metadata(0)
    with pytest.raises(UnsupportedOperationError, match="steps/"):
        mngr.metadata()
    with pytest.raises(UnsupportedOperationError, match="restore-version"):
        mngr.restore(0, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()), directory="/elsewhere")
    with pytest.raises(TypeError, match="Composite"):
        mngr.save(0, args={"state": 1})
    assert mngr.metrics(0) is None and mngr.reload() is None and mngr.reached_preemption(0) is False
    assert isinstance(UnsupportedOperationError("x"), NotImplementedError)
