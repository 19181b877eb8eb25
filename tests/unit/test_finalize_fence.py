"""The backup finalize's fence (sidecar/backup/fence.py) on a real local store: markers that dead
finalizes leave do not hold the next one up for ever, an older finalize stops beside a newer one, and a
backup name is written once. The race itself, with real daemons: tests/integration/test_finalize_race.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.errors import BackupSupersededError, ManifestError
from mtc.shared.hashing import blob_name
from mtc.sidecar.backup import fence
from mtc.sidecar.backup.tier import BackupTier
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.unit


def _tier(tmp_path, host: str = "h0") -> BackupTier:
    return BackupTier(str(tmp_path / "bucket"), RamStore(tmp_path / f"ram-{host}"), host)


def _backup(tier: BackupTier, step: int, seed: int = 0, when: float | None = None) -> tuple[str, bytes]:
    """A one-array step whose blob is in the store: (backup name, manifest)."""
    data = np.random.default_rng([step, seed]).standard_normal(256).astype(np.float32).tobytes()
    blob = blob_name(data)
    tier._store.put_bytes(layout.blob_object(blob), data)
    shard = fmt.ShardRecord(box=((0, 256),), blob=blob, nbytes=len(data), devices=(0,))
    m = fmt.StepManifest(step=step, arrays=(fmt.ArrayRecord(key="w", kind="numpy", dtype="float32", shape=(256,),
                                                            shards=(shard,)),), tree=None)
    return layout.backup_name(step, when), m.to_json()


def _marker(name: str, host: str, process: str = "a" * 12, generation: int = 0) -> str:
    return f"{layout.FINALIZING}{generation:020d}.{name}.{host}.{process}.{'b' * 12}"


def test_a_marker_left_by_an_earlier_process_of_this_host_goes_at_its_first_upload(tmp_path):
    tier = _tier(tmp_path)
    name, _ = _backup(tier, 1)
    tier._store.put_bytes(_marker(name, "h0"), b"{}")  # its daemon was killed in the middle of a finalize
    tier._store.put_bytes(_marker(name, "h1"), b"{}")  # another host's: not this one's to judge
    tier.upload([])
    assert tier._store.list(layout.FINALIZING) == [_marker(name, "h1")]


def test_an_older_finalize_that_never_ends_is_taken_for_dead_and_the_next_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(fence, "ABANDONED_AFTER_S", 0.5)
    tier = _tier(tmp_path)
    old, _ = _backup(tier, 1, when=time.time() - 60)
    tier._store.put_bytes(_marker(old, "h1"), b"{}")  # h1 died in its finalize and never came back
    name, manifest = _backup(tier, 2)
    t0 = time.monotonic()
    assert tier.finalize(name, manifest, 2)["created"]
    assert time.monotonic() - t0 >= 0.5  # it waited for the older one first
    assert tier.list_names() == [name] and tier._store.list(layout.FINALIZING) == []


def test_an_older_finalize_stops_beside_a_newer_one_and_makes_nothing_visible(tmp_path):
    tier = _tier(tmp_path)
    newer, _ = _backup(tier, 5)
    tier._store.put_bytes(_marker(newer, "h1", generation=7), b"{}")  # the head's next finalize, on h1
    name, manifest = _backup(tier, 4)
    with pytest.raises(BackupSupersededError, match=f"finalize of backup {name} on host h0 stopped: the finalize of "
                                                    f"backup {newer} on host h1"):
        tier.finalize(name, manifest, 2, generation=7)
    assert tier.list_names() == []  # not made visible
    assert tier._store.list(layout.FINALIZING) == [_marker(newer, "h1", generation=7)]  # its own marker gone


def test_an_older_heads_finalize_of_a_later_step_does_not_stop_a_newer_heads(tmp_path, monkeypatch):
    monkeypatch.setattr(fence, "ABANDONED_AFTER_S", 0.5)
    tier = _tier(tmp_path)
    old, _ = _backup(tier, 9)
    tier._store.put_bytes(_marker(old, "h1", generation=3), b"{}")  # a head since replaced, at step 9
    name, manifest = _backup(tier, 4)  # the new head restored step 4 and backs it up
    assert tier.finalize(name, manifest, 2, generation=4)["created"]


def test_a_backup_name_is_written_once(tmp_path):
    tier = _tier(tmp_path)
    name, manifest = _backup(tier, 3)
    assert tier.finalize(name, manifest, 2)["created"]
    again = tier.finalize(name, manifest, 2)  # the same backup again (a retry): nothing changes
    assert not again["created"] and tier.list_names() == [name]
    _, other = _backup(tier, 3, seed=1)  # another state of step 3 under the same name
    with pytest.raises(ManifestError, match=f"backup {name} is already in .* with another manifest"):
        tier.finalize(name, other, 2)
    assert tier.manifest(name) == manifest
