"""The backup tier end to end through the manager (local-directory backend here; the same
tests run against a GCS emulator in test_backup_gcs.py)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import backup_layout
from mtc.shared import format as fmt
from mtc.shared.objstore import open_store
from mtc.shared.errors import ConfigError, CorruptBlobError, StepNotFoundError

pytestmark = pytest.mark.integration


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sh = NamedSharding(Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")), P("a", "b"))
    return {"w": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32), sh),
            "b": jax.device_put(rng.standard_normal((32,), dtype=np.float32), NamedSharding(sh.mesh, P("b"))),
            "step": seed}


def config(ramdisk: Path, base: str, **kw) -> MTCConfig:
    kw.setdefault("multi_tier_checkpointing_backup_interval_steps", 2)
    return MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                     local_checkpoint_period=1, base_output_directory=base, run_name="run", **kw)


def save_steps(m: CheckpointManager, steps, seed_of=lambda s: s) -> None:
    for s in steps:
        m.save(s, state(seed_of(s)))
        m.wait_until_finished()
        m.wait_for_backup()


@pytest.fixture(params=["local", "fake-gcs-server"])
def backup_base(request, tmp_path, monkeypatch) -> str:
    """The same tests on a local directory and on a real GCS emulator server."""
    if request.param == "local":
        return str(tmp_path / "bucket")
    server = request.getfixturevalue("fake_gcs_server")
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    return f"gs://{bucket}"


def store(base: str):
    return open_store(f"{base}/run/mtc")


def test_wipe_every_ramdisk_restore_from_backup(ramdisk, backup_base):
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        save_steps(m, [1, 2, 3])  # backups at 1 (first) and 2 (every 2 steps); 3 is local only
        assert [b["step"] for b in m.backups()] == [2, 1]
        r = m.last_backup_report
        assert r.error is None and r.uploaded_bytes > 0
    shutil.rmtree(ramdisk / "mtc")
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        assert m.latest_step() == 2
        out = m.restore()
        rep = m.last_restore_report
    assert_trees_bitwise_equal(state(2), out)
    assert rep.source.endswith("step-000000000002") and rep.bytes_by_tier["backup"] == 64 * 32 * 4 + 32 * 4
    assert rep.bytes_by_tier["ram"] == 0


def test_unchanged_state_uploads_zero_blob_bytes(ramdisk, backup_base):
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        save_steps(m, [1], seed_of=lambda s: 7)
        first = m.last_backup_report
        save_steps(m, [2], seed_of=lambda s: 7)  # same arrays, same "step" scalar
        second = m.last_backup_report
    assert first.uploaded_bytes > 0
    assert second.step == 2 and second.error is None
    assert second.uploaded_bytes == 0 and second.uploaded_blobs == 0 and second.skipped_blobs == first.uploaded_blobs


def test_restore_version_pins_an_older_backup(ramdisk, backup_base):
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        save_steps(m, [1, 2, 3, 4])
        names = {b["step"]: b["name"] for b in m.backups()}
        assert sorted(names) == [1, 2, 4]
    st = store(backup_base)
    st.put_bytes(backup_layout.RESTORE_VERSION, (names[2] + "\n").encode())
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        assert m.latest_step() == 2  # newer steps 3 and 4 are in the cluster, but pinned
        assert_trees_bitwise_equal(state(2), m.restore())
        assert m.last_restore_report.source == names[2]
        with pytest.raises(StepNotFoundError, match="restore.version pins"):
            m.restore(4)
    st.put_bytes(backup_layout.RESTORE_VERSION, b"20200101T000000Z-step-000000000099")
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        with pytest.raises(StepNotFoundError, match="does not exist"):
            m.restore()
    st.put_bytes(backup_layout.RESTORE_VERSION, b"latest-please")
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        with pytest.raises(ConfigError, match="not a backup name"):
            m.restore()


def test_flipped_byte_in_backup_blob_is_detected(ramdisk, backup_base):
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        save_steps(m, [1])
    shutil.rmtree(ramdisk / "mtc")
    st = store(backup_base)
    victim = max(st.list(backup_layout.BLOBS), key=st.size)
    data = bytearray(st.get_bytes(victim))
    data[100] ^= 0x10
    st.delete(victim)
    st.put_bytes(victim, bytes(data))
    blob = victim.split("/")[-1]
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        with pytest.raises(CorruptBlobError, match=blob):
            m.restore()
        # Nothing corrupt entered the ramdisk.
        assert not (ramdisk / "mtc" / "blobs" / blob).exists()


def test_retention_deletes_manifests_then_unused_blobs(ramdisk, backup_base):
    with CheckpointManager(config(ramdisk, backup_base, backup_max_to_keep=2,
                                  multi_tier_checkpointing_backup_interval_steps=1)) as m:
        save_steps(m, [1, 2, 3, 4])
        assert [b["step"] for b in m.backups()] == [4, 3]
    st = store(backup_base)
    remaining = {o.split("/")[-1] for o in st.list(backup_layout.BLOBS)}
    listed = st.list(backup_layout.BACKUPS)
    manifests = [o for o in listed if o.endswith(".json")]
    assert [backup_layout.parse_backup_name(o.split("/")[-1][:-5]) for o in manifests] == [3, 4]
    # Each kept backup's part index and seal (with a job key: a local cluster's token) go with it; the
    # pruned ones' too.
    assert {o for o in listed if o.endswith(".parts")} == {m[:-5] + ".parts" for m in manifests}
    assert all(o.endswith((".seal", ".parts")) and o.rsplit(".", 1)[0] + ".json" in manifests
               for o in listed if o not in manifests)
    live = set().union(*(fmt.StepManifest.from_json(st.get_bytes(o)).blob_names() for o in manifests))
    # Exactly the blobs of the kept backups survive: 8 shards of w and 2 of b per step.
    assert remaining == live and len(live) == 20


def test_a_backup_whose_manifest_fails_its_checks_is_passed_over_for_the_one_before(ramdisk, backup_base):
    """The newest backup's manifest damaged in the bucket and every ramdisk gone: the restore takes the
    backup before it, bit for bit; with that one damaged too, it says that none is good and why."""
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        save_steps(m, [1, 2])
        names = [b["name"] for b in m.backups()]
    assert [backup_layout.parse_backup_name(n) for n in names] == [2, 1]
    st = store(backup_base)

    def damage(name: str) -> None:
        data = bytearray(st.get_bytes(backup_layout.manifest_object(name)))
        data[len(data) // 2] ^= 0x20
        st.delete(backup_layout.manifest_object(name))
        st.put_bytes(backup_layout.manifest_object(name), bytes(data))

    damage(names[0])
    shutil.rmtree(ramdisk / "mtc")
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        assert_trees_bitwise_equal(state(1), m.restore())
        assert m.last_restore_report.source == names[1]
    damage(names[1])
    shutil.rmtree(ramdisk / "mtc")
    with CheckpointManager(config(ramdisk, backup_base)) as m:
        with pytest.raises(StepNotFoundError) as e:
            m.restore()
    assert names[0] in str(e.value) and names[1] in str(e.value) and "manifest fails its checks" in str(e.value)
