"""Phase 2 at scale: the whole manifest goes to a few keeper hosts; the others commit a record of
the decision and fetch the manifest from a keeper, over the peer port, when they first need it."""

from __future__ import annotations

import numpy as np
import pytest

from mtc.head.commit import choose_keepers, commit_messages
from mtc.shared import format as fmt
from mtc.shared.errors import ManifestError, StepNotFoundError
from mtc.sidecar.service import SidecarService

pytestmark = pytest.mark.unit

TOKEN = "test-token-keepers"
HOSTS = ["h0", "h1", "h2"]


def test_keepers_are_on_distinct_slices_and_move_with_the_step():
    slices = {"a0": 0, "a1": 0, "b0": 1, "b1": 1, "c0": 2}
    picks = [choose_keepers(list(slices), slices.__getitem__, step, 2) for step in range(5)]
    for keepers in picks:
        assert len(keepers) == 2 and len({slices[h] for h in keepers}) == 2
    assert len({k[0] for k in picks}) == 5  # the first keeper rotates over every host
    assert choose_keepers(["x"], lambda h: 0, 7, 2) == ["x"]
    assert sorted(choose_keepers(["x", "y"], lambda h: 0, 1, 2)) == ["x", "y"]  # one slice: distinct hosts


@pytest.fixture
def services(tmp_path):
    svcs = {}
    for h in HOSTS:
        svc = SidecarService(tmp_path / h, host_id=h)
        svc.start_peer_service(("127.0.0.1", 0), TOKEN)
        svcs[h] = svc
    yield svcs
    for svc in svcs.values():
        svc.close()


def _save(svcs, step: int, keepers: list[str]) -> tuple[bytes, str, np.ndarray]:
    data = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) + step
    for i, h in enumerate(HOSTS):
        svcs[h].saves.write_shards(step, [(0, ((2 * i, 2 * i + 2), (0, 4)), data[2 * i:2 * i + 2])])
    rec = fmt.ArrayRecord(key="['w']", kind="jax", dtype="float32", shape=(6, 4),
                          sharding={"type": "named", "mesh_shape": [3], "axis_names": ["x"],
                                    "device_ids": [0, 1, 2], "spec": ["x"]})
    parts = [(h, svcs[h].saves.part_bytes(step)) for h in HOSTS]
    manifest, digest = fmt.encode_step(step=step, arrays=[rec], tree=None, created=0.0, topology={"hosts": HOSTS},
                                       fingerprint={}, parts=parts)
    where = [[k, svcs[k].peer_address] for k in keepers]
    for h in HOSTS:
        if h in keepers:
            assert svcs[h].commit(step, manifest, digest=digest)["keeper"]
        else:
            assert not svcs[h].commit(step, None, digest=digest, keepers=where)["keeper"]
    return manifest, digest, data


def test_a_host_that_is_not_a_keeper_commits_a_record_and_fetches_the_manifest_when_needed(services):
    manifest, digest, data = _save(services, 1, ["h0"])
    assert fmt.CommitRecord.parse(services["h0"].store.catalog.read(1)) is None  # the keeper: the manifest
    rec = fmt.CommitRecord.parse(services["h2"].store.catalog.read(1))
    assert rec.digest == digest and rec.keepers == (("h0", services["h0"].peer_address),)
    # Its own blobs are kept alive by the record alone (garbage collection reads it).
    assert fmt.collect_blob_names(services["h2"].store.catalog.read(1)) == rec.host_manifest().blob_names()
    assert services["h2"].store.catalog.committed() == [1]
    # First need of the whole manifest: fetched from the keeper, checked, and it replaces the record.
    m = services["h2"].committed.manifest(1)
    assert m.digest == digest and services["h2"].store.catalog.read(1) == manifest
    (got,), errors = services["h2"].read_boxes_each(1, [("['w']", ((4, 6), (0, 4)))])
    assert not errors and np.asarray(got).tobytes() == data[4:6].tobytes()


def test_a_record_is_replaced_only_by_its_manifest_and_a_step_gone_meanwhile_says_so(services, monkeypatch, caplog):
    manifest, digest, _ = _save(services, 2, ["h0"])
    store = services["h2"].store
    record = store.catalog.read(2)
    store.upgrade_step(2, manifest, "0" * len(digest))  # another record's digest: the file stays as it is
    assert store.catalog.read(2) == record
    store.upgrade_step(2, manifest, digest)
    assert store.catalog.read(2) == manifest
    store.upgrade_step(2, manifest, digest)  # a manifest already: nothing to replace
    assert store.catalog.read(2) == manifest
    store.delete_step(2)
    with pytest.raises(StepNotFoundError):
        store.upgrade_step(2, manifest, digest)

    # Pruned between the fetch and the upgrade: the read that fetched the manifest still gets it.
    _save(services, 3, ["h0"])
    def pruned(step, step_manifest, digest):
        raise StepNotFoundError(f"step {step} is not committed")

    monkeypatch.setattr(services["h1"].store, "upgrade_step", pruned)
    with caplog.at_level("INFO", logger="mtc.sidecar.committed"):
        assert services["h1"].committed.manifest(3).step == 3
    assert "kept step 3's commit record" in caplog.text


