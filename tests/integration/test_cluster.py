"""Cluster mode with real sidecar daemons: 2 slices x 2 hosts x 2 devices (8 CPU devices in the head)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import psutil
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, control_connection, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.head.restore.plan import plan_target
from mtc.shared import protocol
from mtc.shared.errors import CorruptBlobError, HostUnreachableError, SaveError, StepNotFoundError, StepsUnconfirmedError
from mtc.shared.hashing import blob_name
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

# Device ids -> host, as Topology.from_spec assigns them (devices sorted by id, 2 per host).
HOST_OF_DEVICE = {0: "s0-h0", 1: "s0-h0", 2: "s0-h1", 3: "s0-h1", 4: "s1-h0", 5: "s1-h0", 6: "s1-h1", 7: "s1-h1"}


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def make_state(seed: int) -> dict:
    """Random leaves of several dtypes and shardings: split, replicated, 2-D split, one device."""
    rng = np.random.default_rng(seed)
    m = mesh()

    def put(a, spec):
        return jax.device_put(a, NamedSharding(m, spec))

    return {
        "params": {
            "w": put(random_array(rng, (64, 48), np.float32), P(None, "model")),
            "emb": put(random_array(rng, (32, 16), ml_dtypes.bfloat16), P("data", "model")),
            "b": put(random_array(rng, (24,), np.int8), P()),
        },
        "mask": put(random_array(rng, (8, 8), np.bool_), P("model")),
        "one": jax.device_put(random_array(rng, (5, 3), np.float32), jax.devices()[5]),
        "count": jax.device_put(np.int32(seed), jax.devices()[2]),  # 0-d, on one device
        "rng": random_array(rng, (4,), np.uint32),
        "lr": np.float32(seed / 8),  # 0-d host numpy
        "step": seed,
    }


def manager(cluster: LocalCluster, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root),
                                       cluster_spec=str(cluster.spec_path), local_checkpoint_period=1, **kw))


def expected_blobs(state: dict) -> dict[str, set[str]]:
    """host -> names of the blobs it must hold: its devices' shards, and every numpy leaf."""
    out: dict[str, set[str]] = {h: set() for h in set(HOST_OF_DEVICE.values())}
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array):
            for sh in leaf.addressable_shards:
                out[HOST_OF_DEVICE[sh.device.id]].add(blob_name(np.ascontiguousarray(np.asarray(sh.data)).tobytes()))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            for names in out.values():
                names.add(blob_name(np.ascontiguousarray(leaf).tobytes()))
    return out


def blobs_on_disk(cluster: LocalCluster, host: str) -> set[str]:
    return {p.name for p in (cluster.store_root(host) / "blobs").iterdir() if not p.name.startswith(".")}


