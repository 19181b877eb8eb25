"""More of what a new user tripped over in the CLI, on real daemons and folders: read-only commands
create nothing and say when a root does not exist; a damaged backup is not pinned; ``status --verify``
says what it hashed and where a copy is corrupt."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig
from mtc.head.tools.cli.main import main
from mtc.sidecar.local_cluster import LocalCluster
from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt

pytestmark = pytest.mark.integration


def _tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A 2 x 2 cluster of twins with steps 1..2 saved, replicated and backed up; the cluster stays up."""
    tmp = tmp_path_factory.mktemp("job")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sh = NamedSharding(mesh, P(None, "model"))
    with LocalCluster(tmp / "c", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(tmp / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=str(tmp / "backup"), run_name="r",
                        multi_tier_checkpointing_backup_interval_steps=1)
        with CheckpointManager(cfg) as m:
            for step in (1, 2):
                m.save(step, {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sh)})
                m.wait_until_finished()
            m.wait_for_backup()
            m.wait_for_replication()
        yield tmp, cluster


def test_read_only_commands_create_no_folder_and_say_the_root_does_not_exist(job, tmp_path, capsys):
    tmp, cluster = job
    spec = ["--cluster-spec", str(cluster.spec_path)]
    missing = tmp_path / "nonexistent"
    for base, run in ((str(missing), "demo"), (str(tmp / "backup"), "typo"), (str(tmp / "backup"), "")):
        before = _tree(tmp / "backup")
        rc = main(["status", *spec, "--base-output-directory", base, *(["--run-name", run] if run else [])])
        out, err = capsys.readouterr()
        assert rc == 1 and "does not exist" in err and "--run-name" in err and "Traceback" not in err, err
        assert (out + err).count("does not exist") == 1, out + err  # said once, not in the reason too
        assert "restore would choose" in out  # the hosts' steps are still shown
        assert not missing.exists() and _tree(tmp / "backup") == before
    (tmp_path / "empty" / "r" / "mtc").mkdir(parents=True)  # a root that exists and holds nothing: a note
    assert main(["status", *spec, "--base-output-directory", str(tmp_path / "empty"), "--run-name", "r"]) == 0
    assert "holds no backup" in " ".join(capsys.readouterr().out.split())  # the table may wrap the note
    before = _tree(tmp / "backup")
    for cmd in (["export", "--to", str(tmp_path / "out"), *spec], ["verify", "--backup", *spec],
                ["export", "--to", str(tmp_path / "out")]):
        rc = main([*cmd, "--base-output-directory", str(tmp / "backup"), "--run-name", "typo"])
        err = capsys.readouterr().err
        assert rc == 1 and "does not exist" in err and "--run-name" in err and "Traceback" not in err, (cmd, err)
    assert main(["restore-version", "show", "--base-output-directory", str(missing), "--run-name", "r"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not missing.exists() and _tree(tmp / "backup") == before and not (tmp_path / "out").exists()


def test_status_verify_says_what_it_hashed_and_where_a_copy_is_corrupt(job, capsys):
    tmp, cluster = job
    args = ["status", "--cluster-spec", str(cluster.spec_path)]
    assert main([*args, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify:" in out and "none corrupt" in out, out
    twin = cluster.ramdisk("s0-h0") / "mtc"
    m = fmt.StepManifest.from_json((twin / "steps" / f"{2:012d}.json").read_bytes())
    blob = next(s.blob for a in m.arrays for s in a.shards if 0 in s.devices)
    path = twin / "blobs" / blob
    good = path.read_bytes()
    path.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    try:
        assert main([*args, "--verify", "--json"]) == 0
        row = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}[2]
        assert not row["replicated"] and row["min_copies"] == 1, row
        assert main([*args, "--verify"]) == 0
        out = capsys.readouterr().out
        # The marker and the corruption in columns of their own, each with a header.
        assert re.search(r"restore\s+┃\s+notes\s+┃", out), out
        assert re.search(r"<- restore\s+│\s+blob \w+\.\. corrupt", out), out
        assert "1 corrupt" in out, out
    finally:
        path.write_bytes(good)


def test_a_damaged_backup_is_not_pinned_and_status_says_it_is_damaged(job, tmp_path, capsys):
    import shutil

    tmp, _ = job
    root = tmp_path / "r" / "mtc"
    shutil.copytree(tmp / "backup" / "r" / "mtc", root)
    names = layout.names_from_listing([str(p.relative_to(root)) for p in (root / "backups").rglob("*")])
    bad = names[0]
    (root / layout.damaged_object(bad)).parent.mkdir(exist_ok=True)
    (root / layout.damaged_object(bad)).write_text(json.dumps({"why": "blob x fails its hash"}))
    assert main(["restore-version", "set", bad, "--backup-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "damaged" in err and bad in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (root / layout.RESTORE_VERSION).exists()
    # A pin written before the backup was found damaged: status says it is damaged, and exits 1.
    (root / layout.RESTORE_VERSION).write_text(bad + "\n")
    ram = tmp_path / "ram"
    mesh = Mesh(np.array(jax.devices()), ("x",))
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ram), local_checkpoint_period=1)) as m:
        m.save(5, {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("x")))})
    assert main(["status", "--local-checkpoint-directory", str(ram), "--base-output-directory", str(tmp_path),
                 "--run-name", "r"]) == 1
    out, err = capsys.readouterr()
    assert "damaged" in out and "does not exist" not in out + err, out + err
