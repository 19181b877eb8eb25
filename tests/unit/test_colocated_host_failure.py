"""Colocated mode: one host's failure means what it means in cluster mode. A sidecar that raises
is that host's failure, in the answer where cluster mode answers per host (inventories, verify,
peer pulls), and raised typed where it raises (tests/integration/test_host_failure.py: the same
with real daemons, one killed)."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig
from mtc.head.dispatch.colocated import ColocatedDispatcher
from mtc.shared.errors import ConfigError, MTCError, StepNotFoundError

pytestmark = pytest.mark.unit


def _state():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {"w": jax.device_put(np.arange(64 * 4, dtype=np.float32).reshape(64, 4), NamedSharding(mesh, P("x")))}


def test_verify_answers_per_host(ramdisk):
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        m.save(1, _state())
        m.wait_until_finished()
        d = m._dispatch
        assert isinstance(d, ColocatedDispatcher)
        (host,) = d.hosts()
        (res,) = d.verify(1).values()
        assert res["checked"] == d.inventories()[host].steps[0].step_blobs > 0  # every blob of the step: held here
        assert res["bad"] == [] and res["host"] == host
        missing = d.verify(7)  # a step the host does not hold: that host's error, not the call's
        assert set(missing) == {host} and missing[host]["error"].startswith("StepNotFoundError")
        assert "step 7" in missing[host]["error"]


def test_a_host_whose_sidecar_fails_is_reported_per_host(ramdisk):
    """A sidecar that refuses every request (its ramdisk's steps folder replaced by a file): the
    fan-outs that answer per host in cluster mode answer so here too; the others raise typed."""
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        m.save(1, _state())
        m.wait_until_finished()
        d = m._dispatch
        (host,) = d.hosts()
        steps = ramdisk / "mtc" / "steps"
        kept = ramdisk / "kept-steps"
        shutil.move(steps, kept)
        steps.write_text("not a folder")
        try:
            inv = d.inventories()
            assert set(inv) == {host} and inv[host].steps == ()
            assert "File exists" in inv[host].error and host in inv[host].error
            assert d.peer_inventories()[host].error == inv[host].error
            assert "File exists" in d.verify(1)[host]["error"]
            pulled = d.peer_pull(1, {host: []})
            assert set(pulled) == {host} and "File exists" in pulled[host].error
            d.abort(5)  # best effort: logged, not raised
            with pytest.raises(MTCError, match=f"host {host}: .*File exists"):
                d.leases()
            with pytest.raises(MTCError, match=f"host {host}: .*File exists"):
                d.backup_scrub({host: {}})
        finally:
            steps.unlink()
            shutil.move(kept, steps)
        assert [s.step for s in d.inventories()[host].steps] == [1]
        assert d.verify(1)[host]["bad"] == []


def test_typed_errors_and_a_device_of_no_host(ramdisk):
    with CheckpointManager(MTCConfig(local_checkpoint_directory=str(ramdisk), local_checkpoint_period=1)) as m:
        d = m._dispatch
        (host,) = d.hosts()
        with pytest.raises(StepNotFoundError, match=f"no host could give the manifest of step 3.*{host}"):
            d.manifest(3)
        with pytest.raises(ConfigError, match="device 4096 belongs to no host"):
            d.host_of_device(4096)
