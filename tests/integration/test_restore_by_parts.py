"""A restore onto the hosts and shardings that saved a step reads no shard row on the head: each host
loads its own part, the head plans from the manifest's header (O(arrays + hosts)). Anything else (a
resharded target, a host that lost its part) reads the whole manifest, and every restore stays bit
for bit. What the head parses is counted by a spy on the host-part parser, in the head's process."""

from __future__ import annotations

import re

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.head import tree as tree_lib
from mtc.shared import format as fmt
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.integration


def make_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    def put(a, spec):
        return jax.device_put(a, NamedSharding(m, spec))

    return {
        "params": {
            "w": put(random_array(rng, (64, 48), np.float32), P(None, "model")),
            "emb": put(random_array(rng, (32, 16), ml_dtypes.bfloat16), P("data", "model")),
            "b": put(random_array(rng, (24,), np.int8), P()),
        },
        "one": jax.device_put(random_array(rng, (5, 3), np.float32), jax.devices()[5]),
        "rng": random_array(rng, (4,), np.uint32),  # host numpy: every host wrote it
        "step": seed,
    }


@pytest.fixture
def rows_parsed(monkeypatch):
    """How many shard rows the head has parsed (every part read goes through ``PartColumns.from_json``).
    The rows the save's twin check reads (each phase-1 answer's names per box, at every save) are
    counted apart, in ``count[1]``: they are the save's, not a restore's, a replication's or a backup's."""
    count = [0, 0]
    real = fmt.PartColumns.from_json.__func__

    def counting(cls, data, **kw):
        part = real(cls, data, **kw)
        count["answer to phase 1" in kw.get("source", "")] += len(part)
        return part

    monkeypatch.setattr(fmt.PartColumns, "from_json", classmethod(counting))
    return count


@pytest.fixture
def whole_reads(monkeypatch):
    """How many whole step manifests the head has read (``StepManifest.from_json``: every row parsed, the
    rows path's and the per-blob replication's and backup plan's first step)."""
    count = [0]
    real = fmt.StepManifest.from_json.__func__

    def counting(cls, data, **kw):
        count[0] += 1
        return real(cls, data, **kw)

    monkeypatch.setattr(fmt.StepManifest, "from_json", classmethod(counting))
    return count


def backup_now(dispatch, cfg: MTCConfig, committed):
    """The backup of ``committed`` as the save's background would run it, asked for now: its report."""
    from mtc.head.backup.runner import BackupRunner

    runner = BackupRunner(dispatch, cfg)
    try:
        runner.maybe_start(committed, now=True)
        return runner.wait()
    finally:
        runner.close()


def manager(cluster: LocalCluster, **kw) -> CheckpointManager:
    return CheckpointManager(MTCConfig(local_checkpoint_directory=str(cluster.root),
                                       cluster_spec=str(cluster.spec_path), local_checkpoint_period=1, **kw))


def like(state):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, state)


def resharded(state) -> dict:
    """``like(state)`` with "w" asked for on another mesh: rows split over the devices, reversed."""
    target = like(state)
    mesh = Mesh(np.array(jax.devices()[::-1]), ("x",))
    target["params"]["w"] = jax.ShapeDtypeStruct((64, 48), np.float32, sharding=NamedSharding(mesh, P("x")))
    return target


def test_a_restore_onto_the_saving_topology_reads_no_shard_row(local_cluster, rows_parsed):
    s1, s2 = make_state(1), make_state(2)
    with manager(local_cluster) as m:
        m.save(1, s1)
        m.save(2, s2)
        m.wait_until_finished()
    rows_parsed[0] = 0
    with manager(local_cluster) as m:  # a restarted head: its start-up pull, the step choice and the restores
        assert m.latest_step() == 2
        assert_trees_bitwise_equal(s2, m.restore())
        rep = m.last_restore_report
        assert rep.step == 2 and rep.bytes_by_tier["ram"] > 0 and rep.bytes_by_tier["peer"] == 0
        assert_trees_bitwise_equal(s1, m.restore(1))
        assert_trees_bitwise_equal(s2, m.restore(2, target=like(s2)))
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows on a same-topology restore"


