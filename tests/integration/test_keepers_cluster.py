"""Phase 2 with real daemons: the whole step manifest goes to two keepers on distinct slices, the
other hosts commit a record of the decision; restores read through the records, also when one
keeper is gone, and compare bit for bit."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import format as fmt
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def _state(seed: int) -> dict:
    # Data-parallel over the 2 slices, FSDP within each (as MaxText runs multi-slice): every shard
    # has a twin on the other slice, so replication moves nothing and no host needs the manifest.
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(random_array(rng, (64, 32), np.float32), NamedSharding(mesh, P("fsdp"))),
            "b": jax.device_put(random_array(rng, (32,), np.float32), NamedSharding(mesh, P()))}


def test_only_the_keepers_get_the_manifest_and_restores_read_through_records(ramdisk):
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False)
        state = _state(1)
        with CheckpointManager(cfg) as m:
            m.save(5, state)
            m.wait_until_finished()
            m.wait_for_replication()
        kinds = {}
        for h in cluster.hosts:
            data = (cluster.store_root(h) / "steps" / f"{5:012d}.json").read_bytes()
            kinds[h] = "record" if fmt.CommitRecord.parse(data) is not None else "manifest"
        keepers = sorted(h for h, k in kinds.items() if k == "manifest")
        # Two keepers, one per slice; replication and inventories made no other host fetch it.
        assert len(keepers) == 2 and {h.split("-")[0] for h in keepers} == {"s0", "s1"}, kinds
        digest = fmt.StepManifest.from_json((cluster.store_root(keepers[0]) / "steps" / f"{5:012d}.json")
                                            .read_bytes()).digest
        records = [h for h in cluster.hosts if h not in keepers]
        for h in records:
            assert fmt.CommitRecord.parse((cluster.store_root(h) / "steps" / f"{5:012d}.json").read_bytes()).digest == digest
        # One keeper replaced by an empty host (its ramdisk gone): the other keeper gives the
        # manifest; the new host gets its shards back from its twin on the other slice.
        cluster.kill(keepers[0])
        cluster.wipe(keepers[0])
        cluster.restart(keepers[0])
        with CheckpointManager(cfg) as m:
            assert m.latest_step() == 5
            assert_trees_bitwise_equal(state, m.restore())
            assert m.last_restore_report.step == 5
        # The record hosts read their own shards by their local view (the header from the keeper
        # left, and their own part): none of them fetched the whole manifest.
        for h in records:
            assert fmt.CommitRecord.parse((cluster.store_root(h) / "steps" / f"{5:012d}.json").read_bytes()), h


def test_the_save_thread_hands_the_manifest_to_replication_and_backup_unread(ramdisk, tmp_path, monkeypatch):
    """Reading a step manifest grows with its shards: after phase 2 the save thread hands its bytes
    on unread; with data-parallel twins and every part whole, neither the replication nor the backup
    reads it (each would, once, on its own thread, where the shares cannot tell)."""
    readers: list[str] = []
    real = fmt.StepManifest.from_json.__func__

    def spy(cls, data, **kw):  # the real reader, noting which thread called it
        if "manifest" in str(kw.get("source", "")):
            readers.append(threading.current_thread().name)
        return real(cls, data, **kw)

    monkeypatch.setattr(fmt.StepManifest, "from_json", classmethod(spy))
    joins = _spy_joins(monkeypatch)
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False, base_output_directory=str(tmp_path / "bk"),
                        multi_tier_checkpointing_backup_interval_steps=1)
        state = _state(2)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
            rep = m.wait_for_replication()
            assert rep.complete and rep.replicated and rep.moved_blobs == 0 and rep.attempts == 1, rep
            assert m.wait_for_backup().error is None
            report = m.last_save_report
            assert report.bytes_total == sum(np.asarray(x).nbytes for x in state.values())
            assert report.blobs_total > 0 and report.hosts == 4
            assert_trees_bitwise_equal(state, m.restore(1))
    assert not [t for t in readers if t.startswith("mtc-save")], readers
    # The manifest went to the keepers as its header and parts, back to back: the head never joined it.
    assert not joins, joins
    # Twins on both slices hold every copy: the hosts' shares say so, and replication reads nothing.
    assert not [t for t in readers if t.startswith("mtc-replicate")], readers
    # Every host holds its part whole: the hosts share the backup's uploads out, a keeper finalizes from its
    # own copy, and the head reads the manifest for none of it (it read it once, before).
    assert not [t for t in readers if t.startswith("mtc-backup")], readers


def _spy_joins(monkeypatch) -> list[str]:
    """The threads that made a step manifest's bytes in one buffer on the head (``fmt.encode_step``, or a
    joined ``protocol.Gathered``)."""
    from mtc.shared import protocol

    joins: list[str] = []
    real_join, real_encode = protocol.Gathered.join, fmt.encode_step
    monkeypatch.setattr(protocol.Gathered, "join",
                        lambda self: joins.append(threading.current_thread().name) or real_join(self))
    monkeypatch.setattr(fmt, "encode_step",
                        lambda **kw: joins.append(threading.current_thread().name) or real_encode(**kw))
    return joins


def test_the_colocated_save_sends_the_manifest_unjoined_and_as_bytes(ramdisk, monkeypatch):
    """The colocated transport (Pathways) puts the manifest's buffers in the keepers' request rows as
    bytes after the request's JSON, never as a JSON string and never joined first; the step restores."""
    joins = _spy_joins(monkeypatch)
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk / "ram"), local_checkpoint_period=1,
                    prefetch_on_start=False)
    state = _state(4)
    with CheckpointManager(cfg) as m:
        m.save(2, state)
        m.wait_until_finished()
        assert_trees_bitwise_equal(state, m.restore(2))
    assert not joins, joins


def test_without_twins_replication_plans_whole_shares_and_reads_no_manifest(ramdisk, monkeypatch):
    """FSDP over both slices: no host has a twin. The head plans each host's share to a host of the
    other slice, which lists the blobs from its own copy of the manifest; the head reads none, and
    a slice lost afterwards comes back from the copies, bit for bit."""
    readers: list[str] = []
    real = fmt.StepManifest.from_json.__func__

    def spy(cls, data, **kw):  # the real reader, noting which thread called it
        readers.append(threading.current_thread().name)
        return real(cls, data, **kw)

    monkeypatch.setattr(fmt.StepManifest, "from_json", classmethod(spy))
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",))
    rng = np.random.default_rng(3)
    state = {"w": jax.device_put(random_array(rng, (64, 32), np.float32), NamedSharding(mesh, P("x"))),
             "b": jax.device_put(random_array(rng, (32,), np.float32), NamedSharding(mesh, P()))}
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False)
        with CheckpointManager(cfg) as m:
            m.save(3, state)
            m.wait_until_finished()
            rep = m.wait_for_replication()
            # 4 shares of 3 blobs (2 of w, b); each receiver holds b already, so 8 blobs move.
            assert rep.complete and rep.replicated and rep.planned_blobs == 12 and rep.moved_blobs == 8, rep
            assert rep.moved_bytes == state["w"].nbytes and rep.planned_bytes > rep.moved_bytes, rep
            assert not [t for t in readers if t.startswith(("mtc-replicate", "mtc-save"))], readers
            assert all(s.replicated and s.min_copies == 2 for s in m.step_status())
        for h in ("s1-h0", "s1-h1"):
            cluster.kill(h)
            cluster.wipe(h)
            cluster.restart(h)
        with CheckpointManager(cfg) as m:
            assert m.latest_step() == 3
            assert_trees_bitwise_equal(state, m.restore())
            assert m.last_restore_report.bytes_by_tier["backup"] == 0