def test_without_a_keeper_the_step_is_damaged_not_wrong(services):
    _save(services, 2, ["h0"])
    services["h0"].close()  # the only keeper is gone
    with pytest.raises(ManifestError, match="no keeper could give its manifest.*h0"):
        services["h1"].committed.manifest(2)
    # Its inventory needs no manifest: it reports its own part, which the head reads with the manifest.
    (row,) = services["h1"].committed.inventory()["steps"]
    assert row["part"] and row["step"] == 2 and row["blobs"] == row["local_blobs"] == 1


def test_the_head_reads_part_rows_with_the_manifest(services):
    from mtc.head.dispatch.interface import HostInventory
    from mtc.head.replication.plan import step_views

    manifest, digest, _ = _save(services, 4, ["h0"])
    inv = {h: HostInventory.from_wire(h, svc.committed.inventory()) for h, svc in services.items()}
    assert [s.part for s in inv["h1"].steps] == [True] and [s.part for s in inv["h0"].steps] == [False]
    m = fmt.StepManifest.from_json(manifest)
    view = step_views(inv, lambda s, d: m if (s, d) == (4, digest) else None)[4]
    assert view.restorable and view.hosts == ("h0", "h1", "h2") and view.manifest == digest
    holders = view.by_name(sorted(m.blob_names()))
    assert {b: hs for b, hs in holders.items()} == {b: {h} for h, bs in m.part_blobs.items() for b in bs}
    # Without the manifest the records' rows cannot be read: only the keeper's own blobs count.
    blind = step_views(inv)[4]
    assert not blind.restorable and blind.hosts == ("h0",)
    # Records never fetched anything for an inventory.
    assert fmt.CommitRecord.parse(services["h2"].store.catalog.read(4)) is not None


def test_a_step_whose_parts_are_whole_where_written_is_seen_from_the_header_alone(services):
    import dataclasses

    from mtc.head.dispatch.interface import HostInventory
    from mtc.head.replication.plan import step_views

    manifest, digest, _ = _save(services, 4, ["h0"])
    inv = {h: HostInventory.from_wire(h, svc.committed.inventory()) for h, svc in services.items()}
    header = fmt.StepHeader.from_line(manifest)
    m = fmt.StepManifest.from_json(manifest)
    read = []

    def resolve(s, d):
        read.append(s)
        return m if (s, d) == (4, digest) else None

    view = step_views(inv, resolve, lambda s, d: header if (s, d) == (4, digest) else None)[4]
    assert view.by_parts and view.restorable and view.hosts == ("h0", "h1", "h2") and not read
    assert view.part_blobs >= len(m.blob_names())
    # Asked for its holders, it reads the rows once, and they say what the view by rows says.
    assert view.by_name(sorted(m.blob_names())) == step_views(inv, resolve)[4].by_name(sorted(m.blob_names()))
    assert read == [4, 4]
    # A host that lacks a blob of its part, or one that did not answer: read by its rows, as before.
    h1 = inv["h1"].steps[0]
    short = {**inv, "h1": dataclasses.replace(inv["h1"], steps=(dataclasses.replace(h1, local_blobs=h1.blobs - 1),))}
    assert not step_views(short, resolve, lambda s, d: header)[4].by_parts
    gone = {h: i for h, i in inv.items() if h != "h2"}
    assert not step_views(gone, resolve, lambda s, d: header)[4].by_parts


def test_a_keeper_whose_copy_was_changed_is_not_believed(services):
    manifest, digest, _ = _save(services, 3, ["h0", "h1"])
    path = services["h0"].store.root / "steps" / f"{3:012d}.json"
    header, *parts = path.read_bytes().split(b"\n")
    parts[0] = parts[0].replace(b'"seconds":', b'"seconds": ')  # valid JSON, same header claim
    path.write_bytes(b"\n".join([header, *parts]))
    m = services["h2"].committed.manifest(3)  # h0's copy fails its check; h1's is taken
    assert m.digest == digest and services["h2"].store.catalog.read(3) == manifest


