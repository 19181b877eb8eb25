"""A backup's part index: each host reads the header and its own part of a backup manifest by range,
every byte checked against SHA-256 hashes the seal covers (a real local store; the job key signs)."""

from __future__ import annotations

import hashlib
import json

import pytest

from mtc.shared import backup_index, backup_layout as layout
from mtc.shared import format as fmt
from mtc.shared.backup_seals import Seals
from mtc.shared.errors import ManifestError
from mtc.shared.job_key import JobKey
from mtc.shared.objstore.local import LocalStore

NAME = layout.backup_name(7, 0)
HOSTS = ("h0", "h1", "h2")


def _blob(i: int) -> str:
    return hashlib.md5(str(i).encode()).hexdigest()


def _manifest() -> bytes:
    w = fmt.ArrayRecord(key="['w']", kind="jax", dtype="float32", shape=(6, 2),
                        sharding={"type": "named", "mesh_shape": [3], "axis_names": ["x"], "device_ids": [0, 1, 2],
                                  "spec": ["x"]})
    parts = [(h, fmt.HostManifest(7, h, (fmt.HostShard(0, ((2 * i, 2 * i + 2), (0, 2)), _blob(i), 16),), 16,
                                  0.1).to_json()) for i, h in enumerate(HOSTS)]
    data, _ = fmt.encode_step(step=7, arrays=[w], tree={"t": "dict"}, created=1.0,
                              topology={"devices": {h: [i] for i, h in enumerate(HOSTS)}}, fingerprint={},
                              parts=parts)
    return data


@pytest.fixture
def backup(tmp_path):
    """A store holding backup NAME as a finalize writes it: the part index, the seal, the manifest."""
    store, key = LocalStore(tmp_path / "root"), JobKey(b"k" * 32)
    data = _manifest()
    index = backup_index.make(NAME, data)
    store.put_bytes(layout.parts_object(NAME), index)
    Seals(store, key, "file:///x/run/mtc").write(store, NAME, data, index)
    store.put_bytes(layout.manifest_object(NAME), data)
    return store, key, data


def _read(store, key, host):
    got = backup_index.read(store, Seals(store, key, "file:///x/run/mtc"), NAME, [host] if host else ())
    return None if got is None else (got[0], got[1][host] if host else None)


def _change(store, obj: str, at: int) -> None:
    data = bytearray(store.get_bytes(obj))
    data[at] ^= 0x01
    store.put_bytes(obj, bytes(data))


def test_each_host_reads_the_header_and_its_own_part(backup):
    store, key, data = backup
    header, *parts = data.split(b"\n")
    for host, part in zip(HOSTS, parts):
        assert _read(store, key, host) == (header, part)
        view = fmt.StepManifest.local_view(header, host, part)
        assert view.digest == fmt.StepManifest.from_json(data).digest
    assert _read(store, key, None) == (header, None)
    # several parts (after a resize: the writers' parts a host's new boxes overlap), each checked
    got = backup_index.read(store, Seals(store, key, "file:///x/run/mtc"), NAME, ["h2", "h0"])
    assert got == (header, {"h2": parts[2], "h0": parts[0]})
    view = fmt.StepManifest.parts_view(header, got[1])
    assert sorted(sh.blob for sh in view.arrays[0].shards) == sorted([_blob(0), _blob(2)])
    with pytest.raises(ManifestError, match="has no part of host h9"):
        _read(store, key, "h9")
    # The seal's fields for the whole manifest are those of a seal without an index: a version that does
    # not know indexes checks the manifest as before.
    Seals(store, key, "file:///x/run/mtc").check_manifest(NAME, data)


def test_a_changed_part_fails_for_its_host_only(backup):
    store, key, data = backup
    header, p0, p1, p2 = data.split(b"\n")
    _change(store, layout.manifest_object(NAME), len(header) + 1 + len(p0) + 1 + 40)  # inside h1's part
    with pytest.raises(ManifestError, match="the part of host h1 is not the one its part index names"):
        _read(store, key, "h1")
    assert _read(store, key, "h0") == (header, p0) and _read(store, key, "h2") == (header, p2)


def test_a_changed_index_reads_the_whole_manifest_and_a_changed_header_is_refused(backup, caplog):
    """An index that does not match its seal (damaged, or changed by someone without the key) is not
    read by: the manifest is read whole, against its own seal (a damaged index costs no backup)."""
    store, key, data = backup
    _change(store, layout.parts_object(NAME), 30)
    assert _read(store, key, "h0") is None
    assert "its part index is not the one its seal names" in caplog.text
    # An index re-made for a changed header, without the key, does not match its seal either.
    changed = data.replace(b'"created":1.0', b'"created":2.0', 1)
    store.put_bytes(layout.parts_object(NAME), backup_index.make(NAME, changed))
    store.put_bytes(layout.manifest_object(NAME), changed)
    assert _read(store, key, None) is None
    with pytest.raises(ManifestError, match="not the one its seal names"):  # and the whole manifest is refused
        Seals(store, key, "file:///x/run/mtc").check_manifest(NAME, changed)
    # The sealed index, over a changed header: the header fails.
    store.put_bytes(layout.parts_object(NAME), backup_index.make(NAME, data))
    store.put_bytes(layout.manifest_object(NAME), changed)
    with pytest.raises(ManifestError, match="header is not the one its part index names"):
        _read(store, key, "h0")


def test_without_an_index_the_manifest_is_read_whole(backup):
    store, key, data = backup
    # A seal of a version without indexes (the index object beside it changes nothing).
    Seals(store, key, "file:///x/run/mtc").write(store, NAME, data)
    assert _read(store, key, "h0") is None
    store.delete(layout.parts_object(NAME))
    assert _read(store, key, "h0") is None
    # A manifest of a format without parts has no index.
    assert backup_index.make(NAME, json.dumps({"format": "mtc/2", "step": 7}).encode()) is None


def test_without_a_key_the_index_still_checks_the_bytes(backup):
    store, _, data = backup
    header, p0, *_ = data.split(b"\n")
    assert _read(store, JobKey.none(), "h0") == (header, p0)
    _change(store, layout.manifest_object(NAME), len(header) + 1 + 40)
    with pytest.raises(ManifestError, match="the part of host h0 is not the one"):
        _read(store, JobKey.none(), "h0")


def test_an_index_of_another_backup_is_refused(backup, tmp_path):
    store, key, data = backup
    other = layout.backup_name(8, 0)
    doc = json.loads(store.get_bytes(layout.parts_object(NAME)))
    doc["backup"] = other
    store.put_bytes(layout.parts_object(NAME), json.dumps(doc).encode())
    with pytest.raises(ManifestError, match="malformed or names another backup"):
        _read(store, JobKey.none(), "h0")
