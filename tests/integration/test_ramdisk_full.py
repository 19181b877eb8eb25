"""A size-limited tmpfs that cannot hold the next step: a clear error before any byte."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import InsufficientSpaceError, SaveError

pytestmark = pytest.mark.integration


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_step_that_does_not_fit_fails_before_writing(tmpfs16):
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    rng = np.random.default_rng(0)
    small = {"w": jax.device_put(rng.standard_normal(1 << 20, dtype=np.float32), sh)}  # 4 MiB
    big = {"w": jax.device_put(rng.standard_normal(5 << 20, dtype=np.float32), sh)}  # 20 MiB
    cfg = MTCConfig(local_checkpoint_directory=str(tmpfs16), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1, local_max_to_keep=2)
    with CheckpointManager(cfg) as m:
        m.save(1, small)
        m.wait_until_finished()
        before = _files(tmpfs16 / "mtc")
        m.save(2, big)
        with pytest.raises(SaveError) as e:
            m.wait_until_finished()
        cause = e.value.__cause__
        assert isinstance(cause, InsufficientSpaceError)
        msg = str(e.value)
        assert "step 2" in msg and "mtc size" in msg and "MiB" in msg
        # Nothing partial: the files are exactly those of step 1 (no blob, no temp, no pending).
        after = {k: v for k, v in _files(tmpfs16 / "mtc").items()}
        assert after == before
        assert m.all_steps() == [1]
        assert_trees_bitwise_equal(small, m.restore(1))
        # Training goes on: the next step that fits saves fine.
        m.save(3, {"w": small["w"] + 1})
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
