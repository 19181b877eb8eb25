"""The twin check's parts without processes: the setting, the comparison of the hosts' names, the
hash pass, and what each mode does with a mismatch."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtc.head.reports import SaveReport
from mtc.head.save import flatten
from mtc.head.twin_check import TwinMismatchError, check, compare, hash_replicas
from mtc.shared import format as fmt
from mtc.shared.buffers import byte_view
from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError, ManifestError
from mtc.shared.hashing import blob_name

pytestmark = pytest.mark.unit


def host_of(dev: int) -> str:
    return f"h{dev // 2}"  # 4 hosts of 2 devices; h0, h1 in slice 0 and h2, h3 in slice 1 (mesh rows)


def state(bad_device: int | None = None) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    sharding = NamedSharding(mesh, P("model"))  # box j on devices j and 4 + j
    arrays = []
    for dev, idx in sharding.addressable_devices_indices_map(value.shape).items():
        part = np.array(value[idx])
        if dev.id == bad_device:
            part.reshape(-1).view(np.uint8)[3] ^= 1
        arrays.append(jax.device_put(part, dev))
    return {"w": jax.make_array_from_single_device_arrays(value.shape, sharding, arrays),
            "lr": np.float32(0.5)}


def parts_of(leaves, *, numpy_blob: dict | None = None) -> list[tuple[str, bytes]]:
    """Each host's phase 1 answer as its sidecar writes it: its first copy of each box it holds."""
    rows: dict[str, dict] = {}
    for leaf in sorted(leaves, key=lambda leaf: leaf.kind != "jax"):  # the hosts first, from the arrays
        if leaf.kind == "jax":
            for shard in leaf.value.addressable_shards:
                h, box = host_of(shard.device.id), leaf.device_boxes[shard.device.id]
                data = np.ascontiguousarray(np.asarray(shard.data))
                rows.setdefault(h, {}).setdefault((leaf.index, box), (blob_name(byte_view(data)), data.nbytes))
        elif leaf.kind == "numpy":
            for h in rows:
                blob = (numpy_blob or {}).get(h, blob_name(byte_view(np.ascontiguousarray(leaf.value))))
                rows[h][(leaf.index, ())] = (blob, leaf.value.nbytes)
    return [(h, fmt.HostManifest(1, h, tuple(fmt.HostShard(a, box, b, n) for (a, box), (b, n) in r.items())).to_json())
            for h, r in sorted(rows.items())]


def test_setting_values_and_errors():
    assert MTCConfig().twin_check == "warn" and MTCConfig().twin_check_hash is False
    assert MTCConfig.from_flags(["twin_check= FAIL"], environ={}).twin_check == "fail"
    cfg = MTCConfig.from_flags([], environ={"MTC_TWIN_CHECK": "off", "MTC_TWIN_CHECK_HASH": "true"})
    assert (cfg.twin_check, cfg.twin_check_hash) == ("off", True)
    with pytest.raises(ConfigError, match=r"twin_check='sometimes' is not one of warn, fail, off"):
        MTCConfig(twin_check="sometimes")
    with pytest.raises(ConfigError, match="MTC_TWIN_CHECK_HASH='maybe' is not true or false"):
        MTCConfig.from_flags([], environ={"MTC_TWIN_CHECK_HASH": "maybe"})
    with pytest.raises(ConfigError, match="did you mean 'twin_check'"):
        MTCConfig.from_flags(["twin_chek=fail"])


def test_equal_replicas_name_nothing():
    leaves, _ = flatten(state())
    assert compare(leaves, parts_of(leaves), hash_replicas(leaves), host_of) == []


def test_one_host_without_hash_pass_reads_no_part():
    leaves, _ = flatten(state(bad_device=5))
    assert compare(leaves, [("h0", b"not even json")], {}, host_of) == []
    with pytest.raises(ManifestError, match="host h1's answer to phase 1 is not its host manifest"):
        compare(leaves, [("h0", parts_of(leaves)[0][1]), ("h1", b"not even json")], {}, host_of)