def test_a_resharded_restore_reads_no_row_and_stays_bit_for_bit(local_cluster, rows_parsed):
    """Another target sharding: the head plans from the two sharding descriptions which writers' parts each
    host reads, the hosts pull those parts whole from their writers and read their boxes by the manifest
    they keep. No shard row on the head."""
    state = make_state(3)
    with manager(local_cluster) as m:
        m.save(3, state)
        m.wait_until_finished()
    rows_parsed[0] = 0
    with manager(local_cluster, prefetch_on_start=False) as m:
        target = resharded(state)
        got = m.restore(3, target=target)
        assert_trees_bitwise_equal(state, got, check_sharding=False)
        assert got["params"]["w"].sharding == target["params"]["w"].sharding
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows on a resharded restore"
        assert m.last_restore_report.bytes_by_tier["peer"] > 0  # the writers' parts moved to their new readers


def test_an_export_onto_the_saving_topology_reads_no_shard_row(local_cluster, rows_parsed, tmp_path):
    """``export`` takes the arrays and the tree from the manifest's header (``manifest(shards=False)``) and
    restores each group onto the saving shardings, each host from its own part: no row on the head. The
    export is read back with Orbax and compared bit for bit (``verify``)."""
    pytest.importorskip("orbax.checkpoint")
    state = make_state(4)
    with manager(local_cluster) as m:
        m.save(4, state)
        m.wait_until_finished()
        whole = m.manifest(4)
    rows_parsed[0] = 0
    with manager(local_cluster, prefetch_on_start=False) as m:
        header = m.manifest(4, shards=False)
        assert [(a.key, a.kind, a.dtype, a.shape, a.sharding, a.value) for a in header.arrays] == [
            (a.key, a.kind, a.dtype, a.shape, a.sharding, a.value) for a in whole.arrays]
        assert header.tree == whole.tree and header.digest == whole.digest
        assert all(not a.shards for a in header.arrays)
        rep = m.export(str(tmp_path / "out"), 4, max_bytes=4096, verify=True)
        assert rep.verified and rep.groups > 1 and rep.bytes_by_tier.get("ram", 0) > 0
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows to export a step"


def test_an_older_step_without_its_writers_reads_the_rows(local_cluster, rows_parsed, monkeypatch):
    """The control: a step whose header does not say which host wrote which devices (saved by an older
    version) is planned from its rows, and stays bit for bit."""
    from mtc.head import save as save_lib

    real = save_lib.fmt.encode_step_segments

    def without_devices(**kw):
        kw["topology"] = {k: v for k, v in kw["topology"].items() if k != "devices"}
        return real(**kw)

    monkeypatch.setattr(save_lib.fmt, "encode_step_segments", without_devices)
    state = make_state(6)
    with manager(local_cluster) as m:
        m.save(6, state)
        m.wait_until_finished()
    rows_parsed[0] = 0
    with manager(local_cluster, prefetch_on_start=False) as m:
        assert_trees_bitwise_equal(state, m.restore(6, target=resharded(state)), check_sharding=False)
        assert rows_parsed[0] > 0


def data_parallel_state(seed: int, devices) -> dict:
    """Every array replicated over "data" (the slices are data-parallel twins, as MaxText runs multi-slice)."""
    rng = np.random.default_rng(seed)
    m = Mesh(np.array(devices).reshape(-1, 4), ("data", "model"))
    return {
        "w": jax.device_put(random_array(rng, (64, 48), np.float32), NamedSharding(m, P(None, "model"))),
        "emb": jax.device_put(random_array(rng, (32, 16), ml_dtypes.bfloat16), NamedSharding(m, P("model"))),
        "b": jax.device_put(random_array(rng, (24,), np.int8), NamedSharding(m, P())),
        "rng": random_array(rng, (4,), np.uint32),
        "step": seed,
    }


