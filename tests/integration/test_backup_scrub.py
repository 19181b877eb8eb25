"""The backup scrub, on real sidecar daemons and a real GCS emulator (fake-gcs-server).

A byte flipped in a backup blob in the bucket is found by the background scrub and by `mtc verify
--backup`; while a host still holds the blob, the scrub re-uploads the good bytes (a restore after
wiping every ramdisk is then exact); when none does, the backup is marked damaged: `mtc status` says
why, and a restore takes the older good backup, or says that none is good.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from prometheus_client.parser import text_string_to_metric_families

from mtc.head import CheckpointManager, MTCConfig, metrics
from mtc.head.tools.cli.main import main
from mtc.shared import backup_layout
from mtc.shared.errors import CorruptBlobError, StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.shared.objstore import open_store
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


@pytest.fixture
def bucket(fake_gcs_server, monkeypatch) -> tuple[str, dict]:
    """A fresh bucket on the emulator: (base_output_directory, the daemons' environment)."""
    name = f"mtc-{uuid.uuid4().hex[:12]}"
    fake_gcs_server.client().create_bucket(name)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs_server.url)
    return f"gs://{name}", {"STORAGE_EMULATOR_HOST": fake_gcs_server.url}


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))  # every host holds its own shards
    return {"w": jax.device_put(random_array(rng, (256, 64), np.float32), sh)}


def config(cluster: LocalCluster, base: str, **kw) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, base_output_directory=base, run_name="run",
                     multi_tier_checkpointing_backup_interval_steps=1, **kw)


