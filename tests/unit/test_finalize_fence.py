"""The backup finalize's fence (sidecar/backup/fence.py) on a real local store: a marker that no
finalize keeps alive (a dead one, a planted one of any generation) holds the next one up for at most
DEAD_AFTER_S and stops none, a live older finalize is waited for, an older finalize stops beside a live
newer one, one that cannot keep its marker alive stops, and a backup name is written once. The race
itself, with real daemons: tests/integration/test_finalize_race.py; dead and planted markers with real
daemons: tests/integration/test_finalize_dead_markers.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.errors import BackupSupersededError, ManifestError
from mtc.shared.hashing import blob_name
from mtc.shared.job_key import JobKey
from mtc.shared.objstore.local import LocalStore
from mtc.shared.objstore.store import TransientStoreError
from mtc.sidecar.backup import fence
from mtc.sidecar.backup.tier import BackupTier
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.unit


# The job's key, explicit: a process that ran a local cluster has a job token in its environment, and
# the default key comes from it.
KEY = JobKey.from_secret("finalize-fence-test-token")


def _tier(tmp_path, host: str = "h0") -> BackupTier:
    return BackupTier(str(tmp_path / "bucket"), RamStore(tmp_path / f"ram-{host}"), host, key=KEY)


def _plant(tier: BackupTier, obj: str) -> None:
    """A marker this job signed that no finalize keeps alive (one whose finalize died)."""
    tier._store.put_bytes(obj, fence.signed_doc(KEY, obj, {"beat": 0}))


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
    _plant(tier, _marker(name, "h0"))  # its daemon was killed in the middle of a finalize
    _plant(tier, _marker(name, "h1"))  # another host's: not this one's to judge
    tier.upload([])
    assert tier._store.list(layout.FINALIZING) == [_marker(name, "h1")]


def test_an_older_marker_that_no_finalize_keeps_alive_is_removed_after_dead_after_s(tmp_path, monkeypatch):
    monkeypatch.setattr(fence, "DEAD_AFTER_S", 0.6)
    tier = _tier(tmp_path)
    old, _ = _backup(tier, 1, when=time.time() - 60)
    _plant(tier, _marker(old, "h1"))  # h1 died in its finalize and never came back
    name, manifest = _backup(tier, 2)
    t0 = time.monotonic()
    assert tier.finalize(name, manifest, 2)["created"]
    assert 0.6 <= time.monotonic() - t0 < 5  # it watched the older one until it was known to be dead
    assert tier.list_names() == [name] and tier._store.list(layout.FINALIZING) == []


def _live(tier: BackupTier, name: str, host: str, generation: int) -> fence.FinalizeFence:
    """A running finalize of ``name`` on ``host``: announced, beating until released."""
    f = fence.FinalizeFence(tier._store, tier._store, name, host, generation, key=KEY)
    f.announce()
    return f


def test_a_live_older_finalize_is_waited_for_beyond_dead_after_s_until_it_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(fence, "DEAD_AFTER_S", 1.0)
    tier = _tier(tmp_path)
    old, _ = _backup(tier, 3)
    older = _live(tier, old, "h1", 7)
    name, manifest = _backup(tier, 4)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(tier.finalize(name, manifest, 2, generation=7)))
    t.start()
    time.sleep(2.5)  # past DEAD_AFTER_S: the older one beats, so it is still waited for
    assert t.is_alive() and tier.list_names() == []
    older.release()
    t.join(timeout=10)
    assert out["created"] and tier.list_names() == [name] and tier._store.list(layout.FINALIZING) == []


def test_an_older_finalize_stops_beside_a_live_newer_one_and_makes_nothing_visible(tmp_path):
    tier = _tier(tmp_path)
    newer, _ = _backup(tier, 5)
    running = _live(tier, newer, "h1", 7)  # the head's next finalize, on h1
    try:
        name, manifest = _backup(tier, 4)
        with pytest.raises(BackupSupersededError, match=f"finalize of backup {name} on host h0 did not start: the "
                                                        f"finalize of backup {newer} on host h1"):
            tier.finalize(name, manifest, 2, generation=7)
        assert tier.list_names() == []  # not made visible
        assert tier._store.list(layout.FINALIZING) == [running.me.obj]  # its own marker gone
    finally:
        running.release()


def test_an_older_heads_finalize_of_a_later_step_does_not_stop_a_newer_heads(tmp_path, monkeypatch):
    monkeypatch.setattr(fence, "DEAD_AFTER_S", 0.5)
    tier = _tier(tmp_path)
    old, _ = _backup(tier, 9)
    _plant(tier, _marker(old, "h1", generation=3))  # a head since replaced, at step 9
    name, manifest = _backup(tier, 4)  # the new head restored step 4 and backs it up
    assert tier.finalize(name, manifest, 2, generation=4)["created"]


PLANTED = f"{layout.FINALIZING}99999999999999999999.99991231T235959Z-step-999999999999.h9.{'c' * 12}.{'d' * 12}"


def test_a_planted_marker_of_a_huge_generation_stops_no_backup(tmp_path, monkeypatch):
    """A file under finalizing/ that no finalize keeps alive (planted, or left by a head whose clock ran
    ahead): the next backups go through, and the marker is removed once it is known to be dead."""
    monkeypatch.setattr(fence, "DEAD_AFTER_S", 0.6)
    tier = _tier(tmp_path)
    _plant(tier, PLANTED)
    for step in (1, 2, 3):
        name, manifest = _backup(tier, step)
        assert tier.finalize(name, manifest, 2, generation=5)["created"]
    assert len(tier.list_names()) == 2 and tier._store.list(layout.FINALIZING) == []


def test_a_marker_of_a_generation_beyond_its_own_stops_a_running_finalize_only_if_it_beats(tmp_path, monkeypatch):
    monkeypatch.setattr(fence, "CHECK_EVERY_S", 0.0)
    tier = _tier(tmp_path)
    name, _ = _backup(tier, 4)
    f = fence.FinalizeFence(tier._store, tier._store, name, "h0", 5, key=KEY)
    f.announce()
    try:
        f.wait_turn()
        _plant(tier, PLANTED)  # appears while it runs: never rewritten
        for _ in range(6):
            f.check()
            time.sleep(0.3)
        newer, _ = _backup(tier, 5)
        other = _live(tier, newer, "h1", 6)  # a newer head's finalize, on a host this head no longer reaches
        try:
            with pytest.raises(BackupSupersededError, match=f"the finalize of backup {newer} on host h1 .* started"):
                for _ in range(10):
                    f.check()
                    time.sleep(0.3)
        finally:
            other.release()
    finally:
        f.release()


class _FailingPuts(LocalStore):
    """The local store, whose rewrites of existing objects fail once ``fail`` is set (a bucket the beats
    cannot reach)."""

    fail = False

    def put_bytes(self, name, data, *, if_absent=False):
        if self.fail:
            raise TransientStoreError(f"{name}: the store did not answer")
        return super().put_bytes(name, data, if_absent=if_absent)


def test_a_finalize_whose_marker_cannot_be_kept_alive_stops_before_others_take_it_for_dead(tmp_path, monkeypatch):
    tier = _tier(tmp_path)
    name, _ = _backup(tier, 4)
    plain = _FailingPuts(str(tmp_path / "bucket"))
    f = fence.FinalizeFence(tier._store, plain, name, "h0", 5, key=KEY)
    f.announce()
    try:
        f.wait_turn()
        f.check()
        plain.fail = True
        t0 = time.monotonic()
        with pytest.raises(BackupSupersededError, match="could not be kept alive"):
            while time.monotonic() - t0 < 10:
                f.check()
                time.sleep(0.1)
        assert fence.LEASE_S <= time.monotonic() - t0 < fence.DEAD_AFTER_S  # before anyone takes it for dead
        plain.fail = False
        with pytest.raises(BackupSupersededError, match="could not be kept alive"):
            f.check()  # for good: a beat that gets through later renews nothing
    finally:
        f.release()
    assert tier._store.list(layout.FINALIZING) == []


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


def test_a_marker_the_job_did_not_sign_is_no_finalize_it_holds_up_nothing_and_is_counted(tmp_path, monkeypatch):
    """With a job key, an unsigned marker (anyone who can write the bucket can plant one, and keep it
    changing so that it looks alive) is never waited for and stops nothing; it is counted, not removed."""
    from mtc.shared import job_key

    monkeypatch.setattr(fence, "DEAD_AFTER_S", 30.0)
    tier = _tier(tmp_path)
    tier._store.put_bytes(PLANTED, b'{"beat": 1}')
    before = job_key.rejected_counts().get(fence.KIND, 0)
    t0 = time.monotonic()
    for step in (1, 2):
        name, manifest = _backup(tier, step)
        assert tier.finalize(name, manifest, 2, generation=5)["created"]
        tier._store.put_bytes(PLANTED, f'{{"beat": {step + 1}}}'.encode())  # "alive"
    assert time.monotonic() - t0 < 10  # not waited for DEAD_AFTER_S
    assert len(tier.list_names()) == 2 and tier._store.list(layout.FINALIZING) == [PLANTED]
    assert job_key.rejected_counts()[fence.KIND] > before
