"""A backup store that answers its listing late or with an error (a store under load) never reads as
"there are no backups": an elastic restore onto new hosts, whose only copy is the backup, retries the
listing (bounded) and restores bit for bit; a listing that keeps failing is an error naming the backup
root and the cause, in latest_step, all_steps, restore, the start-up pull and `mtc status`.

Found under load: the start-up pull's listing failed, and every later listing of that head got only
the outage's short retry deadline and failed too; the failed listing came back as an empty one, so a
restore onto new hosts said "step 3 is not committed on every host, and not every blob of it has a
copy on some host or in a backup; committed steps: []" with the backup complete."""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mtc.head.restore.restorer as restorer_mod
from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.tools.cli.main import main
from mtc.shared.errors import BackupListingError
from mtc.sidecar.local_cluster import LocalCluster
from slow_store_sidecar import launch_with, set_control

pytestmark = pytest.mark.integration


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    return {"w": jax.device_put(rng.standard_normal(1 << 16, dtype=np.float32), sh),
            "b": jax.device_put(rng.standard_normal((8, 64), dtype=np.float32), sh)}


def target() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))


def test_a_store_that_answers_its_listing_late_or_with_an_error_is_never_read_as_no_backups(
        ramdisk, tmp_path, capsys, caplog, monkeypatch):
    bucket = tmp_path / "bucket"
    backup = {"base_output_directory": str(bucket), "run_name": "run",
              "multi_tier_checkpointing_backup_interval_steps": 1}
    with LocalCluster(ramdisk / "old", 2, 2, devices_per_host=2) as old:
        cfg = MTCConfig(local_checkpoint_directory=str(old.root), cluster_spec=str(old.spec_path),
                        local_checkpoint_period=1, **backup)
        with CheckpointManager(cfg) as m:
            for step in (1, 2, 3):
                m.save(step, state(step))
                m.wait_until_finished()
                assert m.wait_for_backup().error is None
    # The old hosts are gone. New hosts (another layout: 2 hosts of 4 devices), empty ramdisks: the
    # backup is the only copy of step 3. Their store answers its listings late, and the first two fail.
    control = tmp_path / "store-control.json"
    set_control(control, delay_s=1.0, fail=2)
    with LocalCluster(ramdisk / "new", 1, 2, devices_per_host=4, launch=launch_with(control)) as new:
        cfg = MTCConfig(local_checkpoint_directory=str(new.root), cluster_spec=str(new.spec_path),
                        local_checkpoint_period=1, **backup)
        with CheckpointManager(cfg) as m:  # the start-up pull lists first (fails), then restore() lists
            assert_trees_bitwise_equal(state(3), m.restore(3, target=target()))
            assert m.last_restore_report.bytes_by_tier["backup"] == sum(x.nbytes for x in state(3).values())
        assert json.loads(control.read_text())["fail"] == 0  # both failures were seen, and retried

        # The store keeps failing, and the new hosts lose their ramdisks: nothing says "no backups".
        monkeypatch.setattr(restorer_mod, "LISTING_DEADLINE_S", 3.0)  # the bounded retry, shortened
        set_control(control, delay_s=0.5, fail=10**6)
        for h in new.hosts:
            new.wipe(h)
            new.restart(h)
        caplog.set_level(logging.INFO)
        root = cfg.backup_root
        with CheckpointManager(cfg) as m:
            assert m.wait_for_prefetch() is None
            skipped = [r.getMessage() for r in caplog.records if "start-up pull skipped" in r.getMessage()]
            assert skipped and "BackupListingError" in skipped[0] and root in skipped[0], skipped
            assert any(r.levelno == logging.WARNING for r in caplog.records if "start-up pull skipped" in r.getMessage())
            for call in (m.latest_step, m.all_steps, lambda: m.restore(3, target=target()), lambda: m.restore()):
                t0 = time.monotonic()
                with pytest.raises(BackupListingError) as e:
                    call()
                assert time.monotonic() - t0 < 30, "the retry of the listing is not bounded"
                msg = str(e.value)
                assert root in msg and "could not be listed" in msg and "TransientStoreError" in msg, msg
                assert "committed steps: []" not in msg, msg
                assert e.value.root == root and "ReadTimeout" in e.value.cause

            args = ["status", "--cluster-spec", str(new.spec_path), "--base-output-directory", str(bucket),
                    "--run-name", "run", "--json"]
            assert main(args) == 1  # the answer may be wrong: the backups are not known
            out = capsys.readouterr()
            st = json.loads(out.out)
            assert st["backup_error"] and "TransientStoreError" in st["backup_error"], st
            assert root in st["reason"] and "could not be listed" in st["reason"], st
            assert st["choice"] is None and "could not be listed" in out.err, out.err

            # The store answers again (late): the same manager finds step 3 in the backup.
            set_control(control, delay_s=1.0, fail=0)
            assert m.latest_step() == 3
            assert_trees_bitwise_equal(state(3), m.restore(3, target=target()))
            assert main(args) == 0
            st = json.loads(capsys.readouterr().out)
            assert st["backup_error"] is None and st["choice"] == 3, st
