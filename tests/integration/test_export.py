"""``CheckpointManager.export`` / ``mtc export``: a step as a standard Orbax checkpoint.

Read back with Orbax's own ``ocp.load`` onto another mesh (fewer devices) and compared bit for
bit with mtc's restore onto the same mesh: bfloat16, ints, typed PRNG keys of each impl, Python
scalars, host arrays, a namedtuple split across groups. Memory is bounded by ``max_bytes``; bad
input (a step already exported, an unknown step, a full disk) is refused with nothing Orbax
would read left behind. The backup tier on a GCS emulator is a source.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.orbax.export import ExportError, groups_of
from mtc.shared.errors import StepNotFoundError

pytestmark = pytest.mark.integration

ocp = pytest.importorskip("orbax.checkpoint").v1
Adam = collections.namedtuple("Adam", "count mu nu")


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    w = jax.device_put(jnp.asarray(rng.standard_normal((64, 32)), dtype=jnp.bfloat16), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(rng.integers(-9, 9, (32,), dtype=np.int32), NamedSharding(mesh, P("model")))
    params = {"w": w, "b": b}
    return {
        "params": params,
        "opt_state": (Adam(jnp.int32(seed), jax.tree.map(lambda x: x * 2, params), jax.tree.map(lambda x: x + 1, params)),
                      ()),
        "step": jax.device_put(jnp.int64(seed) if jax.config.jax_enable_x64 else jnp.int32(seed),
                               NamedSharding(mesh, P())),
        "keys": {impl: jax.random.split(jax.random.key(seed, impl=impl), 4) for impl in ("threefry2x32", "rbg")},
        "lr": 0.25 * seed, "name": "run", "flag": True,
        "host": rng.standard_normal(5),
    }


def manager(ramdisk, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1, **kw))


def onto(tree, mesh):
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
        if isinstance(x, np.ndarray):
            return np.empty(x.shape, x.dtype)
        return x
    return jax.tree.map(one, tree)


def test_orbax_reads_the_export_onto_fewer_devices_as_mtc_restores_it(ramdisk, tmp_path):
    s = state(3)
    small = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with manager(ramdisk) as m:
        m.save(3, s)
        m.wait_until_finished()
        # Groups of at most 2 KiB: the optimizer's namedtuple is split between groups.
        rep = m.export(str(tmp_path / "out"), max_bytes=2048, verify=True)
        from_mtc = m.restore(3, target=onto(s, small))
    assert rep.verified and rep.groups > 3 and rep.step == 3
    assert rep.largest_group_bytes <= 64 * 32 * 2  # the largest array: nothing more was held at once
    assert rep.items == str(tmp_path / "out" / "3" / "items")
    got = ocp.load(rep.path, onto(s, small), checkpointable_name="items")
    assert_trees_bitwise_equal(from_mtc, got)
    assert_trees_bitwise_equal(s, got, check_sharding=False)
    for impl in ("threefry2x32", "rbg"):
        assert str(jax.random.key_impl(got["keys"][impl])) == impl
    assert got["opt_state"][0].mu["w"].sharding.mesh.devices.size == 4
    # The export records what Orbax's own save of the same state records: every key path with its
    # key types and value type, and the handler (so ocp.metadata reads it as it reads a whole save).
    ocp.save_checkpointables(str(tmp_path / "direct" / "3"), {"items": s})

    def recorded(root):
        doc = json.loads((root / "3" / "items" / "_METADATA").read_text())["tree_metadata"]
        handlers = json.loads((root / "3" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
        return handlers, {k: (v["key_metadata"], v["value_metadata"]["value_type"]) for k, v in doc.items()}

    assert recorded(tmp_path / "out") == recorded(tmp_path / "direct")
    no_bool = {k: v for k, v in s.items() if k != "flag"}  # Orbax's metadata() cannot describe a bool
    m2 = manager(ramdisk / "again")
    with m2:
        m2.save(1, no_bool)
        m2.wait_until_finished()
        meta = ocp.metadata(m2.export(str(tmp_path / "nb")).path, checkpointable_name="items").metadata
    assert meta["params"]["w"].shape == (64, 32) and str(meta["params"]["w"].dtype) == "bfloat16"


def test_groups_hold_at_most_max_bytes_or_one_larger_array():
    assert groups_of([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert groups_of([], 8) == []
    assert groups_of([0, 0, 9], 8) == [[0, 1], [2]]


def test_bad_input_is_refused_and_nothing_orbax_would_read_is_left(ramdisk, tmp_path, tmpfs16):
    s = state(1)
    with manager(ramdisk) as m:
        m.save(1, s)
        m.save(2, state(2))
        m.wait_until_finished()
        first = m.export(str(tmp_path / "out"), 1)
        before = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "1").rglob("*")}
        with pytest.raises(ExportError, match="already exists"):
            m.export(str(tmp_path / "out"), 1)
        assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "1").rglob("*")} == before
        with pytest.raises(StepNotFoundError, match=r"restorable steps: \[1, 2\]"):
            m.export(str(tmp_path / "out"), 7)
        # An export that stopped half-way is started over.
        (tmp_path / "out" / "2.partial_save" / "junk").mkdir(parents=True)
        assert m.export(str(tmp_path / "out"), 2).step == 2
        assert not (tmp_path / "out" / "2.partial_save").exists()
        # A full disk: 16 MiB cannot take a 24 MiB array.
        big = {"w": jax.device_put(np.random.default_rng(0).standard_normal((6, 1 << 20), dtype=np.float32))}
        m.save(3, big)
        m.wait_until_finished()
        with pytest.raises(ExportError, match="nothing was left there that Orbax would read") as e:
            m.export(str(tmpfs16), 3)
        assert "No space left" in str(e.value) or "ENOSPC" in str(e.value) or "space" in str(e.value).lower()
        assert sorted(os.listdir(tmpfs16)) == []
    assert first.checkpointables == ("items",)


def test_export_never_writes_through_a_symbolic_link(ramdisk, tmp_path):
    """A symlinked ``<step>.partial_save``, ``<step>.orbax-checkpoint-tmp`` or ``<step>`` in the
    export's directory: refused, naming it, and nothing is written where it points."""
    s = state(1)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    with manager(ramdisk) as m:
        m.save(1, s)
        m.wait_until_finished()
        for name, kw in (("1.partial_save", dict(max_bytes=2048)), ("1.orbax-checkpoint-tmp", {}), ("1", {}),
                         ("1.partial_save.orbax-checkpoint-tmp", dict(max_bytes=2048))):
            os.symlink(elsewhere, out / name)
            with pytest.raises(ExportError, match="is a symbolic link") as e:
                m.export(str(out), 1, **kw)
            assert str(out / name) in str(e.value) and "nothing was written" in str(e.value)
            assert os.listdir(elsewhere) == [] and os.listdir(out) == [name] and os.path.islink(out / name)
            os.unlink(out / name)
        rep = m.export(str(out), 1, max_bytes=2048, verify=True)  # the links removed: the export is written
    assert rep.verified and os.listdir(out) == ["1"] and not os.path.islink(out / "1")