def flip(store, blob: str) -> None:
    data = bytearray(store.get_bytes(backup_layout.blob_object(blob)))
    data[len(data) // 2] ^= 0x10
    store.delete(backup_layout.blob_object(blob))
    store.put_bytes(backup_layout.blob_object(blob), bytes(data))


def good(store, blob: str) -> bool:
    return blob_name(store.get_bytes(backup_layout.blob_object(blob))) == blob


def wipe_all(cluster: LocalCluster) -> None:
    for h in cluster.hosts:
        cluster.wipe(h)
        cluster.restart(h)


def scrub_count(outcome: str) -> float:
    """The head's ``mtc_backup_scrub_blobs_total{outcome}`` as /metrics serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.served_port()}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "mtc_backup_scrub_blobs_total" and s.labels.get("outcome") == outcome)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verify(cluster: LocalCluster, base: str, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["verify", "--backup", "--cluster-spec", str(cluster.spec_path), "--base-output-directory", base,
               "--run-name", "run", *extra])
    return rc, capsys.readouterr().out


def test_the_background_scrub_repairs_a_flipped_byte_from_the_hosts(ramdisk, bucket):
    base, env = bucket
    st = open_store(f"{base}/run/mtc")
    one = state(1)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4, env=env) as cluster:
        cfg = config(cluster, base, backup_scrub_interval_s=1, metrics_port=metrics.served_port() or free_port())
        with CheckpointManager(cfg) as m:
            before = scrub_count("bad"), scrub_count("repaired")
            m.save(1, one)
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
            victim = max(o[len(backup_layout.BLOBS):] for o in st.list(backup_layout.BLOBS))
            flip(st, victim)
            assert not good(st, victim)
            deadline = time.monotonic() + 60
            while not good(st, victim):  # nothing but the scrub rewrites a blob the bucket has
                assert time.monotonic() < deadline, "the background scrub did not repair the flipped blob"
                time.sleep(0.2)
            while (scrub_count("bad") - before[0], scrub_count("repaired") - before[1]) != (1, 1):
                assert time.monotonic() < deadline, "the scrub's metrics do not count the bad and repaired blob"
                time.sleep(0.2)
        assert not st.list(backup_layout.DAMAGED)
        wipe_all(cluster)
        with CheckpointManager(cfg.replace(prefetch_on_start=False, backup_scrub_interval_s=0)) as m:
            out = m.restore(1)
            rep = m.last_restore_report
        assert_trees_bitwise_equal(one, out, check_sharding=True)
        assert rep.source != "cluster" and rep.bytes_by_tier["ram"] == 0


def test_verify_backup_repairs_then_marks_a_backup_no_host_can_repair(ramdisk, bucket, capsys):
    base, env = bucket
    st = open_store(f"{base}/run/mtc")
    one, two = state(1), state(2)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4, env=env) as cluster:
        cfg = config(cluster, base, backup_scrub_interval_s=0, backup_max_to_keep=2)
        with CheckpointManager(cfg) as m:
            for step, s in ((1, one), (2, two)):
                m.save(step, s)
                m.wait_until_finished()
                assert m.wait_for_backup().error is None
            names = {b["step"]: b["name"] for b in m.backups()}
            blobs = {s: m._dispatch.backup_manifest(n).blob_names() for s, n in names.items()}
        victim = sorted(blobs[2] - blobs[1])[0]

        # On demand, while the hosts still hold the steps: a flipped byte and a lost blob, found and repaired.
        flip(st, victim)
        lost = sorted(blobs[1] - blobs[2])[0]
        st.delete(backup_layout.blob_object(lost))
        rc, out = verify(cluster, base, capsys)
        assert rc == 0, out
        assert f"backup {names[2]} (step 2): {len(blobs[2])} blobs checked, 1 bad, 1 repaired: ok" in out, out
        assert f"backup {names[1]} (step 1): {len(blobs[1])} blobs checked, 1 bad, 1 repaired: ok" in out, out
        assert good(st, victim) and good(st, lost)

        # No host holds it any more: the backup is marked damaged, and says why.
        flip(st, victim)
        wipe_all(cluster)
        rc, out = verify(cluster, base, capsys)
        assert rc == 1, out
        assert f"backup {names[2]} (step 2): {len(blobs[2])} blobs checked, 1 bad, 0 repaired: DAMAGED" in out, out
        assert victim in out
        assert st.exists(backup_layout.damaged_object(names[2]))
        capsys.readouterr()
        assert main(["status", "--cluster-spec", str(cluster.spec_path), "--base-output-directory", base,
                     "--run-name", "run", "--json"]) == 0
        status = capsys.readouterr().out
        assert f"backup {names[2]} (step 2) is damaged, restore never chooses it" in status and victim in status

        # A restore never takes it: the older good backup, bit for bit.
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            assert m.latest_step() == 1
            assert_trees_bitwise_equal(one, m.restore(), check_sharding=True)
            assert m.last_restore_report.source == names[1]

        # None good: the restore says so, naming the damaged backups and why.
        flip(st, sorted(blobs[1])[0])
        wipe_all(cluster)
        rc, out = verify(cluster, base, capsys)
        assert rc == 1 and f"backup {names[1]} (step 1)" in out and "DAMAGED" in out, out
        assert f"backup {names[2]} (step 2): marked damaged earlier" in out, out
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            with pytest.raises(StepNotFoundError) as e:
                m.restore()
            for step in (3, 4):  # new backups: retention prunes the damaged ones, and their marks
                m.save(step, state(step))
                m.wait_until_finished()
                assert m.wait_for_backup().error is None
            assert [b["step"] for b in m.backups()] == [4, 3]
        msg = str(e.value)
        assert "marked damaged by the backup scrub" in msg and names[1] in msg and names[2] in msg, msg
        assert st.list(backup_layout.DAMAGED) == []


def test_verify_backup_refuses_bad_input_with_a_clear_message(ramdisk, capsys):
    assert main(["verify", "--backup", "--base-output-directory", "x", "--run-name", "r"]) == 2
    assert "give the job's --cluster-spec" in capsys.readouterr().err
    with LocalCluster(ramdisk / "c", 1, 1, devices_per_host=2) as cluster:
        rc = main(["verify", "--backup", "--cluster-spec", str(cluster.spec_path), "--run-name", "r"])
        assert rc == 2 and "--base-output-directory and --run-name" in capsys.readouterr().err
        (ramdisk / "b" / "r" / "mtc").mkdir(parents=True)  # a backup root, without that backup
        rc = main(["verify", "--backup", "--cluster-spec", str(cluster.spec_path), "--base-output-directory",
                   str(ramdisk / "b"), "--run-name", "r", "--name", "not-a-backup"])
        err = capsys.readouterr().err
        assert rc == 2 and "not-a-backup" in err and "Traceback" not in err, err


def test_verify_backup_ramdisk_removes_a_corrupt_ramdisk_copy_and_repairs_from_a_good_one(ramdisk, bucket, capsys):
    base, env = bucket
    st = open_store(f"{base}/run/mtc")
    one = state(1)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4, env=env) as cluster:
        cfg = config(cluster, base, backup_scrub_interval_s=0)  # 2 hosts, one slice: each holds a copy of all
        with CheckpointManager(cfg) as m:
            m.save(1, one)
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
        h0, h1 = cluster.hosts
        victim = max(p.name for p in (cluster.ramdisk(h0) / "mtc" / "blobs").iterdir() if len(p.name) == 32)
        copy = cluster.ramdisk(h0) / "mtc" / "blobs" / victim
        assert (cluster.ramdisk(h1) / "mtc" / "blobs" / victim).is_file(), "the test needs a second copy"
        data = bytearray(copy.read_bytes())
        data[0] ^= 0x01
        copy.write_bytes(bytes(data))
        flip(st, victim)  # the bucket's copy too: only h1's copy is good
        rc, out = verify(cluster, base, capsys, "--ramdisk")
        assert rc == 0, out
        assert "1 bad, 1 repaired: ok" in out and f"corrupt ones removed: {h0}: {victim}" in out, out
        assert not copy.exists() and good(st, victim)


def local_bucket(tmp_path) -> str:
    return str(tmp_path / "bucket")


def test_verify_backup_never_downloads_an_object_larger_than_its_blob(tmpfs16, tmp_path, capsys):
    """A 64 MiB object stored under a blob's name, a 16 MiB ramdisk: the object's size is not the
    blob's, so it is bad without being read, and repaired from the hosts' good copies."""
    base = local_bucket(tmp_path)
    st = open_store(f"{base}/run/mtc")
    one = state(1)
    with LocalCluster(tmpfs16 / "c", 1, 2, devices_per_host=4) as cluster:
        with CheckpointManager(config(cluster, base, backup_scrub_interval_s=0)) as m:
            m.save(1, one)
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
        victim = max(o[len(backup_layout.BLOBS):] for o in st.list(backup_layout.BLOBS))
        big = tmp_path / "big"
        big.write_bytes(np.random.default_rng(0).bytes(64 << 20))
        st.delete(backup_layout.blob_object(victim))
        st.put_file(backup_layout.blob_object(victim), str(big))
        rc, out = verify(cluster, base, capsys)
        assert rc == 0, out
        assert "1 bad, 1 repaired: ok" in out, out
        assert good(st, victim)
        wipe_all(cluster)
        with CheckpointManager(config(cluster, base, backup_scrub_interval_s=0, prefetch_on_start=False)) as m:
            assert_trees_bitwise_equal(one, m.restore(1), check_sharding=True)


def test_a_planted_damaged_mark_is_checked_again_and_removed(ramdisk, tmp_path, capsys):
    """A ``damaged/<newest>.json`` the scrub did not make, with terminal escapes in its why: the
    scrub checks that backup again, finds it whole and removes the mark (restore takes it again
    after every ramdisk is lost); no control character from the store is printed."""
    base = local_bucket(tmp_path)
    st = open_store(f"{base}/run/mtc")
    one, two = state(1), state(2)
    with LocalCluster(ramdisk / "c", 1, 2, devices_per_host=4) as cluster:
        cfg = config(cluster, base, backup_scrub_interval_s=0, backup_max_to_keep=2)
        with CheckpointManager(cfg) as m:
            for step, s in ((1, one), (2, two)):
                m.save(step, s)
                m.wait_until_finished()
                assert m.wait_for_backup().error is None
            names = {b["step"]: b["name"] for b in m.backups()}
        why = "\x1b[2J\x1b[31mrestore step 1 instead\x1b[0m\x07\r"
        st.put_bytes(backup_layout.damaged_object(names[2]), json.dumps({"backup": names[2], "why": why}).encode())
        capsys.readouterr()
        assert main(["status", "--cluster-spec", str(cluster.spec_path), "--base-output-directory", base,
                     "--run-name", "run"]) == 0
        status = capsys.readouterr()
        assert f"{names[2]} (step 2) is damaged" in status.out and "x1b" in status.out, status.out
        assert not any(c in status.out + status.err for c in "\x1b\x07\r"), repr(status.out)
        rc, out = verify(cluster, base, capsys, "--backups", "1")
        assert rc == 0, out
        assert f"backup {names[2]} (step 2): marked damaged earlier, checked again:" in out, out
        assert "its damaged mark removed" in out, out
        assert not any(c in out for c in "\x1b\x07\r"), repr(out)
        assert st.list(backup_layout.DAMAGED) == []
        wipe_all(cluster)
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            assert m.latest_step() == 2
            assert_trees_bitwise_equal(two, m.restore(), check_sharding=True)
            assert m.last_restore_report.source == names[2]


def test_a_restore_never_downloads_an_object_larger_than_its_blob(tmpfs16, tmp_path):
    """Every ramdisk lost, a 64 MiB object under the backup's blob name, 16 MiB ramdisks: the restore
    says the blob is corrupt (not that the ramdisk is full), and restores once the object is good."""
    base = local_bucket(tmp_path)
    st = open_store(f"{base}/run/mtc")
    one = state(1)
    with LocalCluster(tmpfs16 / "c", 1, 2, devices_per_host=4) as cluster:
        cfg = config(cluster, base, backup_scrub_interval_s=0)
        with CheckpointManager(cfg) as m:
            m.save(1, one)
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
        victim = max(o[len(backup_layout.BLOBS):] for o in st.list(backup_layout.BLOBS))
        good_bytes = st.get_bytes(backup_layout.blob_object(victim))
        big = tmp_path / "big"
        big.write_bytes(np.random.default_rng(0).bytes(64 << 20))
        st.delete(backup_layout.blob_object(victim))
        st.put_file(backup_layout.blob_object(victim), str(big))
        wipe_all(cluster)
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:
            with pytest.raises(CorruptBlobError) as e:
                m.restore(1)
            assert victim in str(e.value) and "space" not in str(e.value).lower(), str(e.value)
            st.delete(backup_layout.blob_object(victim))
            st.put_bytes(backup_layout.blob_object(victim), good_bytes)
            assert_trees_bitwise_equal(one, m.restore(1), check_sharding=True)
