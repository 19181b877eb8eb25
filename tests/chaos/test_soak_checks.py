"""The soak's backup check against real retention: a backup pruned while the soak looks (its manifest
goes first, its blobs after: ``BackupTier._retain``) is not a violation; a listed backup that lacks a
blob is, whenever the soak looks."""

from __future__ import annotations

import numpy as np
import pytest

import soak
from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.hashing import blob_name
from mtc.sidecar.backup.tier import BackupTier
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.chaos


def _finalize(tier: BackupTier, step: int, keep: int) -> tuple[str, str]:
    """Back up a one-array step (its blob uploaded first); (backup name, blob)."""
    data = np.random.default_rng(step).standard_normal(256).astype(np.float32).tobytes()
    blob = blob_name(data)
    tier._store.put_bytes(layout.blob_object(blob), data)
    shard = fmt.ShardRecord(box=((0, 256),), blob=blob, nbytes=len(data), devices=(0,))
    m = fmt.StepManifest(step=step, arrays=(fmt.ArrayRecord(key="w", kind="numpy", dtype="float32", shape=(256,),
                                                            shards=(shard,)),), tree=None)
    name = layout.backup_name(step)
    tier.finalize(name, m.to_json(), keep)
    return name, blob


@pytest.fixture
def checked(tmp_path):
    root = tmp_path / "backup"
    tier = BackupTier(str(root), RamStore(tmp_path / "ram"), "h0")
    s = soak.Soak(1, tmp_path)
    s.backup = soak.BackupView("local", root=root)
    s.corrupt = set()
    return s, tier


def test_a_backup_pruned_while_the_soak_checks_is_not_a_violation(checked, monkeypatch):
    s, tier = checked
    for step in (1, 2, 3):
        _finalize(tier, step, keep=3)
    listed = s.backup.list

    def list_then_prune(sub: str) -> list[str]:
        if sub == "blobs" and not pruned:  # between the soak's two listings, the next backup's retention
            pruned.append(_finalize(tier, 4, keep=1))
        return listed(sub)

    pruned: list = []
    monkeypatch.setattr(s.backup, "list", list_then_prune)
    s._check_backups()
    assert pruned and s.notes == {"a backup was pruned while the soak checked it": 3}


def test_a_listed_backup_without_its_blob_is_a_violation(checked):
    s, tier = checked
    for step in (1, 2):
        name, blob = _finalize(tier, step, keep=3)
    tier._store.delete(layout.blob_object(blob))
    with pytest.raises(soak.Violation, match=f"backup {name}.json is listed without its blobs"):
        s._check_backups()


def test_a_soak_given_only_classes_it_cannot_draw_says_why_and_stops():
    """``--only gcs_outage`` on local segments alone: no trial can run. It said ``min() arg is an empty
    sequence`` (or, with a trial count, would never end); now it names each class and what it needs."""
    with pytest.raises(soak.CannotDraw, match="gcs_outage needs a GCS segment"):
        soak.run_soak(3, trials=2, trials_per_segment=2, segments=[((1, 2), "local")], only=["gcs_outage"],
                      out=lambda m: None)