def test_cross_host_mismatch_names_array_box_hosts_devices():
    bad = state(bad_device=5)  # box [2:4]: device 1 on h0, device 5 on h2
    leaves, _ = flatten(bad)
    (m,) = compare(leaves, parts_of(leaves), {}, host_of)
    assert (m.array, m.box, m.hosts) == ("['w']", ((2, 4), (0, 16)), ("h0", "h2"))
    good = np.ascontiguousarray(np.asarray([s.data for s in bad["w"].addressable_shards if s.device.id == 1][0]))
    by_blob = {c.blob: (c.hosts, c.devices) for c in m.copies}
    assert by_blob.pop(blob_name(byte_view(good))) == (("h0",), (1,))
    assert list(by_blob.values()) == [(("h2",), (5,))]
    assert "box [2:4, 0:16]" in str(m) and "on h2 (devices 5)" in str(m)


def test_numpy_leaf_copies_are_compared_too():
    leaves, _ = flatten(state())
    (m,) = compare(leaves, parts_of(leaves, numpy_blob={"h3": "0" * 32}), {}, host_of)
    assert m.array == "['lr']" and m.box == ()
    assert [(c.hosts, c.devices) for c in m.copies][-1] == (("h3",), ())


def test_hash_pass_finds_a_replica_no_host_writes():
    leaves, _ = flatten(state(bad_device=7), MTCConfig(twin_check_hash=True))
    (w,) = [leaf for leaf in leaves if leaf.kind == "jax"]
    names = w.replica_blobs
    assert sorted(names) == [((0, 2), (0, 16)), ((2, 4), (0, 16)), ((4, 6), (0, 16)), ((6, 8), (0, 16))]
    assert all(len(devs) == 1 for devs in names.values())  # the second copy of each box; the first is written
    # Every host is sent the first copy (cluster staging): only the hash pass sees device 7's.
    parts = parts_of(flatten(state())[0])
    assert compare(leaves, parts, {}, host_of) == []
    (m,) = compare(leaves, parts, {w.index: names}, host_of)
    assert m.box == ((6, 8), (0, 16)) and [c.devices for c in m.copies] == [(3,), (7,)]
    off, _ = flatten(state(bad_device=7), MTCConfig(twin_check_hash=True, twin_check="off"))
    assert all(leaf.replica_blobs == {} for leaf in off)


def test_modes(caplog):
    leaves, _ = flatten(state(bad_device=6))
    parts = parts_of(leaves)
    check(3, "off", leaves, parts, {}, host_of)  # off: nothing compared, nothing raised
    with caplog.at_level(logging.WARNING, logger="mtc.head.twin_check"):
        with pytest.raises(TwinMismatchError) as warn:
            check(3, "warn", leaves, parts, {}, host_of)
    assert warn.value.report.committed is False and warn.value.report.twin_mismatches == warn.value.mismatches
    assert "save of step 3 skipped" in caplog.records[-1].getMessage()
    wanted = r"save of step 3 failed: .*\['w'\].*\[4:6, 0:16\].*twin_check=fail"
    with pytest.raises(TwinMismatchError, match=wanted) as fail:
        check(3, "fail", leaves, parts, {}, host_of)
    assert fail.value.report is None and sorted(fail.value.hosts) == ["h1", "h3"] and fail.value.step == 3


def test_many_mismatches_are_shown_five_at_a_time():
    leaves, _ = flatten(state())
    parts = []
    for h, data in parts_of(leaves):
        doc = fmt.HostManifest.from_json(data)
        mine = f"{int(h[1:]):02x}"  # each host's own name for each box
        shards = doc.shards + tuple(fmt.HostShard(0, ((i, i + 1), (16, 17)), f"{i:030x}{mine}", 4) for i in range(8))
        shards += (fmt.HostShard(9, ((0, 1),), f"{0:030x}{mine}", 4),)  # not an array of the state: not counted
        parts.append((h, fmt.HostManifest(1, h, shards).to_json()))
    with pytest.raises(TwinMismatchError, match=r"in 8 box.*; and 3 more") as info:
        check(1, "fail", leaves, parts, {}, host_of)
    assert len(info.value.mismatches) == 8 and all(m.hosts == ("h0", "h1", "h2", "h3") for m in info.value.mismatches)


def test_report_of_a_commit():
    leaves, _ = flatten(state())
    r = SaveReport.of_commit(4, leaves, {"h0": {"written_bytes": 10, "blobs": 2}, "h1": {"blobs": 3}}, total_s=1.5)
    assert (r.bytes_total, r.bytes_written, r.blobs_total, r.hosts, r.total_s) == (8 * 16 * 4 + 4, 10, 5, 2, 1.5)
    assert r.committed and r.twin_mismatches == ()
