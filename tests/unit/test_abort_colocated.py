"""Colocated mode: a save that fails between phase 1 and phase 2 leaves nothing visible, and
nothing behind after the next save (the sidecar service aborts it, as in cluster mode)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import InjectedFaultError, SaveError
from mtc.shared import format as fmt

pytestmark = pytest.mark.unit


def _state(seed):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), NamedSharding(mesh, P("x")))}


def test_failure_before_commit_is_aborted(ramdisk, monkeypatch):
    root = ramdisk / "mtc"
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        m.save(1, _state(1))
        m.wait_until_finished()
        monkeypatch.setenv("MTC_FAIL_AT", "before_commit")  # phase 1 done; the commit fails
        m.save(2, _state(2))
        with pytest.raises(SaveError) as info:
            m.wait_until_finished()
        assert isinstance(info.value.__cause__, InjectedFaultError) or "injected failure" in str(info.value)
        monkeypatch.delenv("MTC_FAIL_AT")
        assert m.all_steps() == [1]
        assert not (root / "pending" / f"{2:012d}").exists()  # aborted at once, not left for later
        m.save(3, _state(3))
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
        assert_trees_bitwise_equal(_state(3), m.restore(3))
    kept = set()
    for s in (1, 3):
        kept |= fmt.StepManifest.from_json((root / "steps" / f"{s:012d}.json").read_bytes()).blob_names()
    on_disk = {p.name for p in (root / "blobs").iterdir() if not p.name.startswith(".")}
    assert on_disk == kept  # nothing of step 2 behind
    assert sorted(p.name for p in (root / "pending").iterdir()) == []


def test_service_inventory_share_and_per_box_fallback(ramdisk):
    """The daemon's and the colocated transport's inventory and reads are the service's."""
    from mtc.sidecar.service import SidecarService

    mesh = Mesh(np.array(jax.devices()), ("x",))
    state = {"w": jax.device_put(np.arange(64 * 4, dtype=np.float32).reshape(64, 4), NamedSharding(mesh, P("x"))),
             "r": jax.device_put(np.ones((4,), np.int32), NamedSharding(mesh, P()))}
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        m.save(1, state)
        m.wait_until_finished()
    svc = SidecarService(ramdisk / "mtc", host_id="h")
    try:
        (whole,) = svc.committed.inventory()["steps"]
        assert (whole["step"], whole["blobs"], whole["local_blobs"]) == (1, 9, 9)  # 8 row blocks + the replica
        (share,) = svc.committed.inventory(devices=[0, 1])["steps"]
        assert share["blobs"] == 3  # two row blocks and the replicated array
        manifest = svc.committed.manifest(1)
        w = next(a for a in manifest.arrays if a.key == "['w']")
        bad = w.shards[3]
        path = ramdisk / "mtc" / "blobs" / bad.blob
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
        boxes = [("['w']", sh.box) for sh in w.shards] + [("['r']", None)]
        bufs, errors = svc.read_boxes_each(1, boxes)
        assert [i for i, _, _ in errors] == [3] and errors[0][1] == "CorruptBlobError"
        assert bufs[3] == b"" and all(len(bytes(b)) for i, b in enumerate(bufs) if i != 3)
        assert np.array_equal(np.frombuffer(bytes(bufs[0]), np.float32), np.arange(32, dtype=np.float32))
    finally:
        svc.close()


def test_a_control_request_can_go_to_some_hosts_only(ramdisk):
    """Colocated phase 2 sends the whole manifest on the keepers' control devices only and the
    decision on the others' (a second call): requests on a subset of the control devices run on
    exactly those rows (here, one host's rows: on CPU every control device is this process)."""
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        disp = m._dispatch
        n = len(disp._ctl_devices)
        assert n >= 2
        some = disp._control("inventory", rows=[0, n - 1])
        assert len(some) == 2 and all(h == disp.hosts()[0] and "steps" in r for h, r in some)
        assert len(disp._control("inventory")) == n
        m.save(1, _state(1))  # one host: it is the keeper, and the only call is the keepers'
        m.wait_until_finished()
        data = (ramdisk / "mtc" / "steps" / f"{1:012d}.json").read_bytes()
        assert fmt.CommitRecord.parse(data) is None
        # The head asks for a manifest one host at a time (one row), so it gets one copy, not one per host.
        asked = []
        real = disp._exchange

        def noting(op, rows, *a, **kw):
            asked.append((op, rows))
            return real(op, rows, *a, **kw)

        disp._exchange = noting
        assert disp.manifest(1).to_json() == data
        assert asked == [("manifest", [0])]
        disp._exchange = real
        assert_trees_bitwise_equal(_state(1), m.restore(1))