def test_a_host_that_lost_a_blob_reads_its_twins_part(local_cluster, rows_parsed):
    """A host whose part is no longer whole (a blob gone from its ramdisk) while its data-parallel twin's is:
    it pulls the twin's part whole and reads from it; the head reads no row."""
    state = data_parallel_state(9, jax.devices())
    with manager(local_cluster) as m:
        m.save(9, state)
        m.wait_until_finished()
        blobs = {sh.blob for a in m.manifest(9).arrays for sh in a.shards if 1 in sh.devices or 2 in sh.devices}
    gone = [p for p in (local_cluster.store_root("s0-h1") / "blobs").rglob("*") if p.name in blobs]
    assert gone, "s0-h1 holds no blob of its devices"
    gone[0].unlink()
    rows_parsed[0] = 0
    with manager(local_cluster, prefetch_on_start=False) as m:
        assert_trees_bitwise_equal(state, m.restore(9))
        rep = m.last_restore_report
        assert rows_parsed[0] == 0, rows_parsed[0]
        assert rep.bytes_by_tier["peer"] > 0, rep


def test_a_replaced_host_pulls_its_parts_and_adopts_the_step_without_a_row(local_cluster, rows_parsed):
    """A replaced node (its ramdisk empty: no step, no record): it pulls whole the parts it reads from the
    hosts that hold them (its data-parallel twin's), fetches the manifest from a keeper itself and commits
    the step again. The head names the keepers; it neither reads nor sends the manifest."""
    state = make_state(4)
    with manager(local_cluster, replication_factor=2) as m:
        m.save(4, state)
        m.wait_until_finished()
        m.wait_for_replication()
    local_cluster.wipe("s0-h1")  # its ramdisk is lost: its part is held by its peer copies only
    local_cluster.restart("s0-h1")
    rows_parsed[0] = 0
    with manager(local_cluster, replication_factor=2, prefetch_on_start=False) as m:
        assert_trees_bitwise_equal(state, m.restore(4))
        rep = m.last_restore_report
        assert rep.bytes_by_tier["peer"] > 0
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows to refill a replaced host"
        assert any(s.step == 4 for s in m.step_status())
    assert (local_cluster.store_root("s0-h1") / "steps" / "000000000004.json").exists()  # committed there again


def test_the_start_up_pull_refills_a_replaced_host_by_the_writers_parts_without_a_row(local_cluster, rows_parsed):
    """The start-up pull (the restore waits for it) plans a replaced node's refill from the header as the
    restore does: it pulls the parts it reads whole and adopts the step, and the head parses no shard row;
    the restore after it then moves nothing."""
    state = make_state(6)
    with manager(local_cluster, replication_factor=2) as m:
        m.save(6, state)
        m.wait_until_finished()
        m.wait_for_replication()
    local_cluster.wipe("s1-h0")
    local_cluster.restart("s1-h0")
    rows_parsed[0] = 0
    with manager(local_cluster, replication_factor=2) as m:
        pre = m.wait_for_prefetch()
        assert pre is not None and pre.step == 6 and pre.source == "cluster" and pre.bytes_by_tier["peer"] > 0, pre
        assert rows_parsed[0] == 0, f"the start-up pull parsed {rows_parsed[0]} shard rows to refill a replaced host"
        assert (local_cluster.store_root("s1-h0") / "steps" / "000000000006.json").exists()  # adopted
        assert_trees_bitwise_equal(state, m.restore(6))
        rep = m.last_restore_report
        assert rep.prefetched and rep.bytes_by_tier["peer"] == pre.bytes_by_tier["peer"], rep
        assert rows_parsed[0] == 0