_FAILED_SAVE = """
import os, sys, threading
import numpy as np
from orbax.checkpoint import v1 as ocp
from mtc.head.orbax.export import _release_orbax
out = sys.argv[1]
os.symlink(sys.argv[2], os.path.join(out, "1.orbax-checkpoint-tmp"))  # Orbax's save fails creating its folder
before = set(threading.enumerate())
try:
    ocp.save_checkpointables(os.path.join(out, "1"), {"items": {"w": np.arange(8.0)}})
except Exception as e:
    print("failed:", type(e).__name__)
_release_orbax(before)
print("released")
"""


def test_a_failed_orbax_save_leaves_no_thread_that_keeps_the_process_alive(tmp_path):
    """Orbax's save that fails creating its folder leaves its writers waiting for a signal (until its
    20-minute timeout, and the process with them): the export's cleanup ends them."""
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run([sys.executable, "-c", _FAILED_SAVE, str(tmp_path / "out"), str(tmp_path / "elsewhere")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "failed:" in r.stdout and "released" in r.stdout, r.stdout + r.stderr[-3000:]


def test_cli_export_with_a_symlinked_pending_folder_says_so_and_exits(ramdisk, tmp_path):
    s = state(2)
    with manager(ramdisk / "job") as m:
        m.save(2, s)
        m.wait_until_finished()
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", out / "2.orbax-checkpoint-tmp")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "export", "--to", str(out),
                        "--local-checkpoint-directory", str(ramdisk / "job")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is a symbolic link" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert os.listdir(tmp_path / "elsewhere") == []


def test_cli_export_from_the_backup_tier_on_a_gcs_emulator(ramdisk, tmp_path, fake_gcs_server, monkeypatch):
    monkeypatch.setenv("MTC_PEER_TOKEN", "export-gcs-test-token-0123456789")  # the backups are sealed with its key
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    fake_gcs_server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs_server.url)
    s = state(5)
    cfg = dict(enable_multi_tier_checkpointing=True, multi_tier_checkpointing_backup_interval_steps=1,
               base_output_directory=f"gs://{bucket}", run_name="run")
    with manager(ramdisk, **cfg) as m:
        m.save(5, s)
        m.wait_until_finished()
        m.wait_for_backup()
        assert [b["step"] for b in m.backups()] == [5]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "export", "--to", str(tmp_path / "out"),
                        "--base-output-directory", f"gs://{bucket}", "--run-name", "run", "--verify"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 5" in r.stdout and "backup" in r.stdout and "verified bit for bit" in r.stdout
    got = ocp.load(str(tmp_path / "out" / "5"), onto(s, Mesh(np.array(jax.devices()[:2]), ("data",))),
                   checkpointable_name="items")
    assert_trees_bitwise_equal(s, got, check_sharding=False)
    missing = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "export", "--to", str(tmp_path / "x"),
                              "--step", "4", "--base-output-directory", f"gs://{bucket}", "--run-name", "run"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "restorable steps: [5]" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_export_to_gs_on_a_gcs_emulator(ramdisk, fake_gcs_server, monkeypatch):
    pytest.importorskip("gcsfs")  # what Orbax's paths need for gs://
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    fake_gcs_server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs_server.url)  # gcsfs
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", fake_gcs_server.url)  # TensorStore, which writes the arrays
    s = state(2)
    with manager(ramdisk) as m:
        m.save(2, s)
        m.wait_until_finished()
        with pytest.raises(ExportError, match="does not write to gs://"):
            m.export(f"gs://{bucket}/exp", max_bytes=1024)  # bounded memory: Orbax's partial save, local only
        rep = m.export(f"gs://{bucket}/exp", verify=True)
    assert rep.path == f"gs://{bucket}/exp/2" and rep.verified and rep.groups == 1
    got = ocp.load(rep.path, onto(s, Mesh(np.array(jax.devices()[:2]), ("data",))), checkpointable_name="items")
    assert_trees_bitwise_equal(s, got, check_sharding=False)
    names = {b.name for b in fake_gcs_server.client().list_blobs(bucket)}
    assert {"exp/2/commit_success.txt", "exp/2/items/_METADATA"} <= names


def test_cli_export_of_sealed_backups_needs_the_jobs_key_and_says_so(ramdisk, tmp_path, monkeypatch):
    """The export's own daemons keep the job's key from the environment (MTC_PEER_TOKEN), so they take
    the job's sealed backups; without it the export takes none, and says why and what to set."""
    monkeypatch.setenv("MTC_PEER_TOKEN", "export-seal-test-token-0123456789")
    s = state(6)
    base = tmp_path / "bucket"
    with manager(ramdisk, enable_multi_tier_checkpointing=True, multi_tier_checkpointing_backup_interval_steps=1,
                 base_output_directory=str(base), run_name="run") as m:
        m.save(6, s)
        m.wait_until_finished()
        m.wait_for_backup()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "mtc.head.tools.cli", "export", "--base-output-directory", str(base), "--run-name", "run"]
    r = subprocess.run([*cmd, "--to", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "exported step 6" in r.stdout, r.stderr[-3000:]
    env.pop("MTC_PEER_TOKEN")
    r = subprocess.run([*cmd, "--to", str(tmp_path / "other")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "step-000000000006" in r.stderr and "MTC_PEER_TOKEN" in r.stderr and "seal" in r.stderr, r.stderr
