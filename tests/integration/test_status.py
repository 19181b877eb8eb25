"""`mtc status` on a live local cluster: a wiped host, a lost blob and a pinned backup."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig
from mtc.head.tools.cli.main import main
from mtc.sidecar.local_cluster import LocalCluster
from mtc.shared import format as fmt

pytestmark = pytest.mark.integration


def _status(capsys, *args) -> dict:
    assert main(["status", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_tells_the_truth(tmp_path, capsys):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sh = NamedSharding(mesh, P(None, "model"))  # replicated over the slices: twins
    backup = tmp_path / "backup"
    with LocalCluster(tmp_path / "c", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(tmp_path / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(backup), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=2, local_max_to_keep=3)
        with CheckpointManager(cfg) as m:
            for step in (1, 2, 3):
                m.save(step, {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sh)})
                m.wait_until_finished()
            m.wait_for_backup()
            m.wait_for_replication()
            backups = m.backups()
        args = ["--cluster-spec", str(cluster.spec_path), "--base-output-directory", str(backup), "--run-name", "r"]
        st = _status(capsys, *args)
        rows = {r["step"]: r for r in st["steps"]}
        assert sorted(rows) == [1, 2, 3] and st["choice"] == 3
        assert rows[3]["hosts"] == cluster.hosts and rows[3]["replicated"] and rows[3]["min_copies"] == 2
        assert [r["step"] for r in st["steps"] if r["backups"]] == sorted({b["step"] for b in backups})

        # A replaced host (wiped, restarted): its step is still restorable from its twin, but no
        # longer replicated.
        cluster.wipe("s1-h0")
        cluster.restart("s1-h0")
        st = _status(capsys, *args)
        rows = {r["step"]: r for r in st["steps"]}
        assert "s1-h0" not in rows[3]["hosts"] and rows[3]["restorable"] and not rows[3]["replicated"]
        assert rows[3]["min_copies"] == 1 and st["choice"] == 3

        # A flipped byte in the one copy left of a blob of step 3: --verify finds it and does not
        # count the copy; without --verify the copy still looks good (found only when read).
        twin = cluster.ramdisk("s0-h0") / "mtc"
        m = fmt.StepManifest.from_json((twin / "steps" / f"{3:012d}.json").read_bytes())
        blob = next(sh_.blob for a in m.arrays for sh_ in a.shards if a.key == "['w']" and 0 in sh_.devices)
        path = twin / "blobs" / blob
        data = bytearray(path.read_bytes())
        data[5] ^= 0x01
        path.write_bytes(bytes(data))
        assert _status(capsys, *args)["choice"] == 3
        st = _status(capsys, *args, "--verify")
        rows = {r["step"]: r for r in st["steps"]}
        assert f"blob {blob[:12]}.. corrupt on s0-h0" in rows[3]["why_not"], rows[3]
        assert st["choice"] == (3 if rows[3]["backups"] else 2)
        if rows[3]["backups"]:
            assert "from backup" in st["reason"]
        path.write_bytes(bytes(data[:5]) + bytes([data[5] ^ 0x01]) + bytes(data[6:]))  # repaired

        # Its twin loses a blob of step 3 too: no host holds it; status names the blob. Step 3 is still
        # what a restore takes if it has a backup, or if a backup of another step holds the same bytes
        # (blobs are named by content: here step 1's columns 2-3 + 1 are step 3's columns 0-1 + 3).
        (twin / "blobs" / blob).unlink()
        st = _status(capsys, *args)
        rows = {r["step"]: r for r in st["steps"]}
        in_backup = bool(rows[3]["backups"]) or (backup / "r" / "mtc" / "blobs" / blob).exists()
        assert f"blob {blob[:12]}.. on no host" in rows[3]["why_not"]
        assert st["choice"] == (3 if in_backup else 2), (st["reason"], rows[3])
        with CheckpointManager(cfg.replace(prefetch_on_start=False)) as m:  # the restore's own choice, the same
            assert m.latest_step() == st["choice"]

        # A pinned backup wins, whatever the hosts hold.
        name = backups[-1]["name"]
        assert main(["restore-version", "set", name, "--base-output-directory", str(backup), "--run-name", "r"]) == 0
        capsys.readouterr()
        st = _status(capsys, *args)
        assert st["restore_version"] == name and st["choice"] == backups[-1]["step"] and "pins" in st["reason"]
        assert main(["status", *args]) == 0  # the table renders
        out = capsys.readouterr().out
        assert "restore would choose" in out and name in out


def test_status_of_a_stopped_job_and_bad_input(tmp_path, capsys):
    ram = tmp_path / "ram"
    mesh = Mesh(np.array(jax.devices()), ("x",))
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ram), local_checkpoint_period=1)) as m:
        m.save(5, {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("x")))})
    st = _status(capsys, "--local-checkpoint-directory", str(ram))
    assert [r["step"] for r in st["steps"]] == [5] and st["choice"] == 5
    assert main(["status"]) == 2 and "--cluster-spec" in capsys.readouterr().err
    assert main(["status", "--local-checkpoint-directory", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "holds no mtc ramdisk" in err and "a host whose ramdisk was lost" in err and "Traceback" not in err


def test_a_stopped_multi_host_job_is_read_with_the_host_ids_its_folders_hold(tmp_path, capsys, monkeypatch):
    """The folders of a stopped 2 x 2 job, named in any order and not after their hosts: status sees
    the newest step on every host (not 'does not match the manifest'), and an export reads it."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sh = NamedSharding(mesh, P(None, "model"))
    with LocalCluster(tmp_path / "c", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(tmp_path / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1)
        with CheckpointManager(cfg) as m:
            for step in (1, 2):
                m.save(step, {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sh)})
                m.wait_until_finished()
        folders = {h: cluster.ramdisk(h) for h in cluster.hosts}
    renamed = []
    for i, (h, d) in enumerate(sorted(folders.items(), reverse=True)):  # reversed, and named folder-N
        renamed.append(d.rename(tmp_path / f"folder-{i}"))
    st = _status(capsys, "--local-checkpoint-directory", *map(str, renamed))
    rows = {r["step"]: r for r in st["steps"]}
    assert rows[2]["hosts"] == sorted(folders) and rows[2]["restorable"] and rows[2]["min_copies"] == 2, st
    assert st["choice"] == 2 and "from the hosts" in st["reason"] and not st["notes"], st
    # Slices too: a copy on the twin in the other slice counts as a copy in another failure domain.
    assert rows[2]["replicated"] and rows[2]["min_copies"] == 2
    # --verify: a host that committed a record cannot fetch the manifest from the keepers of the stopped job
    # (their addresses were the job's); it hashes its own part's blobs, and a flipped byte there is found.
    records = {}
    for d in renamed:
        rec = fmt.CommitRecord.parse((d / "mtc" / "steps" / f"{2:012d}.json").read_bytes())
        if rec is not None:
            records[rec.host_manifest().host] = (d, sorted(rec.host_manifest().blob_names()))
    assert records, "no host committed a record of step 2"
    host, (d, blobs) = sorted(records.items())[0]
    path = d / "mtc" / "blobs" / blobs[0]
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))
    st = _status(capsys, "--local-checkpoint-directory", *map(str, renamed), "--verify")
    rows = {r["step"]: r for r in st["steps"]}
    assert f"blob {blobs[0][:12]}.. corrupt on {host}" in rows[2]["why_not"], rows[2]
    assert any(n.startswith(f"{host} hashed its own part's blobs only") for n in st["notes"]), st["notes"]
    assert not any("could not hash" in n for n in st["notes"]), st["notes"]
    path.write_bytes(bytes(data[:3]) + bytes([data[3] ^ 0x01]) + bytes(data[4:]))  # repaired
    from mtc.head.tools.sources import folder_hosts

    # Each folder names its host (host.json): the step files' headers tell the slices, no whole manifest is read.
    whole = []
    real = fmt.StepManifest.from_json
    monkeypatch.setattr(fmt.StepManifest, "from_json", lambda *a, **k: whole.append(1) or real(*a, **k))
    want = [("s0-h0", 0), ("s0-h1", 0), ("s1-h0", 1), ("s1-h1", 1)]
    assert sorted((h, sl) for h, _, sl in folder_hosts(map(str, renamed))) == want
    assert not whole, "folder_hosts read a whole step manifest of folders that name their hosts"
    # Without the notes (an older mtc), the commit records and the keepers' parts tell them all the same.
    notes = {d: (d / "mtc" / "host.json").read_bytes() for d in renamed}
    for d in renamed:
        (d / "mtc" / "host.json").unlink()
    assert sorted((h, sl) for h, _, sl in folder_hosts(map(str, renamed))) == want
    assert whole
    monkeypatch.undo()
    for d, note in notes.items():
        (d / "mtc" / "host.json").write_bytes(note)
    assert main(["export", "--to", str(tmp_path / "out"), "--verify", "--local-checkpoint-directory",
                 *map(str, renamed)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    # Named by hand, a folder's id is taken as given; one given twice is refused.
    assert main(["status", "--local-checkpoint-directory", f"s0-h0={renamed[0]}", f"s0-h0={renamed[1]}"]) == 2
    assert "two folders hold host s0-h0" in capsys.readouterr().err


def test_status_names_the_step_a_restore_takes_when_lost_blobs_are_in_an_older_backup(ramdisk, tmp_path, capsys):
    """`mtc status` asks the restore's own choice (Restorer.choose_step): a step whose blobs that no
    host holds are all in the backup of an older step (an array that did not change) is whole, and
    restore takes it. Status once kept its own copy of the choice, without that rule, and named the
    older backup's step."""
    from helpers import random_array
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher

    frozen = random_array(np.random.default_rng(1), (8, 512), np.float32)
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices), ("x",))

    def state(step: int) -> dict:
        w = random_array(np.random.default_rng(step), (64, 64), np.float32)
        return {"frozen": jax.device_put(frozen, NamedSharding(mesh, P("x"))),
                "w": jax.device_put(w, NamedSharding(mesh, P()))}

    backup = tmp_path / "backup"
    with LocalCluster(ramdisk / "cluster", 2, 1, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(backup), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=100, replication_factor=1)
        with CheckpointManager(cfg) as m:
            m.save(1, state(1))
            m.wait_until_finished()
            assert m.wait_for_backup().step == 1
            m.save(2, state(2))  # only "w" changed
            m.wait_until_finished()
        cluster.kill("s1-h0")  # slice 1 lost: its half of "frozen" is only in the backup of step 1
        spec = json.loads(cluster.spec_path.read_text())
        sub = tmp_path / "slice0.json"
        sub.write_text(json.dumps({**spec, "hosts": [h for h in spec["hosts"] if h["slice"] == 0]}))
        st = _status(capsys, "--cluster-spec", str(sub), "--base-output-directory", str(backup), "--run-name", "r")
        small = cfg.replace(cluster_spec=str(sub), prefetch_on_start=False)
        with CheckpointManager(small, dispatcher=ClusterDispatcher(small, devices=devices[:4])) as m:
            assert m.latest_step() == 2
        rows = {r["step"]: r for r in st["steps"]}
        assert st["choice"] == 2, (st["reason"], rows)
        assert rows[2]["restorable"] and "backups of other steps" in rows[2]["why_not"], rows[2]