def daemon_pids_under(root: Path) -> list[int]:
    """Live (non-zombie) `mtc.sidecar serve` processes whose ramdisk is under ``root``."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if "mtc.sidecar" in cmd and "serve" in cmd and any(str(root) in c for c in cmd):
            out.append(p.info["pid"])
    return out


def wait_until(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# --- save and restore ---------------------------------------------------------------------------


def test_save_restore_bit_for_bit_with_each_host_holding_only_its_shards(local_cluster):
    s1, s2 = make_state(1), make_state(2)
    # No peer copies (tests/integration/test_peers.py has those): each host holds its own share.
    with manager(local_cluster, replication_factor=1) as m:
        assert sorted(m._dispatch.fingerprints()) == local_cluster.hosts
        m.save(1, s1)
        m.save(2, s2)
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
        assert m.latest_step() == 2
        report = m.last_save_report
        assert report.step == 2 and report.hosts == 4
        assert_trees_bitwise_equal(s2, m.restore())
        assert_trees_bitwise_equal(s1, m.restore(1))
        # With the saved structure as target, shardings come from the target.
        assert_trees_bitwise_equal(s2, m.restore(2, target=jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            s2)))
    want1, want2 = expected_blobs(s1), expected_blobs(s2)
    for h in local_cluster.hosts:
        assert blobs_on_disk(local_cluster, h) == want1[h] | want2[h], h
    # Hosts of one slice hold different shards; for leaves not split over "data", the twin host
    # of the other slice holds the same ones.
    assert want2["s0-h0"] - want2["s0-h1"]
    assert want2["s0-h1"] - want2["s0-h0"]
    twins = expected_blobs({"w": s2["params"]["w"], "b": s2["params"]["b"], "mask": s2["mask"]})
    assert twins["s0-h0"] == twins["s1-h0"] and twins["s0-h1"] == twins["s1-h1"]


def test_restore_into_other_shardings_fetches_shards_from_other_hosts(local_cluster):
    state = make_state(3)
    with manager(local_cluster) as m:
        m.save(3, state)
        m.wait_until_finished()
        # A 1-D mesh in reverse device order: most target boxes overlap shards held by other hosts.
        devs = np.array(jax.devices()[::-1])
        m1 = Mesh(devs, ("x",))
        target = {
            "params": {
                "w": jax.ShapeDtypeStruct((64, 48), np.float32, sharding=NamedSharding(m1, P("x"))),
                "emb": jax.ShapeDtypeStruct((32, 16), ml_dtypes.bfloat16, sharding=NamedSharding(m1, P(None, "x"))),
                "b": jax.ShapeDtypeStruct((24,), np.int8, sharding=NamedSharding(m1, P("x"))),
            },
            "mask": jax.ShapeDtypeStruct((8, 8), np.bool_, sharding=NamedSharding(m1, P())),
            "one": jax.ShapeDtypeStruct((5, 3), np.float32, sharding=NamedSharding(m1, P())),
            "count": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(m1, P())),
            "rng": np.zeros(4, np.uint32),
            "lr": np.float32(0),
            "step": 0,
        }
        out = m.restore(3, target=target)
        for key in ("w", "emb", "b"):
            assert out["params"][key].sharding == target["params"][key].sharding
        assert_trees_bitwise_equal(state, out, check_sharding=False)


def test_restarted_daemon_with_intact_ramdisk_serves_its_steps(local_cluster):
    states = {s: make_state(s) for s in (1, 2)}
    with manager(local_cluster, restore_host_wait_s=0) as m:  # answer at once while the host is down
        for s, st in states.items():
            m.save(s, st)
        m.wait_until_finished()
        old_pid = local_cluster.pid("s1-h0")
        assert local_cluster.kill("s1-h0", signal.SIGTERM) == 0  # clean shutdown on SIGTERM
        assert "daemon stopped" in local_cluster.log_path("s1-h0").read_text()
        # While a host is down nothing can be confirmed on it, and that is not "no step".
        with pytest.raises(StepsUnconfirmedError, match=r"could not be asked.*s1-h0: .*connection refused"):
            m.latest_step()
        inv = m._dispatch.inventories()
        assert "connection refused" in inv["s1-h0"].error and inv["s1-h0"].steps == ()
        with pytest.raises(StepNotFoundError, match=r"could not be asked.*s1-h0 \(.*connection refused"):
            m.restore()
        local_cluster.restart("s1-h0")
        assert local_cluster.pid("s1-h0") != old_pid
        assert "committed steps found: [1, 2]" in local_cluster.log_path("s1-h0").read_text()
        assert m.all_steps() == [1, 2]
        assert_trees_bitwise_equal(states[2], m.restore())
        assert_trees_bitwise_equal(states[1], m.restore(1))
        # kill -9 too: the ramdisk survives, and so do the steps.
        local_cluster.kill("s0-h1")
        local_cluster.restart("s0-h1")
        assert m.latest_step() == 2
        assert_trees_bitwise_equal(states[2], m.restore(2))


def test_wiped_host_makes_its_steps_incomplete_until_a_new_save(local_cluster):
    s1, s2, s3 = make_state(1), make_state(2), make_state(3)
    # Without peer copies, the shards only the wiped host held are gone (with them, see test_peers.py).
    with manager(local_cluster, replication_factor=1) as m:
        m.save(1, s1)
        m.save(2, s2)
        m.wait_until_finished()
        local_cluster.wipe("s1-h1")
        local_cluster.restart("s1-h1")
        assert not blobs_on_disk(local_cluster, "s1-h1")
        assert m.all_steps() == []
        assert m.latest_step() is None
        with pytest.raises(StepNotFoundError, match="nothing to restore"):
            m.restore()
        with pytest.raises(StepNotFoundError, match="not committed on every host"):
            m.restore(2)
        # Training goes on: the next save is whole again on every host.
        m.save(3, s3)
        m.wait_until_finished()
        assert m.latest_step() == 3
        assert_trees_bitwise_equal(s3, m.restore())


def test_a_missing_blob_on_one_host_hides_only_the_steps_that_need_it(local_cluster):
    s1, s2 = make_state(1), make_state(2)
    with manager(local_cluster, replication_factor=1) as m:
        m.save(1, s1)
        m.save(2, s2)
        m.wait_until_finished()
        only2 = sorted(expected_blobs(s2)["s0-h1"] - expected_blobs(s1)["s0-h1"])
        # A step is restorable while any host holds a copy of each blob: remove every copy.
        for h in local_cluster.hosts:
            (local_cluster.store_root(h) / "blobs" / only2[0]).unlink(missing_ok=True)
        assert m.all_steps() == [1]
        assert m.latest_step() == 1
        assert_trees_bitwise_equal(s1, m.restore())


def test_restore_fails_clearly_when_no_host_has_a_good_copy(local_cluster):
    state = make_state(4)
    with manager(local_cluster) as m:
        m.save(4, state)
        m.wait_until_finished()
        manifest = m._dispatch.manifest(4)
        requests, _ = plan_target(manifest, None)
        # Corrupt one shard of "w" on both of its holders (the twins s0-h0 and s1-h0).
        rec = next(a for a in manifest.arrays if a.key == "['params']['w']")
        shard = next(s for s in rec.shards if s.devices and HOST_OF_DEVICE[s.devices[0]] == "s0-h0")
        for h in ("s0-h0", "s1-h0"):
            path = local_cluster.store_root(h) / "blobs" / shard.blob
            data = bytearray(path.read_bytes())
            data[0] ^= 1
            path.write_bytes(bytes(data))
        with pytest.raises(CorruptBlobError) as err:
            m._dispatch.load(4, requests)
        msg = str(err.value)
        assert "['params']['w']" in msg and "s0-h0" in msg and "s1-h0" in msg and "corrupt" in msg


def test_backup_through_the_daemons_restores_after_every_ramdisk_is_lost(local_cluster, ramdisk):
    state = make_state(6)
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1, base_output_directory=str(ramdisk / "bucket"), run_name="run",
                    multi_tier_checkpointing_backup_interval_steps=1)
    with CheckpointManager(cfg) as m:
        m.save(6, state)
        m.wait_until_finished()
        report = m.wait_for_backup()
        assert report.error is None and report.uploaded_blobs > 0
        assert set(report.bytes_by_host) == set(local_cluster.hosts)
        for h in local_cluster.hosts:
            local_cluster.wipe(h)
            local_cluster.restart(h)
        assert m.latest_step() == 6  # from the backup
        assert_trees_bitwise_equal(state, m.restore())
        rep = m.last_restore_report
        assert rep.source != "cluster"
        # Every byte came from the backup (each host pulled its own shards), none was local.
        assert rep.bytes_by_tier["ram"] == 0 and rep.blobs_by_tier["ram"] == 0
        assert rep.bytes_by_tier["backup"] >= sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))


def test_a_backup_stuck_on_a_dead_bucket_never_holds_up_the_next_save(ramdisk, emulator_factory, monkeypatch):
    server = emulator_factory("fake-gcs-server", persistent=True)
    bucket = f"mtc-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    with LocalCluster(ramdisk / "c", 2, 2, env={"STORAGE_EMULATOR_HOST": server.url}) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, base_output_directory=f"gs://{bucket}", run_name="run",
                        multi_tier_checkpointing_backup_interval_steps=1)
        with CheckpointManager(cfg) as m:
            m.save(1, make_state(1))
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
            server.stop()  # the bucket vanishes: the backup of step 2 retries on the daemons
            m.save(2, make_state(2))
            m.wait_until_finished()
            t0 = time.perf_counter()
            m.save(3, make_state(3))
            m.wait_until_finished()
            assert time.perf_counter() - t0 < 10, "a save waited for the stuck backup"
            assert m.is_backing_up(), "the backup did not wait for the bucket"
            assert m._cluster_steps()[-2:] == [2, 3]
            server.start()
            report = m.wait_for_backup()
            assert report.error is None and report.step == 2, report


def test_failed_save_names_the_host_and_the_next_save_works(local_cluster):
    s1, s2, s3 = make_state(1), make_state(2), make_state(3)
    with manager(local_cluster) as m:
        m.save(1, s1)
        m.wait_until_finished()
        local_cluster.kill("s0-h1")
        assert m.save(2, s2)  # training is not interrupted: the failure is reported later
        with pytest.raises(SaveError) as err:
            m.wait_until_finished()
        assert err.value.step == 2
        assert set(err.value.hosts) == {"s0-h1"}
        assert "connection refused" in err.value.hosts["s0-h1"]
        assert "s0-h1" in str(err.value)
        m.check_for_errors()  # reported once
        # Phase 1 of step 2 was aborted on the hosts that wrote it.
        for h in local_cluster.hosts:
            assert not any((local_cluster.store_root(h) / "pending").iterdir()), h
        local_cluster.restart("s0-h1")
        m.save(3, s3)
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
        assert_trees_bitwise_equal(s3, m.restore())
        assert_trees_bitwise_equal(s1, m.restore(1))


def test_save_waits_for_the_previous_write_and_is_safe_from_donation(local_cluster):
    """The staged copy is the head's own: the caller may overwrite its buffers once save() returns."""
    devices = jax.devices()
    sharding = NamedSharding(mesh(), P(("data", "model")))
    original = np.random.default_rng(0).standard_normal(8 * 1024).astype(np.float32)
    # Build the array on host buffers we keep (zero-copy on CPU), to scribble on them later.
    bufs = []
    for d, idx in sharding.addressable_devices_indices_map(original.shape).items():
        b = protocol.aligned_buffer(original[idx].nbytes).view(np.float32)
        b[:] = original[idx]
        bufs.append((d, b))
    x = jax.make_array_from_single_device_arrays(original.shape, sharding,
                                                 [jax.device_put(b, d, may_alias=True) for d, b in bufs])
    assert bufs[0][1].ctypes.data == x.addressable_shards[0].data.unsafe_buffer_pointer()
    del devices
    with manager(local_cluster) as m:
        m.save(0, {"x": jax.numpy.ones_like(x)})  # connected, versions checked, steps known
        m.wait_until_finished()
        local_cluster.kill("s1-h1", signal.SIGSTOP)
        try:
            m.save(1, {"x": x})
            for _, b in bufs:
                b[:] = -1.0  # what a donating train step may do to its inputs
            second = threading.Thread(target=m.save, args=(2, {"x": jax.numpy.zeros_like(x)}))
            second.start()
            second.join(timeout=0.5)
            assert second.is_alive(), "the second save did not wait for the first"
        finally:
            local_cluster.kill("s1-h1", signal.SIGCONT)
        second.join(timeout=60)
        m.wait_until_finished()
        assert m.last_save_report.step == 2
        assert m.last_save_report.waited_for_previous_s >= 0.4
        restored = np.asarray(m.restore(1)["x"])
        assert restored.view(np.uint8).tobytes() == original.view(np.uint8).tobytes()