def _flip_a_part_digit(path) -> None:
    """Change one character of a blob name in the part of the record at ``path`` (in the columns' base64):
    still JSON and base64, same size."""
    data = bytearray(path.read_bytes())
    i = data.index(b'\\"columns\\":\\"') + 14
    i += (data.index(b'\\"', i) - i) * 3 // 4  # among the blob names, the last of the columns
    data[i] = ord("A") if data[i] != ord("A") else ord("B")
    path.write_bytes(bytes(data))


def test_a_damaged_record_is_reported_damaged_not_read_as_another_part(services):
    """Found by the soak: a flipped byte in a record's part (still valid JSON) made the host report
    blobs it does not hold; the head did not count it and did not repair it."""
    manifest, _, _ = _save(services, 5, ["h0"])
    path = services["h2"].store.root / "steps" / f"{5:012d}.json"
    _flip_a_part_digit(path)
    services["h2"].index.committed.clear()  # as after a restart: nothing to rewrite it from here
    inv = services["h2"].committed.inventory()
    assert inv["damaged"] == [5] and inv["steps"] == []
    # The head gives it the manifest the others agree on: it replaces the damaged record.
    assert services["h2"].peer_pull(5, [], {}, manifest)["adopted"]
    assert services["h2"].store.catalog.read(5) == manifest
    assert [s["step"] for s in services["h2"].committed.inventory()["steps"]] == [5]


def test_phase_2_sends_the_manifest_to_the_keepers_and_names_them_to_the_others():
    slices = {"a0": 0, "a1": 0, "b0": 1, "b1": 1}
    peers = {h: f"10.0.0.{i}:7001" for i, h in enumerate(slices)}

    def messages(hosts, peers):  # what a transport sends for the keepers the manager chose
        return commit_messages(hosts, choose_keepers(hosts, slices.__getitem__, 5, 2), peers)

    keep, where = messages(list(slices), peers)
    assert len(keep) == 2 and {slices[h] for h in keep} == {0, 1}
    assert where == [[h, peers[h]] for h in choose_keepers(list(slices), slices.__getitem__, 5, 2)]
    # A keeper the others could not fetch from (no peer address): every host keeps the manifest.
    missing = dict(peers)
    del missing[where[0][0]]
    assert messages(list(slices), missing) == (set(slices), [])
    # As many keepers as hosts: nobody is left to name them to.
    assert messages(["a0", "b0"], peers) == ({"a0", "b0"}, [])
    assert messages(["a0"], {}) == ({"a0"}, [])


def test_a_record_host_reads_its_own_shards_by_its_local_view_without_the_other_parts(services):
    manifest, digest, data = _save(services, 6, ["h0"])
    h1 = services["h1"]
    # Its own shard, exactly (a restore onto the same topology): the header from the keeper and its
    # own part suffice; the step file stays a record (the whole manifest was not fetched).
    bufs, errors = h1.read_boxes_each(6, [("['w']", ((2, 4), (0, 4)))], manifest=digest)
    assert not errors and np.asarray(bufs[0]).tobytes() == data[2:4].tobytes()
    assert fmt.CommitRecord.parse(h1.store.catalog.read(6)) is not None
    view = h1.committed.view_for(6, [("['w']", ((2, 4), (0, 4)))])
    assert view.local_part == "h1" and view.digest == digest
    assert [s.box for a in view.arrays for s in a.shards] == [((2, 4), (0, 4))]
    with pytest.raises(ManifestError, match="never written or sent"):
        view.to_json()
    # A box that is not one of its shards (a resharded restore): it reads by the whole manifest,
    # fetched (it replaces the record); the rows of h0 and h2 are not here, which the error names.
    bufs, errors = h1.read_boxes_each(6, [("['w']", ((0, 6), (0, 4)))], manifest=digest)
    assert h1.store.catalog.read(6) == manifest
    assert [e[:2] for e in errors] == [(0, "CorruptBlobError")] and "shard [0:2, 0:4]" in errors[0][2], errors


def test_a_local_view_is_checked_against_the_header_and_the_part(services):
    manifest, digest, _ = _save(services, 8, ["h0"])
    header, _, rest = manifest.partition(b"\n")
    parts = rest.split(b"\n")
    view = fmt.StepManifest.local_view(header, "h2", parts[2])
    assert view.digest == digest and view.part_blobs == {"h2": fmt.HostManifest.from_json(parts[2]).blob_names()}
    with pytest.raises(ManifestError, match="does not match its hash"):
        fmt.StepManifest.local_view(header, "h2", parts[1])  # another host's part under h2's name
    with pytest.raises(ManifestError, match="lists 0 parts of host h9"):
        fmt.StepManifest.local_view(header, "h9", parts[2])
    with pytest.raises(ManifestError, match="does not match its digest"):
        fmt.StepManifest.local_view(header.replace(b'"step":8', b'"step":9'), "h2", parts[2])
    with pytest.raises(ManifestError, match="one line"):
        fmt.StepManifest.local_view(manifest, "h2", parts[2])


