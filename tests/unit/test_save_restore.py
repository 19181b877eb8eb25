"""Single-host save/restore through colocated Python (in-process on the CPU backend)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import as_bytes, assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import (
    ConfigError,
    CorruptBlobError,
    StepNotFoundError,
    TargetMismatchError,
)

pytestmark = pytest.mark.unit

Opt = collections.namedtuple("Opt", ["mu", "nu", "count"])


def mesh2d():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def mesh1d():
    return Mesh(np.array(jax.devices()), ("x",))


def make_state(seed: int = 0):
    rng = np.random.default_rng(seed)
    m2, m1 = mesh2d(), mesh1d()

    def put(shape, dtype, sharding):
        return jax.device_put(random_array(rng, shape, dtype), sharding)

    return {
        "params": {
            "w": put((16, 8), np.float32, NamedSharding(m2, P("data", "model"))),
            # partially replicated: sharded over "data", replicated over "model"
            "b": put((16,), ml_dtypes.bfloat16, NamedSharding(m2, P("data"))),
            "h": put((8, 4), np.float16, NamedSharding(m1, P("x"))),
            "f8": put((8, 8), ml_dtypes.float8_e4m3fn, NamedSharding(m2, P(None, "model"))),
        },
        "opt": Opt(
            mu=put((16, 8), np.int8, NamedSharding(m2, P("model", "data"))),
            nu=put((8,), np.uint32, NamedSharding(m1, P())),  # fully replicated
            count=put((), np.int32, NamedSharding(m1, P())),  # 0-d
        ),
        "flags": [put((8, 2), np.bool_, NamedSharding(m1, P("x"))), None,
                  (put((4,), np.complex64, NamedSharding(m2, P("model"))), None)],
        "host": {"rng": rng.integers(0, 2**62, size=(3,), dtype=np.int64), "lr": np.float64(3e-4)},
        "step": 7,
        "lr": 0.1 + 0.2,
        "name": "run-a",
        "done": False,
        "single": jax.device_put(random_array(rng, (5,), np.float32), jax.devices()[3]),
    }


def manager(dirpath, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(dirpath), enable_multi_tier_checkpointing=True,
                                       local_checkpoint_period=kw.pop("period", 1), **kw))


def abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree)


def test_round_trip_every_kind_of_leaf(ramdisk):
    state = make_state()
    with manager(ramdisk) as m:
        assert m.save(1, state)
        m.wait_until_finished()
        assert m.latest_step() == 1
        # Without a target: the saved structure and shardings come back.
        assert_trees_bitwise_equal(state, m.restore())
        # With an abstract target (ShapeDtypeStructs), and with concrete arrays as target.
        assert_trees_bitwise_equal(state, m.restore(1, target=abstract(state)))
        assert_trees_bitwise_equal(state, m.restore(1, target=state))
        rep = m.last_restore_report
        assert rep.step == 1 and rep.bytes_by_tier["ram"] > 0
    # A fresh manager (a new head) finds the step on the ramdisk.
    with manager(ramdisk) as m2:
        assert m2.all_steps() == [1]
        restored = m2.restore()
    assert_trees_bitwise_equal(state, restored)
    assert isinstance(restored["opt"], Opt)


def test_namedtuple_and_none_structure_kept(ramdisk):
    state = {"a": None, "b": [None, Opt(jnp.ones(3), None, 2)], "c": ()}
    with manager(ramdisk) as m:
        m.save(0, state)
        out = m.restore(0)
    assert out["a"] is None and out["b"][0] is None and out["b"][1].nu is None
    assert isinstance(out["b"][1], Opt) and out["c"] == ()
    assert_trees_bitwise_equal(state, out)


def test_restore_into_other_sharding_same_values(ramdisk):
    state = make_state(1)
    with manager(ramdisk) as m:
        m.save(3, state)
        m.wait_until_finished()
        m1 = mesh1d()
        other = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           sharding=NamedSharding(m1, P() if x.ndim == 0 else P(*([None] * (x.ndim - 1)),
                                                                    "x" if x.shape[-1] % 8 == 0 else None)))
            if isinstance(x, jax.Array) else x, state)
        out = m.restore(3, target=other)
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                 jax.tree_util.tree_flatten_with_path(out)[0]):
        assert as_bytes(a) == as_bytes(b), jax.tree_util.keystr(path)
    w = out["params"]["w"]
    assert w.sharding.spec == P(None, "x")


def test_save_respects_period_and_force(ramdisk):
    with manager(ramdisk, period=5) as m:
        x = {"x": jnp.arange(8.0)}
        assert not m.save(3, x)
        assert m.save(5, x)
        assert m.save(6, x, force=True)
        m.wait_until_finished()
        assert m.all_steps() == [5, 6]


def test_max_to_keep_and_dedupe(ramdisk):
    with manager(ramdisk, local_max_to_keep=2) as m:
        x = {"a": jnp.arange(1024.0), "b": jnp.ones(1024)}
        for step in range(4):
            m.save(step, {"a": x["a"] + step, "b": x["b"]})
            m.wait_until_finished()
            if step == 1:
                # "b" is unchanged since step 0: its blob is not written again.
                assert m.last_save_report.bytes_written == 1024 * 4
        assert m.all_steps() == [2, 3]
        blobs = set(os.listdir(Path(ramdisk) / "mtc" / "blobs"))
        # a@2, a@3 and the shared b: nothing else survives garbage collection.
        assert len([b for b in blobs if not b.startswith(".")]) == 3
        assert_trees_bitwise_equal({"a": x["a"] + 2, "b": x["b"]}, m.restore(2))


def test_donating_train_step_does_not_corrupt_inflight_save(ramdisk):
    sh = NamedSharding(mesh1d(), P("x"))
    x = jax.device_put(jnp.arange(1 << 16, dtype=jnp.float32), sh)
    expect = np.asarray(x).copy()

    @jax.jit
    def step_fn(a):
        return a * 2 + 1

    donating = jax.jit(lambda a: a * 0 - 5, donate_argnums=0)
    with manager(ramdisk) as m:
        assert m.save(1, {"x": x})
        y = donating(x)  # may reuse x's buffers while the write is in flight
        y = step_fn(y)
        y.block_until_ready()
        m.wait_until_finished()
        out = m.restore(1)
    assert np.array_equal(np.asarray(out["x"]).view(np.uint8), expect.view(np.uint8))


def test_flipped_byte_names_array_and_shard(ramdisk):
    sh = NamedSharding(mesh1d(), P("x"))
    with manager(ramdisk) as m:
        m.save(1, {"layer": {"w": jax.device_put(jnp.arange(64.0), sh)}})
        m.wait_until_finished()
        manifest = m._dispatch.manifest(1)
        shard = manifest.arrays[0].shards[3]
        path = Path(ramdisk) / "mtc" / "blobs" / shard.blob
        data = bytearray(path.read_bytes())
        data[5] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptBlobError) as e:
            m.restore(1)
    msg = str(e.value)
    assert "['layer']['w']" in msg and "[24:32]" in msg and "ram" in msg


def test_bad_input_errors(ramdisk):
    state = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    with manager(ramdisk) as m:
        with pytest.raises(StepNotFoundError, match="no committed step"):
            m.restore()
        m.save(1, state)
        m.wait_until_finished()
        with pytest.raises(StepNotFoundError, match="step 9 .*committed steps: \\[1\\]"):
            m.restore(9)
        with pytest.raises(TargetMismatchError, match="missing"):
            m.restore(1, target={"w": state["w"]})
        with pytest.raises(TargetMismatchError, match=r"target shape \(2, 8\) != saved shape \(4, 4\)"):
            m.restore(1, target={"w": jax.ShapeDtypeStruct((2, 8), jnp.float32), "b": state["b"]})
        with pytest.raises(TargetMismatchError, match="target dtype int32 != saved dtype float32"):
            m.restore(1, target={"w": jax.ShapeDtypeStruct((4, 4), jnp.int32), "b": state["b"]})
        with pytest.raises(ValueError, match="already committed"):
            m.save(1, state)
        with pytest.raises(ValueError, match="non-negative integer"):
            m.save(-1, state)
        with pytest.raises(TargetMismatchError, match="object"):
            m.save(2, {"x": object()})
    with pytest.raises(ConfigError, match="multi_tier_checkpointing_backup_interval"):
        MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1,
                  enable_multi_tier_checkpointing=True, base_output_directory=str(ramdisk),
                  multi_tier_checkpointing_backup_interval_minutes=5,
                  multi_tier_checkpointing_backup_interval_steps=10)
    with pytest.raises(ConfigError, match="local_checkpoint_period"):
        MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=0,
                  enable_multi_tier_checkpointing=True)