def test_cluster_spec_from_the_environment(local_cluster):
    env = {"MTC_CLUSTER_SPEC": str(local_cluster.spec_path),
           "MTC_LOCAL_CHECKPOINT_DIRECTORY": str(local_cluster.root), "MTC_LOCAL_CHECKPOINT_PERIOD": "1"}
    cfg = MTCConfig.from_env(env)
    state = make_state(5)
    with CheckpointManager(cfg) as m:
        assert isinstance(m._dispatch, ClusterDispatcher)
        m.save(5, state)
        m.wait_until_finished()
        assert_trees_bitwise_equal(state, m.restore())


# --- the daemon ---------------------------------------------------------------------------------


def test_daemon_refuses_garbage_and_keeps_serving(local_cluster):
    addr = protocol.parse_address(local_cluster.address("s0-h0"))
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        reply = protocol.recv_reply(s)
        assert reply.error.type == "ProtocolError" and "not an mtc frame" in reply.error.message
        try:  # and it closed that connection (a reset, when our unread bytes were still queued)
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(protocol.MAGIC + (protocol.MAX_HEADER_BYTES + 1).to_bytes(4, "big"))
        assert "over the limit" in protocol.recv_reply(s).error.message
    with control_connection(local_cluster.address("s0-h0"), local_cluster.peer_token) as s:
        protocol.send_request(s, protocol.Request("read", 3, {"step": "x", "reads": []}))
        assert protocol.recv_reply(s).error.type == "ProtocolError"
        protocol.send_request(s, protocol.Request("rm -rf", 4))
        assert "unknown op" in protocol.recv_reply(s).error.message
        protocol.send_request(s, protocol.Request("ping", 5))  # same connection still serves
        assert protocol.recv_reply(s).result["host"] == "s0-h0"


