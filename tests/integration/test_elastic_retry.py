"""The elastic workflow of pathwaysutils.elastic, with mtc in cluster mode over 2 slices.

A training loop wrapped in ``Manager.elastic_retry`` saves every step through the
Orbax-compatible manager. A slice's daemons are killed mid-run: the next save raises
``HostLostError`` (a ``jax.errors.JaxRuntimeError`` with DATA_LOSS), which the retry
recognises; the retry builds a new manager on the live slice, restores onto it and goes on.
The slice comes back: the loop raises ``ScaleUpSignalError``, the retry builds a manager on
both slices, restores again (the returned slice pulls what it lacks from its peers) and
finishes. The final state equals, bit for bit, a run without failures.

On CPU the devices have no ``slice_index``: the slice map is made from the local cluster's
slices (``elastic.get_slice_to_devices``), and a slice's health is whether its sidecar
daemons answer (``elastic.DefaultSliceHealthChecker``), as pathwaysutils allows.
"""

from __future__ import annotations

import json
import re
import socket

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

ocp = pytest.importorskip("orbax.checkpoint")
elastic = pytest.importorskip("pathwaysutils.elastic.elastic")
em = pytest.importorskip("pathwaysutils.elastic.manager")

from helpers import assert_trees_bitwise_equal  # noqa: E402
from mtc.head import HostLostError, MTCConfig, OrbaxCompatibleManager  # noqa: E402
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher  # noqa: E402
from mtc.head.manager import CheckpointManager  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

STEPS = 12
KILL_AT = 4  # slice 1's daemons die after the save of this step started
RETURN_AT = 8  # ... and are back (fresh processes, the same ramdisks) before this step


def _step(state, step):
    """A deterministic train step (elementwise, so the mesh does not change a bit)."""
    return {"w": state["w"] * np.float32(0.5) + np.float32(step), "count": state["count"] + 1}


def _init():
    return {"w": np.arange(64 * 16, dtype=np.float32).reshape(64, 16), "count": np.zeros((8,), np.int32)}


def _alive(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def test_slice_lost_and_returned_under_elastic_retry(tmp_path, monkeypatch):
    devices = sorted(jax.devices(), key=lambda d: d.id)
    slice_map = {0: devices[:4], 1: devices[4:]}
    events: list[str] = []
    with LocalCluster(tmp_path / "cluster", 2, 2, devices_per_host=2) as cluster:
        spec = json.loads(cluster.spec_path.read_text())

        class DaemonHealth(elastic.SliceHealthChecker):
            """A slice is healthy while every one of its sidecar daemons accepts connections."""

            def dispatch(self) -> None:
                pass

            def validate(self):
                cur = json.loads(cluster.spec_path.read_text())
                return frozenset(s for s in self.slice_to_devices
                                 if all(_alive(h["address"]) for h in cur["hosts"] if h["slice"] == s))

        monkeypatch.setattr(elastic, "get_slice_to_devices", lambda devs: slice_map)
        monkeypatch.setattr(elastic, "DefaultSliceHealthChecker", DaemonHealth)
        manager = em.Manager()
        assert manager.active_slice_indices == {0, 1}
        ckpts: list[OrbaxCompatibleManager] = []

        def new_manager(active: list[int]) -> tuple[OrbaxCompatibleManager, Mesh]:
            live = [d for s in active for d in slice_map[s]]
            sub = tmp_path / f"spec-{len(ckpts)}.json"
            cur = json.loads(cluster.spec_path.read_text())
            sub.write_text(json.dumps({**cur, "hosts": [h for h in cur["hosts"] if h["slice"] in active]}))
            cfg = MTCConfig(local_checkpoint_directory=str(tmp_path / "cluster"), cluster_spec=str(sub),
                            local_checkpoint_period=1, local_max_to_keep=3)
            m = OrbaxCompatibleManager(manager=CheckpointManager(cfg, dispatcher=ClusterDispatcher(cfg, devices=live)))
            ckpts.append(m)
            return m, Mesh(np.array(live).reshape(len(active), -1), ("data", "model"))

        def close_old() -> None:
            events.append(f"elastic event after {len(ckpts)} attempt(s)")
            for m in ckpts:
                try:
                    m.close()
                except Exception as e:  # the failed save's error: already handled by the retry
                    events.append(f"close: {type(e).__name__}")

        @manager.elastic_retry(minimum_slice_count=1, poll_interval=0.05, timeout=60, max_retries=4,
                               on_elastic_event_callback=close_old)
        def train():
            active = sorted(manager.active_slice_indices)
            ckpt, mesh = new_manager(active)
            sh = {"w": NamedSharding(mesh, P(None, "model")), "count": NamedSharding(mesh, P("data"))}
            start = ckpt.latest_step()
            if start is None:
                state, first = {k: jax.device_put(v, sh[k]) for k, v in _init().items()}, 0
            else:
                abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in _init().items()}
                state = ckpt.restore(start, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract))).state
                first = start + 1
            events.append(f"attempt on slices {active} from step {first}"
                          + (f" ({ckpt.mtc_manager.last_restore_report.bytes_by_tier})" if start is not None else ""))
            for step in range(first, STEPS):
                if step == RETURN_AT and 1 not in active:
                    for h in cluster.hosts:
                        if cluster.slice_of(h) == 1:
                            cluster.restart(h)
                if 1 not in active and step >= RETURN_AT and elastic.get_active_slice_indices(slice_map) == {0, 1}:
                    ckpt.wait_until_finished()
                    raise em.ScaleUpSignalError()
                state = _step(state, step)
                ckpt.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
                if step == KILL_AT and active == [0, 1]:
                    for h in cluster.hosts:
                        if cluster.slice_of(h) == 1:
                            cluster.kill(h)
            ckpt.wait_until_finished()
            return state, ckpt

        final, ckpt = train()
        ckpt.close()

    reference = _init()
    for step in range(STEPS):
        reference = _step(reference, step)
    assert_trees_bitwise_equal(jax.tree.map(np.asarray, reference), jax.tree.map(np.asarray, final))
    attempts = [e for e in events if e.startswith("attempt")]
    assert len(attempts) == 3, events
    assert attempts[0].startswith("attempt on slices [0, 1] from step 0")
    resumed = int(re.search(r"from step (\d+)", attempts[1]).group(1))
    assert attempts[1].startswith("attempt on slices [0] from step ") and 1 <= resumed <= KILL_AT + 1, events
    assert attempts[2].startswith(f"attempt on slices [0, 1] from step {RETURN_AT}")
    assert "'peer': 0" not in attempts[2], events  # the returned slice pulled the step from its peers


def test_host_lost_is_a_jax_runtime_error_with_data_loss(tmp_path):
    with LocalCluster(tmp_path / "c", 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(tmp_path / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1)
        mesh = Mesh(np.array(jax.devices()), ("x",))
        state = {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("x")))}
        with OrbaxCompatibleManager(cfg) as m:
            assert m.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
            m.wait_until_finished()
            cluster.kill("s0-h1")
            m.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item=state)))
            with pytest.raises(HostLostError) as info:
                m.wait_until_finished()
            assert isinstance(info.value, jax.errors.JaxRuntimeError)
            assert elastic.is_error_due_to_slice_down(info.value)
            assert "s0-h1" in str(info.value)