def test_status_sums_up_a_whole_job_without_a_blob_row(local_cluster, rows_parsed, capsys, monkeypatch,
                                                        whole_reads):
    """Status of a whole job: from the header and each host's word on its own share (O(hosts)); no
    shard row parsed, and no host's bitmap over the step's blob names read (what the rows path reads)."""
    import json

    from mtc.head.replication import plan as replication_plan
    from mtc.head.tools.cli.main import main

    bits = [0]
    real = replication_plan.protocol.decode_bitmap

    def counting(held, n):
        bits[0] += n
        return real(held, n)

    monkeypatch.setattr(replication_plan.protocol, "decode_bitmap", counting)
    with manager(local_cluster, replication_factor=2) as m:
        m.save(1, make_state(1))
        m.save(2, make_state(2))
        m.wait_until_finished()
        assert m.wait_for_replication().replicated
    rows_parsed[0] = bits[0] = 0
    assert main(["status", "--cluster-spec", str(local_cluster.spec_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert rows_parsed[0] == 0 and bits[0] == 0, (rows_parsed[0], bits[0])
    assert [(r["step"], r["replicated"], r["min_copies"], r["restorable"]) for r in st["steps"]] == [
        (1, True, 2, True), (2, True, 2, True)]
    assert st["choice"] == 2
    # A host that lost its ramdisk: its share is whole on one slice only (the peer copy), which the keeper of
    # the copy says by writer: still no row read, and the lost host named.
    local_cluster.wipe("s1-h1")
    local_cluster.restart("s1-h1")
    assert main(["status", "--cluster-spec", str(local_cluster.spec_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert rows_parsed[0] == 0 and bits[0] == 0, (rows_parsed[0], bits[0])
    assert [(r["step"], r["replicated"], r["min_copies"], r["restorable"]) for r in st["steps"]] == [
        (1, False, 1, True), (2, False, 1, True)]
    assert all("s1-h1 no longer hold" in r["why_not"] for r in st["steps"]), st["steps"]
    # --verify maps every host's bitmap with the step's blob names, read from the parts' columns: no whole
    # manifest read (no shard record made) on the head.
    whole_reads[0] = 0
    assert main(["status", "--cluster-spec", str(local_cluster.spec_path), "--json", "--verify"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert whole_reads[0] == 0 and st["verified"]["copies"] > 0 and not st["verified"]["corrupt"], st["verified"]


def test_a_backup_reads_no_shard_row_on_the_head_and_uploads_each_box_once(local_cluster, ramdisk, rows_parsed):
    """The hosts share the uploads out among themselves (each unique box by one of the hosts that hold
    it) and a keeper finalizes from its own copy: the head reads no shard row. The backup restores bit
    for bit after every ramdisk is lost."""
    state = make_state(5)
    cfg = dict(base_output_directory=str(ramdisk / "bucket"), run_name="r",
               multi_tier_checkpointing_backup_interval_steps=1)
    with manager(local_cluster, **cfg) as m:
        rows_parsed[0] = 0  # from the save on: replication (data-parallel twins) and the backup read no row
        m.save(5, state)
        m.wait_until_finished()
        assert m.wait_for_replication().replicated
        report = m.wait_for_backup()
        assert report.error is None and rows_parsed[0] == 0, (report, rows_parsed[0])
        assert rows_parsed[1] > 0  # (the save's twin check: the spy sees the part reads it is to count)
        want = {sh.blob for a in m.manifest(5).arrays for sh in a.shards}
        assert report.uploaded_blobs == len(want), (report.uploaded_blobs, len(want))  # each once, none left out
        assert len([h for h, n in report.bytes_by_host.items() if n]) >= 2  # spread over the holders
        # The scrub goes by parts too: the head reads the header, each host its own part by range, and hashes
        # the blobs that fall to it as the uploads did: every unique box once, not once per data-parallel twin.
        from mtc.head.backup.scrub import scrub_backups

        rows_parsed[0] = 0  # (the test's own read of the manifest above)
        scrub = scrub_backups(m._dispatch, backups=1)
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows to scrub a backup"
        (checked,) = scrub.backups
        assert checked.checked == len(want) and checked.ok and not checked.bad, (checked, len(want))
    for h in local_cluster.hosts:
        local_cluster.wipe(h)
        local_cluster.restart(h)
    rows_parsed[0] = 0
    with manager(local_cluster, **cfg) as m:
        # Each host reads the header and its own part of the backup's manifest by range; the head the header.
        assert_trees_bitwise_equal(state, m.restore(5))
        rep = m.last_restore_report
        assert rep.source != "cluster" and rep.bytes_by_tier["backup"] > 0 and rep.bytes_by_tier["peer"] == 0
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows on a restore from the backup"
        whole = (ramdisk / "bucket" / "r" / "mtc" / "backups" / f"{rep.source}.json").stat().st_size

        def parts_read() -> list[tuple[int, int]]:
            return [tuple(map(int, hit)) for h in local_cluster.hosts for hit in re.findall(
                rf"backup {rep.source}: read the manifest's header and (\d+) part\(s\) by range \((\d+) bytes\)",
                local_cluster.log_path(h).read_text())]

        # (the scrub's, then the start-up pull's, then the restore's: each host its own part)
        scrubbed, read = parts_read()[:len(local_cluster.hosts)], parts_read()[len(local_cluster.hosts):]
        assert all(n == 1 for n, _ in scrubbed) and len(scrubbed) == len(local_cluster.hosts), scrubbed
        assert len(read) == 2 * len(local_cluster.hosts) and all(n == 1 and b < whole for n, b in read), (read, whole)
        # Onto another sharding each host reads the parts its new boxes overlap, by range; no row on the head.
        got = m.restore(5, target=resharded(state))
        assert_trees_bitwise_equal(state, got, check_sharding=False)
        assert got["params"]["w"].sharding == resharded(state)["params"]["w"].sharding
        assert rows_parsed[0] == 0, f"the head parsed {rows_parsed[0]} shard rows on a resharded backup restore"
        again = parts_read()[len(scrubbed) + len(read):]
        assert len(again) == len(local_cluster.hosts) and any(n > 1 for n, _ in again), again


def by_columns_reversed(state) -> dict:
    """``like(state)`` with "w" split by columns over the devices in reverse order: a host then loads one
    of the two column boxes of the part it reads besides its own, none of that part's other arrays."""
    target = like(state)
    mesh = Mesh(np.array(jax.devices()[::-1]), ("x",))
    target["params"]["w"] = jax.ShapeDtypeStruct((64, 48), np.float32, sharding=NamedSharding(mesh, P(None, "x")))
    return target


def loaded_bytes(manifest: fmt.StepManifest, target, hosts: list[str], per_host: int) -> int:
    """The bytes of the blobs that each host's loads of ``target`` overlap, summed over the hosts: what
    they download from the backup when their ramdisks hold nothing."""
    by_key = {a.key: a for a in manifest.arrays}
    blobs: dict[str, dict[str, int]] = {h: {} for h in hosts}
    for key, leaf in zip(*tree_lib.flatten(target)[:2]):
        rec = by_key[key]
        sharding = getattr(leaf, "sharding", None)
        if rec.kind == "scalar":
            continue
        if sharding is None:  # a host numpy leaf: every host loads it whole
            for h in hosts:
                blobs[h].update({s.blob: s.nbytes for s in rec.shards})
            continue
        for dev, idx in sharding.devices_indices_map(rec.shape).items():
            box = fmt.box_from_index(idx, rec.shape)
            blobs[hosts[dev.id // per_host]].update(
                {s.blob: s.nbytes for s in rec.shards
                 if all(lo < b_hi and b_lo < hi for (lo, hi), (b_lo, b_hi) in zip(s.box, box))})
    return sum(n for held in blobs.values() for n in held.values())


def test_a_backup_restore_downloads_only_the_blobs_each_host_loads(local_cluster, ramdisk, rows_parsed):
    """From the backup by parts, a host downloads of the writers' parts it reads only the blobs whose
    boxes overlap those it loads: after a resize, not a writer's other boxes; in a partial restore, not
    the arrays left out. Bit for bit, and no shard row on the head."""
    state = make_state(7)
    cfg = dict(base_output_directory=str(ramdisk / "bucket"), run_name="r",
               multi_tier_checkpointing_backup_interval_steps=1)
    with manager(local_cluster, **cfg) as m:
        m.save(7, state)
        m.wait_until_finished()
        assert m.wait_for_backup().error is None
        saved = m.manifest(7)
    hosts = local_cluster.hosts
    targets = [("columns reversed", by_columns_reversed(state), False),
               ("params alone", {"params": like(state)["params"]}, True)]
    for what, target, partial in targets:
        for h in hosts:
            local_cluster.wipe(h)
            local_cluster.restart(h)
        rows_parsed[0] = 0
        with manager(local_cluster, prefetch_on_start=False, **cfg) as m:
            got = m.restore(7, target=target, partial=partial)
            want = state if not partial else {"params": state["params"]}
            assert_trees_bitwise_equal(want, got, check_sharding=False)
            rep = m.last_restore_report
            assert rep.source != "cluster" and rows_parsed[0] == 0, (what, rep, rows_parsed[0])
            loaded = loaded_bytes(saved, target, hosts, local_cluster.devices_per_host)
            assert rep.bytes_by_tier["backup"] == loaded, (what, rep.bytes_by_tier, loaded)
            whole_parts = sum(saved.blob_sizes()[b] for h in hosts for b in saved.part_blob_names(h))
            assert loaded < whole_parts, (what, loaded, whole_parts)


def fsdp_state(seed: int) -> dict:
    """Every array split over all 8 devices: no data-parallel twin, each box on one host only."""
    rng = np.random.default_rng(seed)
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    fsdp = NamedSharding(m, P(("data", "model")))
    return {"a": jax.device_put(random_array(rng, (64, 8), np.float32), fsdp),
            "b": jax.device_put(random_array(rng, (32, 6), ml_dtypes.bfloat16), fsdp),
            "c": jax.device_put(random_array(rng, (16,), np.int32), fsdp),
            "rng": random_array(rng, (4,), np.uint32), "step": seed}


def test_a_lost_part_held_in_pieces_by_two_hosts_restores_without_a_row(local_cluster, rows_parsed, capsys,
                                                                        monkeypatch, whole_reads):
    """A host dies whose part no host holds whole, but two hosts hold its blobs between them (a per-blob
    replication spreads a part over several hosts; one cut short leaves pieces): their inventories report
    the pieces, and the head finds the part whole from them without a blob row. The hosts that read its
    boxes pull them blob by blob from the pieces' holders; the restore is bit for bit, and status shows the
    step restorable, naming the holders of the pieces."""
    import json

    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
    from mtc.head.tools.cli.main import main

    state = fsdp_state(7)
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1, replication_factor=1)
    d = ClusterDispatcher(cfg)
    lost = "s0-h1"
    with CheckpointManager(cfg, dispatcher=d) as m:
        m.save(7, state)
        m.wait_until_finished()
        whole = m.manifest(7)
        sizes = whole.blob_sizes()
        everyone = set.intersection(*(set(whole.part_blobs[h]) for h in whole.part_blobs))  # the host numpy leaf
        theirs = sorted(set(whole.part_blobs[lost]) - everyone)
        assert len(theirs) >= 4, theirs
        halves = {"s1-h0": theirs[::2], "s1-h1": theirs[1::2]}
        got = d.peer_pull(7, {h: [(b, sizes[b], [lost]) for b in bs] for h, bs in halves.items()})
        assert all(not r.error and not r.failed and r.pulled == len(halves[h]) for h, r in got.items()), got
    local_cluster.wipe(lost)
    local_cluster.restart(lost)
    # The rows path reads the whole manifest (its parts by columns) where a host committed a record, and every
    # host's bitmap over the step's blob names: both counted.
    from mtc.head.replication import plan as replication_plan

    real_bits = replication_plan.protocol.decode_bitmap

    def bitmap(held, n):
        whole_reads[0] += n == len(sizes)
        return real_bits(held, n)

    whole_reads[0] = 0
    monkeypatch.setattr(replication_plan.protocol, "decode_bitmap", bitmap)
    rows_parsed[0] = 0
    assert main(["status", "--cluster-spec", str(local_cluster.spec_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert rows_parsed[0] == 0 and whole_reads[0] == 0, f"status read {whole_reads[0]} manifests, bitmaps"
    assert [(r["step"], r["restorable"], r["min_copies"]) for r in st["steps"]] == [(7, True, 1)], st["steps"]
    assert "s0-h1's blobs are held in pieces by s1-h0, s1-h1)" in st["steps"][0]["why_not"], st["steps"]
    with manager(local_cluster, replication_factor=1, prefetch_on_start=False) as m:
        assert m.latest_step() == 7
        assert_trees_bitwise_equal(state, m.restore(7))
        rep = m.last_restore_report
        assert rep.bytes_by_tier["peer"] == sum(sizes[b] for b in whole.part_blobs[lost]), rep  # into the new node
        assert rows_parsed[0] == 0 and whole_reads[0] == 0, \
            f"the head read {whole_reads[0]} whole manifests, bitmaps to restore a part held in pieces"


@pytest.mark.parametrize("layout", ["twins", "peer copies"])
def test_replication_with_a_saving_host_down_reads_no_manifest(local_cluster, rows_parsed, whole_reads, layout):
    """A saving host dies after the commit, before its copies are counted. Its share is told from the header
    (data-parallel twins wrote exactly its boxes) or from the hosts that list its part among those they hold
    whole (its peer copy), not from the manifest's rows: the copies its boxes still lack on the other slice
    are made share by share, and the head reads no manifest (before, every attempt of the half hour
    replication keeps trying while the host is down read every row)."""
    import threading

    from mtc.head.commit import CommittedStep
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
    from mtc.head.replication.loop import Replicator
    from mtc.head.replication.plan import ReplicationStrategy

    state = data_parallel_state(5, jax.devices()) if layout == "twins" else make_state(5)
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1, replication_factor=2)
    d = ClusterDispatcher(cfg)
    with CheckpointManager(cfg, dispatcher=d) as m:
        m.save(5, state)
        m.wait_until_finished()
        assert m.wait_for_replication().replicated
        saved = m.manifest(5)
        data, digest = saved.to_json(), saved.digest
        whole_reads[0] = 0
        rows_parsed[0] = 0
        local_cluster.kill("s1-h1")
        # The step as the save hands it to replication: its bytes, unread, and the hosts that saved it.
        r = Replicator(d, cfg, ReplicationStrategy(2), threading.Event())
        try:
            r.submit(CommittedStep(5, data, digest=digest, hosts=tuple(local_cluster.hosts)))
            report = r.wait(timeout=120)
        finally:
            r.close()
        assert whole_reads[0] == 0 and rows_parsed[0] == 0, (whole_reads[0], rows_parsed[0])
        assert report.replicated and report.error is None, report
        # The other host of the dead one's slice took a copy of what only slice 0 held now.
        assert report.moved_bytes > 0 and report.moved_blobs > 0, report


def test_a_down_host_whose_part_no_other_host_holds_is_waited_for_without_a_row(local_cluster, ramdisk, rows_parsed,
                                                                                whole_reads):
    """FSDP over both slices, saved without copies; then a saving host dies. Its part is on no other host, so
    nothing can copy or upload it until it is back. The backup fails at once, saying so; replication copies
    the others' shares and retries by shares. No row is read (before, the backup read every row and then failed
    on the down host, and every attempt of the half hour replication keeps trying read every row: O(shards)
    of the training process's CPU each time, for nothing). Back, the host's share gets its copy."""
    import dataclasses
    import threading
    import time

    from mtc.head.commit import CommittedStep
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
    from mtc.head.replication.loop import Replicator
    from mtc.head.replication.plan import ReplicationStrategy

    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1, replication_factor=1, base_output_directory=str(ramdisk / "bucket"),
                    run_name="r", multi_tier_checkpointing_backup_interval_steps=100)
    d = ClusterDispatcher(cfg)
    with CheckpointManager(cfg, dispatcher=d) as m:
        for s in (4, 5):  # step 4's backup is due (the first); step 5's is not
            m.save(s, fsdp_state(s))
            m.wait_until_finished()
        assert m.wait_for_backup().step == 4
        saved = m.manifest(5)
        data, digest = saved.to_json(), saved.digest
        whole_reads[0] = 0
        rows_parsed[0] = 0
        local_cluster.kill("s1-h1")
        backup = backup_now(d, cfg, CommittedStep(5, data, digest=digest, hosts=tuple(local_cluster.hosts)))
        assert backup.step == 5 and "PartUnreachableError: host s1-h1 saved part of step 5 and is down" in backup.error
        assert whole_reads[0] == 0 and rows_parsed[0] == 0, (whole_reads[0], rows_parsed[0])
        closing = threading.Event()
        r = Replicator(d, dataclasses.replace(cfg, replication_factor=2), ReplicationStrategy(2), closing)
        try:
            r.submit(CommittedStep(5, data, digest=digest, hosts=tuple(local_cluster.hosts)))
            deadline = time.monotonic() + 60
            while ((r._progress or {}).get("attempts") or 0) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            progress = dict(r._progress or {})  # (the loop's own record of its attempts)
            assert progress.get("attempts", 0) >= 3 and "s1-h1" in progress.get("short", {}), (progress, r.last_report)
            assert r.status_of(5)["replicating"] and "s1-h1" in r.status_of(5)["short_of_copies"]
            assert whole_reads[0] == 0 and rows_parsed[0] == 0, (whole_reads[0], rows_parsed[0])
            local_cluster.restart("s1-h1")
            report = r.wait(timeout=120)
        finally:
            closing.set()  # (a failed assertion above leaves it retrying for half an hour otherwise)
            r.close()
        assert whole_reads[0] == 0 and rows_parsed[0] == 0, (whole_reads[0], rows_parsed[0])
        assert report.replicated and report.error is None and report.moved_blobs > 0, report


@pytest.mark.parametrize("layout", ["twins", "peer copies", "pieces"])
def test_a_backup_with_a_writer_down_is_uploaded_by_its_stand_ins_without_a_row(local_cluster, ramdisk, rows_parsed,
                                                                               whole_reads, layout):
    """A host that saved the step is down when its backup is due. Its share of the uploads goes to a stand-in:
    a data-parallel twin (the same boxes, its own part's rows), the host that keeps a peer copy of its part,
    or every host that holds a piece of it (each the blobs it holds). The head reads no manifest; the backup
    holds every blob and restores bit for bit once every ramdisk is lost (before, the head read the manifest,
    gave the down host blobs to upload, and the backup failed)."""
    from mtc.head.commit import CommittedStep
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher

    make = {"twins": lambda s: data_parallel_state(s, jax.devices()), "peer copies": make_state, "pieces": fsdp_state}
    states = {s: make[layout](s) for s in (4, 5)}
    cfg = MTCConfig(local_checkpoint_directory=str(local_cluster.root), cluster_spec=str(local_cluster.spec_path),
                    local_checkpoint_period=1, replication_factor=1 if layout == "pieces" else 2,
                    base_output_directory=str(ramdisk / "bucket"), run_name="r",
                    multi_tier_checkpointing_backup_interval_steps=100)
    d = ClusterDispatcher(cfg)
    with CheckpointManager(cfg, dispatcher=d) as m:
        for s in (4, 5):  # step 4's backup is due (the first); step 5's is not
            m.save(s, states[s])
            m.wait_until_finished()
            assert layout == "pieces" or m.wait_for_replication().replicated  # (factor 1: no replication)
        assert m.wait_for_backup().step == 4
        saved = m.manifest(5)
        data, digest = saved.to_json(), saved.digest
        if layout == "pieces":  # no copy of s1-h1's part: halves of it on two hosts of slice 0
            everyone = set.intersection(*(set(saved.part_blobs[h]) for h in saved.part_blobs))
            theirs = sorted(set(saved.part_blobs["s1-h1"]) - everyone)
            sizes = saved.blob_sizes()
            got = d.peer_pull(5, {h: [(b, sizes[b], ["s1-h1"]) for b in bs]
                                  for h, bs in {"s0-h0": theirs[::2], "s0-h1": theirs[1::2]}.items()})
            assert all(not r.error and not r.failed for r in got.values()), got
        whole_reads[0] = 0
        rows_parsed[0] = 0
        local_cluster.kill("s1-h1")
        report = backup_now(d, cfg, CommittedStep(5, data, digest=digest, hosts=tuple(local_cluster.hosts)))
        assert report.error is None and report.step == 5, report
        assert whole_reads[0] == 0 and rows_parsed[0] == 0, (whole_reads[0], rows_parsed[0])
        assert "s1-h1" not in report.bytes_by_host
        assert report.uploaded_blobs + report.skipped_blobs >= len(saved.blob_names()), report
    for h in local_cluster.hosts:
        local_cluster.wipe(h)
        local_cluster.restart(h)
    with manager(local_cluster, base_output_directory=str(ramdisk / "bucket"), run_name="r") as m:
        assert_trees_bitwise_equal(states[5], m.restore(5))
        assert m.last_restore_report.bytes_by_tier["backup"] > 0