# --- no process left behind ---------------------------------------------------------------------


FAILING_TESTS = '''
import json, os
from mtc.sidecar.local_cluster import LocalCluster

ROOT = {root!r}

def test_fails_inside_the_context_manager():
    with LocalCluster(os.path.join(ROOT, "a"), 1, 2) as c:
        print("PIDS", json.dumps(list(c.pids().values())), flush=True)
        assert False, "deliberate failure"

def test_fails_without_stopping_the_cluster():
    c = LocalCluster(os.path.join(ROOT, "b"), 1, 2).start()
    print("PIDS", json.dumps(list(c.pids().values())), flush=True)
    assert False, "deliberate failure, cluster left running"
'''


def test_local_cluster_leaves_no_process_behind_a_failing_test(ramdisk):
    test_file = ramdisk / "test_failing.py"
    test_file.write_text(FAILING_TESTS.format(root=str(ramdisk)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(test_file)],
                       capture_output=True, text=True, timeout=120, cwd=ramdisk)
    assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    pids = [p for found in re.findall(r"PIDS (\[[^\]]*\])", r.stdout) for p in json.loads(found)]
    assert len(pids) == 4
    wait_until(lambda: not daemon_pids_under(ramdisk), what="the daemons of the failed tests to exit")
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_kill_9_of_the_owner_takes_its_daemons_down(ramdisk):
    script = textwrap.dedent(f"""
        import json, sys, time
        from mtc.sidecar.local_cluster import LocalCluster
        c = LocalCluster({str(ramdisk / 'c')!r}, 2, 1).start()
        print(json.dumps(list(c.pids().values())), flush=True)
        sys.stdin.read()  # until killed
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        assert sorted(daemon_pids_under(ramdisk)) == sorted(pids)
        owner.kill()
        owner.wait(timeout=30)
        wait_until(lambda: not daemon_pids_under(ramdisk), what="the orphaned daemons to die")
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.stdin.close()
        owner.stdout.close()


def test_daemon_that_fails_to_start_is_reported_with_its_log(ramdisk):
    bad = LocalCluster(ramdisk / "c", 1, 1, env={"MTC_CRASH_AT": "no_such_point"}, startup_timeout=30)
    with bad:
        pass  # starts fine: crash points are only parsed when a save reaches one
    blocker = ramdisk / "c2"
    blocker.mkdir()
    (blocker / "s0-h0").write_text("a file where the ramdisk directory should be")
    with pytest.raises(HostUnreachableError, match="exited with code"):
        LocalCluster(blocker, 1, 1, startup_timeout=30).start()
    assert not daemon_pids_under(blocker)


def test_env_cluster_spec_and_head_retention_apply(local_cluster, monkeypatch):
    """MTC_CLUSTER_SPEC selects cluster mode; the head's local_max_to_keep decides retention."""
    monkeypatch.setenv("MTC_CLUSTER_SPEC", str(local_cluster.spec_path))
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), local_checkpoint_period=1,
                    local_max_to_keep=3)  # the daemons were started with --max-to-keep 2
    with CheckpointManager(cfg) as m:
        assert type(m._dispatch).__name__ == "ClusterDispatcher"
        for step in range(5):
            m.save(step, make_state(step))
            m.wait_until_finished()
        assert m.all_steps() == [2, 3, 4]
        assert_trees_bitwise_equal(make_state(2), m.restore(2))
