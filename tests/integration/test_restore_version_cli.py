"""`mtc restore-version show | set NAME | clear` against a real backup root."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from mtc.head import CheckpointManager, MTCConfig
from mtc.head.tools.cli.main import main
from mtc.shared import backup_layout
from mtc.shared.objstore import ObjectNotFoundError, open_store

pytestmark = pytest.mark.integration


def test_show_set_clear(ramdisk, tmp_path, capsys):
    base = str(tmp_path / "bucket")
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1, base_output_directory=base, run_name="r",
                    multi_tier_checkpointing_backup_interval_steps=1)
    with CheckpointManager(cfg) as m:
        for s in (1, 2):
            m.save(s, {"x": jnp.arange(8.0) + s})
            m.wait_until_finished()
            m.wait_for_backup()
        names = [b["name"] for b in m.backups()]
    flags = ["--base-output-directory", base, "--run-name", "r"]
    assert main(["restore-version", "show", *flags]) == 0
    out = capsys.readouterr().out
    assert names[0] in out and names[1] in out and "not set" in out

    assert main(["restore-version", "set", names[1], *flags]) == 0
    st = open_store(f"{base}/r/mtc")
    assert st.get_bytes(backup_layout.RESTORE_VERSION).decode().strip() == names[1]
    with CheckpointManager(cfg) as m:
        assert m.latest_step() == 1
        assert float(m.restore()["x"][0]) == 1.0

    assert main(["restore-version", "set", "20990101T000000Z-step-000000000007", *flags]) == 2
    assert "no backup" in capsys.readouterr().err
    assert main(["restore-version", "set", "bogus", *flags]) == 2
    assert "not a backup name" in capsys.readouterr().err
    # A failed set leaves the pin as it was.
    assert st.get_bytes(backup_layout.RESTORE_VERSION).decode().strip() == names[1]

    assert main(["restore-version", "clear", *flags]) == 0
    with pytest.raises(ObjectNotFoundError):
        st.get_bytes(backup_layout.RESTORE_VERSION)
    assert main(["restore-version", "show"]) == 2  # no backup root given
    assert "base_output_directory" in capsys.readouterr().err