def test_a_record_read_before_and_then_damaged_is_still_reported_damaged(services):
    """A record's parse is kept by its bytes, and the file is read each time: damage after an
    inventory shows in the next one."""
    _save(services, 6, ["h0"])
    assert [s["step"] for s in services["h2"].committed.inventory()["steps"]] == [6]
    path = services["h2"].store.root / "steps" / f"{6:012d}.json"
    _flip_a_part_digit(path)  # in place: the same inode and size
    services["h2"].index.committed.clear()  # nothing to rewrite it from
    inv = services["h2"].committed.inventory()
    assert inv["damaged"] == [6] and inv["steps"] == []


def test_a_sidecar_keeps_no_manifest_of_a_step_it_pruned(services):
    for step in range(1, 7):
        _save(services, step, ["h0", "h1"])
        for svc in services.values():
            svc.committed.inventory()  # the keepers load their manifests
    for svc in services.values():
        committed = svc.store.catalog.committed()
        assert committed == [5, 6]
        assert set(svc.index.manifests) <= set(committed) and set(svc.index.committed) == set(committed)


class _PrunedMeanwhile(dict):
    """A sidecar's committed-bytes table whose entries another thread's commit prunes just before
    they are looked up: the interleaving a commit that prunes and an inventory can have."""

    def __getitem__(self, key):
        self.pop(key, None)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.pop(key, None)
        return super().get(key, default)


def test_an_inventory_beside_a_commit_that_prunes_is_not_an_error(tmp_path):
    svc = SidecarService(tmp_path / "h", host_id="h", max_to_keep=1)
    try:
        rec = fmt.ArrayRecord(key="['w']", kind="jax", dtype="float32", shape=(2, 4),
                              sharding={"type": "named", "mesh_shape": [1], "axis_names": ["x"],
                                        "device_ids": [0], "spec": ["x"]})
        for step in (1, 2):
            svc.saves.write_shards(step, [(0, ((0, 2), (0, 4)), np.full((2, 4), step, np.float32))])
            data, digest = fmt.encode_step(step=step, arrays=[rec], tree=None, created=0.0,
                                           topology={"hosts": ["h"]}, fingerprint={},
                                           parts=[("h", svc.saves.part_bytes(step))])
            svc.commit(step, data, digest=digest)
        # Step 1's file is pruned (by step 2's commit); its bytes are still in the table when the
        # inventory lists the steps, and gone when it looks them up.
        svc.index.committed = _PrunedMeanwhile({**svc.index.committed, 1: b"{}"})
        svc.index.manifests.pop(1, None)
        inv = svc.committed.inventory()
        assert [r["step"] for r in inv["steps"]] == [2] and inv["damaged"] == []
        assert svc.store.catalog.committed() == [2]  # a pruned step is never brought back
    finally:
        svc.close()


def test_a_committed_step_given_its_manifest_unjoined_reads_the_header_alone_and_joins_only_to_read_it(
        services, monkeypatch):
    """The save hands replication and the backup the manifest as it sent it (its header and parts, never
    joined): the header is read from the first buffer, and the manifest, when one of them asks for it,
    reads as the joined bytes do."""
    from mtc.head.commit import CommittedStep
    from mtc.shared import protocol

    manifest, digest, _ = _save(services, 6, ["h0"])
    header = fmt.StepHeader.from_line(manifest)
    parts = list(zip([h for h, _ in header.parts], manifest.split(b"\n")[1:]))
    segments, again = fmt.encode_step_segments(step=6, arrays=header.arrays, tree=None, created=0.0,
                                               topology={"hosts": HOSTS}, fingerprint={}, parts=parts)
    assert again == digest and b"".join(segments) == manifest and segments[0] == manifest.partition(b"\n")[0]
    joined = []
    real = protocol.Gathered.join
    monkeypatch.setattr(protocol.Gathered, "join", lambda self: joined.append(1) or real(self))
    step = CommittedStep(6, protocol.Gathered(tuple(segments)), digest=digest, hosts=tuple(HOSTS))
    assert step.header.digest == digest and not joined
    assert step.manifest.digest == digest and joined == [1]
    assert step.manifest.blob_names() == fmt.StepManifest.from_json(manifest).blob_names()
