"""The control plane at the seed's scale, by simulation: what one save and one restore cost the head, against hosts.

    python bench/bench_scale.py [--hosts 64,512,4096] [--layers 32] [--budget-s 120]

No processes: mtc's own format and commit code (``mtc.shared.format``, ``choose_keepers``) is
driven for a synthetic topology of H hosts x 8 devices and a MaxText-like state
(``--layers`` transformer layers of 9 arrays each, plus the embedding and the final norm;
FSDP: dim 0 of every array sharded over all devices). Per save, for each H:

- each host's part (its host manifest, as it answers phase 1) and one host's CPU to write it;
- the head's CPU to build the step manifest from the parts (which host wrote which devices,
  ``shardings.devices_by_host``, as the save records it; ``fmt.encode_step``: a header of
  arrays and named shardings, then the parts as they came, hashed, never parsed), to check
  each host's phase-1 summary and to encode phase 2's messages;
- what the head sends and receives: phase 1 sends each host its shard list and gets its part
  back; phase 2 sends the whole manifest to the keepers only (2, on distinct slices) and the
  decision (digest, keepers) to every other host;
- head bytes per host per save, which must stay constant in H for a fixed per-host share;
- the replication decision after the save when the slices are data-parallel twins (as MaxText
  runs multi-slice): every host's inventory (its own share's digest and bitmap) parsed, and
  ``covered_by_shares`` deciding that every copy exists, with no manifest read; and without
  twins (FSDP over every host): ``plan_shares`` sending each host's share to another slice;
- a newer step whose lost host's blobs are looked for in a backup of another step: the CPU of the
  host the head asks (``fmt.step_blobs_among``: the manifest read for those names) and the names the
  head gets back, beside the whole manifest the head read and parsed per backup before;
- the CPU to read and check the whole manifest (``StepManifest.from_json``): what a host that
  fetches it, and the head's replication and backup planning after each commit pay (a keeper only
  hashes it before it commits), beside the same manifest with its parts as rows (``mtc-host/1``,
  the format before the columns), and its blob names alone (``fmt.step_blob_names``, what ``mtc status
  --verify`` reads); skipped past ``--budget-s``, with an estimate.

Per restore onto the topology that saved the step (a restart, the common case): every host's
inventory parsed, the manifest's header read alone (``fmt.StepHeader``), the step chosen by parts
(every host holds the part it wrote), the layout checked and the load request every host gets; its
head CPU and bytes per host, beside a restore that reads every row (a host that lost its part).

Per restore from the backup onto the same topology (every ramdisk lost), in a real local backup root:
the part index a finalize writes, the head's read of the header and one host's of the header and its
own part (each by range, checked against the sealed index), beside the whole manifest every host read
before.

Per elastic shrink (data-parallel slices, FSDP within each; the last slice gone): the surviving
hosts' inventories, the step chosen by its writers' parts (a twin wrote every box the lost slice did)
and which writer's part each host reads on the smaller mesh (``fmt.writers.plan``), from the header.

Per backup scrub (in the background of the training process): the head's CPU to read the backup's header
and say which writer's part each host reads (``assign_parts``), what it sends a host, and one host's CPU to
read the header and its part and choose the blobs that fall to it (``fmt.writers.designated``), beside the
head reading the whole manifest and giving each unique blob to a host (``assign_scrub``, what a backup
without a part index still gets).

Per restore from the backup onto the same hosts in half as many data-parallel slices, twice as wide
(each new box half of a saved one): the head's plan of which parts each host reads and of what it
loads (``fmt.writers.loads``, sent with its fetch), and what one host downloads of the parts it reads
(``StepManifest.blob_sizes_for``) beside every blob of those parts and the bytes it loads.

The head's CPU per save is timed twice in one process, the first save and the next (a job's later
saves find memory mapped that its first had to fault in).

Ratios in one run, not absolute times. The data itself (the shards' bytes) is not counted. Before
each timed section the collector runs and what exists is frozen (``quiet``): the simulation keeps
millions of objects alive that a head would not, and a full collection over them would otherwise
land in whichever section is timed when it comes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import tempfile
import time

import numpy as np

from mtc.head.backup.plan import assign_parts, assign_scrub
from mtc.head.commit import choose_keepers
from mtc.head.dispatch.interface import HostInventory
from mtc.head.replication.plan import ReplicationStrategy, covered_by_shares, plan_shares, step_views
from mtc.head.tools.cli.status import copies_by_share
from mtc.shared import backup_index, backup_layout, colocated_codec
from mtc.shared import format as fmt
from mtc.shared import protocol, shardings
from mtc.shared.backup_seals import SUFFIX as SEAL_SUFFIX, Seals
from mtc.shared.job_key import JobKey
from mtc.shared.hashing import blob_name
from mtc.shared.objstore.local import LocalStore
from mtc.shared.format import writers

DEVICES_PER_HOST = 8
KEEPERS = 2
HOSTS_PER_SLICE = 16
D_MODEL, D_FF, VOCAB = 4096, 14336, 128256


def state_shapes(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, dtype) of a llama-like model's parameters."""
    out = [("['params']['embed']", (VOCAB, D_MODEL), "bfloat16")]
    for i in range(layers):
        p = f"['params']['layers_{i}']"
        out += [(f"{p}['q']", (D_MODEL, D_MODEL), "bfloat16"), (f"{p}['k']", (D_MODEL, 1024), "bfloat16"),
                (f"{p}['v']", (D_MODEL, 1024), "bfloat16"), (f"{p}['o']", (D_MODEL, D_MODEL), "bfloat16"),
                (f"{p}['wi_0']", (D_MODEL, D_FF), "bfloat16"), (f"{p}['wi_1']", (D_MODEL, D_FF), "bfloat16"),
                (f"{p}['wo']", (D_FF, D_MODEL), "bfloat16"), (f"{p}['pre_norm']", (D_MODEL,), "float32"),
                (f"{p}['post_norm']", (D_MODEL,), "float32")]
    return out + [("['params']['final_norm']", (D_MODEL,), "float32")]


def quiet() -> None:
    """Collect, then freeze what is left, so that the next timed section pays no collection of it."""
    gc.collect()
    gc.freeze()


def _blob(i: int) -> str:
    """A blob name as the save makes them (a hash: random bits, so sorts of names cost what they would)."""
    return blob_name(i.to_bytes(8, "little"))


def build(hosts: int, layers: int) -> tuple[list[fmt.ArrayRecord], dict[str, list[fmt.HostShard]]]:
    """The arrays (with their named shardings, no shards) and each host's phase-1 shards."""
    n = hosts * DEVICES_PER_HOST
    per_host: dict[str, list[fmt.HostShard]] = {f"h{h}": [] for h in range(hosts)}
    mesh = {"type": "named", "mesh_shape": [n], "axis_names": ["fsdp"], "device_ids": list(range(n))}
    by_rank = {1: {**mesh, "spec": ["fsdp"]}, 2: {**mesh, "spec": ["fsdp", None]}}  # one object per sharding
    records, blob = [], 0
    for a, (key, shape, dtype) in enumerate(state_shapes(layers)):
        k = math.gcd(shape[0], n)  # pieces along dim 0; n // k devices hold each (replicas)
        rows = shape[0] // k
        nbytes = rows * math.prod(shape[1:]) * fmt.dtype_from_name(dtype).itemsize
        for piece in range(k):
            box = ((piece * rows, (piece + 1) * rows),) + tuple((0, s) for s in shape[1:])
            for h in sorted({d // DEVICES_PER_HOST for d in range(piece, n, k)}):
                per_host[f"h{h}"].append(fmt.HostShard(a, box, _blob(blob), nbytes))
            blob += 1
        records.append(fmt.ArrayRecord(key=key, kind="jax", dtype=dtype, shape=shape, sharding=by_rank[len(shape)]))
    return records, per_host


def measure(hosts: int, layers: int, parse: bool) -> dict:
    gc.unfreeze()  # the garbage of a previous topology is not this one's cost
    gc.collect()
    records, per_host = build(hosts, layers)
    tree = {"t": "dict", "k": [r.key for r in records], "v": [{"t": "leaf", "i": i} for i in range(len(records))]}
    # Each host writes its part (phase 1); the head gets it with a small summary.
    parts, summaries = [], []
    sent1 = 0
    host_part_s = 0.0
    for h, shards in per_host.items():
        t = time.process_time()
        part = fmt.HostManifest(step=1, host=h, shards=tuple(shards), written_bytes=0, seconds=0.0).to_json()
        if h == "h0":
            host_part_s = time.process_time() - t
        parts.append((h, part))
        at: dict[int, int] = {}
        for s in shards:
            at.setdefault(s.array, len(at))
        args = {"step": 1, "part": 0, "arrays": [{"index": a, "shape": list(records[a].shape)} for a in at],
                "shards": [[at[s.array], [list(p) for p in s.box]] for s in shards]}
        sent1 += len(json.dumps(args, separators=(",", ":")))
        summaries.append(json.dumps({"step": 1, "host": h, "shards": len(shards), "blobs": len(shards),
                                     "written_bytes": 0, "seconds": 0.0}).encode())
    recv1 = sum(len(p) + len(s) for (_, p), s in zip(parts, summaries))
    # The head: check each summary, build the manifest, encode phase 2's messages.
    quiet()
    t0 = time.process_time()
    for (h, _), s in zip(parts, summaries):
        doc = json.loads(s)
        assert doc["host"] == h and doc["step"] == 1
    t1 = time.process_time()

    def build_manifest() -> tuple[list[bytes], str, dict]:
        # Which host wrote which devices (the save's ``topology.devices``), from the sharding descriptions.
        devices = shardings.devices_by_host({id(r.sharding): r.sharding for r in records if r.sharding}.values(),
                                            lambda d: f"h{d // DEVICES_PER_HOST}")
        # As the save builds it: the header and the parts, never joined (they are sent back to back).
        return *fmt.encode_step_segments(step=1, arrays=records, tree=tree, created=0.0, topology={
            "hosts": sorted(per_host), "devices": devices}, fingerprint={}, parts=parts), devices

    segments, digest, devices = build_manifest()
    t2 = time.process_time()
    first_build_s = t2 - t1
    # Again: a training job saves every few minutes, and its first save pays for fresh memory that later
    # saves may find mapped.
    del segments
    quiet()
    t1 = time.process_time()
    segments, digest, devices = build_manifest()
    t2 = time.process_time()
    keepers = choose_keepers(sorted(per_host), lambda h: int(h[1:]) // HOSTS_PER_SLICE, 1, KEEPERS)
    where = [[k, f"10.0.{i}.1:7001"] for i, k in enumerate(keepers)]
    decisions = 0
    for h in per_host:
        if h not in keepers:
            decisions += len(json.dumps({"step": 1, "digest": digest, "keepers": where}))
    t3 = time.process_time()
    colocated_s, colocated_before_s = colocated_commit(segments, digest)
    data = b"".join(segments)  # (for the readers measured below)
    del segments
    sent2 = decisions + len(data) * len(keepers)
    repl_s, repl_received = replication_decision(hosts, len(per_host["h0"]))
    plan_s, _ = replication_decision(hosts, len(per_host["h0"]), twins=False)
    keeper_s = old_restore_s = v1_parse_s = v1_bytes = names_s = among_s = among_asked = among_bytes = None
    copy_s = None
    if parse:
        quiet()
        p0 = time.process_time()  # memory speed here: a copy of the same bytes (into fresh memory, as the read's)
        copy = bytearray(data)
        copy_s = time.process_time() - p0
        del copy
        quiet()
        p0 = time.process_time()
        m = fmt.StepManifest.from_json(data)
        keeper_s = time.process_time() - p0
        assert m.digest == digest
        old_restore_s = keeper_s + restore_by_rows(m, per_host)
        del m
        quiet()
        p0 = time.process_time()
        names = fmt.step_blob_names(data)  # what `mtc status --verify` reads: the names alone, from the columns
        names_s = time.process_time() - p0
        assert names.digest == digest
        del names
        # A newer step whose lost host's blobs are looked for in a backup (of the same state): the host
        # asked reads the backup's manifest for those names; the head gets the names it found.
        ask = sorted({s.blob for s in per_host["h1"]})
        quiet()
        p0 = time.process_time()
        found = fmt.step_blobs_among(data, ask)
        among_s = time.process_time() - p0
        assert found == set(ask)
        among_asked, among_bytes = len(ask), 32 * len(found)
        # The same manifest with its parts as rows (mtc-host/1, the format before the columns), read the same way.
        v1 = [(h, _rows_part(h, shards)) for h, shards in per_host.items()]
        data_v1, _ = fmt.encode_step(step=1, arrays=records, tree=tree, created=0.0,
                                     topology={"hosts": sorted(per_host), "devices": devices}, fingerprint={}, parts=v1)
        del v1
        quiet()
        p0 = time.process_time()
        m = fmt.StepManifest.from_json(data_v1)
        v1_parse_s, v1_bytes = time.process_time() - p0, len(data_v1)
        del m, data_v1
    restore = restore_side(records, per_host, data, digest)
    restore.update(resize_side(hosts, layers))
    restore.update(pieces_side(hosts, layers))
    restore.update(regroup_side(hosts, layers))
    restore.update(backup_side(data, parse))
    return {"hosts": hosts, "devices": hosts * DEVICES_PER_HOST, "arrays": len(records),
            "shards": sum(len(s) for s in per_host.values()), "manifest_bytes": len(data),
            "host_part_s": host_part_s, "head_check_s": t1 - t0, "head_build_s": t2 - t1, "head_phase2_s": t3 - t2,
            "first_build_s": first_build_s, "colocated_s": colocated_s, "colocated_before_s": colocated_before_s,
            "keeper_parse_s": keeper_s, "copy_s": copy_s, "names_s": names_s, "among_s": among_s,
            "among_asked": among_asked,
            "among_bytes": among_bytes,
            "v1_parse_s": v1_parse_s, "v1_bytes": v1_bytes, "replication_s": repl_s, "replication_received": repl_received,
            "plan_s": plan_s, "old_restore_s": old_restore_s, **restore,
            "head_sent": sent1 + sent2, "head_received": recv1,
            "before_sent": sent1 + len(data) * hosts}


def colocated_commit(segments: list[bytes], digest: str) -> tuple[float, float]:
    """Head CPU to put phase 2's request to the keepers in the colocated transport's rows (one per keeper's
    control device; the device transfer itself not counted): now, the manifest's buffers copied once after
    the request's JSON; before, the manifest joined, decoded and encoded as a JSON string, its rows a copy
    each."""
    doc = {"id": "0" * 32, "op": "commit", "gen": 1, "step": 1, "digest": digest}
    quiet()
    t0 = time.process_time()
    row = colocated_codec.encode_request(doc, [protocol.Gathered(tuple(segments))])
    now_s = time.process_time() - t0
    del row
    quiet()
    t0 = time.process_time()
    text = np.frombuffer(json.dumps({**doc, "payloads": [b"".join(segments).decode()]}).encode(), np.uint8)
    rows = np.ascontiguousarray(np.broadcast_to(text, (KEEPERS, len(text))))
    before_s = time.process_time() - t0
    del text, rows
    return now_s, before_s


def _rows_part(host: str, shards: list[fmt.HostShard]) -> bytes:
    """A host's part as ``mtc-host/1`` wrote it: a JSON list per row."""
    return json.dumps({"format": fmt.HOST_FORMAT_V1, "step": 1, "host": host, "written_bytes": 0, "seconds": 0.0,
                       "shards": [[s.array, [list(b) for b in s.box], s.blob, s.nbytes] for s in shards]},
                      separators=(",", ":")).encode()


def _inventory_wire(per_host: dict[str, list[fmt.HostShard]], digest: str) -> dict[str, str]:
    """Each host's inventory answer for the step: it committed a record, and holds its part whole."""
    wire = {}
    for h, shards in per_host.items():
        names = sorted({s.blob for s in shards})
        own = protocol.blob_list_digest(names)
        wire[h] = json.dumps({"host": h, "damaged": [], "steps": [
            {"step": 1, "blobs": len(names), "local_blobs": len(names), "step_blobs": len(names), "digest": own,
             "held": protocol.encode_bitmap([True] * len(names)), "manifest": digest, "part": True, "own": own,
             "copies": []}]})
    return wire


def restore_side(records: list[fmt.ArrayRecord], per_host: dict[str, list[fmt.HostShard]], data: bytes,
                 digest: str) -> dict:
    """The head's side of a restore onto the topology that saved the step (a restart): every host's
    inventory parsed, the manifest's header read (``fmt.StepHeader``: one line, the head's only read
    of the manifest), the step chosen (``step_views``: every part whole where it was written), the
    layout checked (each device on the host that wrote it), and the load request every host gets
    (the arrays, each sharding described once). Its head CPU, and bytes sent and received."""
    wire = _inventory_wire(per_host, digest)
    line = data.partition(b"\n")[0]
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    header = fmt.StepHeader.from_line(line)
    views = step_views(inv, None, lambda s, d: header if d == digest else None)
    assert views[1].by_parts and views[1].restorable
    host_of = {d: h for h, ids in header.devices.items() for d in ids}  # the topology now: the same hosts
    assert all(host_of[d] == h for h, ids in header.devices.items() for d in ids)
    table: dict[int, int] = {}
    descs, specs = [], []
    for r in header.arrays:
        if id(r.sharding) not in table:
            table[id(r.sharding)] = len(descs)
            descs.append(r.sharding)
        specs.append({"key": r.key, "shape": list(r.shape), "dtype": r.dtype, "sharding": table[id(r.sharding)]})
    request = json.dumps({"step": 1, "arrays": specs, "shardings": [shardings.pack(d) for d in descs],
                          "manifest": digest}, separators=(",", ":"))
    spent = time.process_time() - t0
    hosts = len(per_host)
    # `mtc status`'s summary of the step from the same answers: on how many slices each share is whole.
    quiet()
    t1 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    header = fmt.StepHeader.from_line(line)
    views = step_views(inv, None, lambda s, d: header if d == digest else None)
    copies = copies_by_share(inv, 1, digest, header, {h: int(h[1:]) // HOSTS_PER_SLICE for h in per_host})
    assert views[1].by_parts and min(copies) >= 1
    status_s = time.process_time() - t1
    return {"restore_s": spent, "status_s": status_s, "restore_sent": len(request) * hosts,
            "restore_received": sum(len(w) for w in wire.values()) + len(line)}


def backup_side(data: bytes, parse: bool) -> dict:
    """A restore from the backup onto the topology that saved the step (every ramdisk lost), in a real
    local backup root: the finalizing host's CPU for the part index (``backup_index.make``; its seal
    hashes the whole manifest anyway), then the head's read (the header by range, checked against the
    sealed index) and one host's (the header and its own part, and its view of the step), with the bytes
    each reads, beside reading the whole manifest (what every host read before)."""
    name = backup_layout.backup_name(1, 0)
    with tempfile.TemporaryDirectory(prefix="mtc-bench-scale-") as root:
        store, key = LocalStore(root), JobKey(b"bench" * 8)
        seals = Seals(store, key, "file:///bench/run/mtc")
        quiet()
        t0 = time.process_time()
        index = backup_index.make(name, data)
        index_s = time.process_time() - t0
        store.put_bytes(backup_layout.parts_object(name), index)
        seals.write(store, name, data, index)
        store.put_bytes(backup_layout.manifest_object(name), data)
        seal_bytes = store.size(f"{backup_layout.BACKUPS}{name}{SEAL_SUFFIX}")
        quiet()
        t0 = time.process_time()
        line, _ = backup_index.read(store, seals, name)
        header = fmt.StepHeader.from_line(line)
        head_s = time.process_time() - t0
        host = header.parts[-1][0]
        quiet()
        t0 = time.process_time()
        line, parts = backup_index.read(store, seals, name, [host])
        part = parts[host]
        view = fmt.StepManifest.local_view(line, host, part)
        host_s = time.process_time() - t0
        assert view.digest == header.digest and view.blob_sizes()
        # The scrub of this backup, by parts: the head's plan (who reads which writer's part) and what it
        # sends each host; the host's choice of the blobs that fall to it in the part it read.
        writers_ = [h for h, _ in header.parts]
        quiet()
        t0 = time.process_time()
        reads = assign_parts(writers_, writers_)
        sent = {h: len(json.dumps({"parts": [[name, ws]]}, separators=(",", ":"))) for h, ws in reads.items()}
        scrub_head_s = head_s + time.process_time() - t0
        quiet()
        t0 = time.process_time()
        mine = writers.designated(view, host)
        scrub_host_s = host_s + time.process_time() - t0
        scrub_whole_s = scrub_blobs = None
        if parse:  # before: the whole manifest read on the head, each unique blob given to a host
            quiet()
            t0 = time.process_time()
            sizes = fmt.StepManifest.from_json(store.get_bytes(backup_layout.manifest_object(name))).blob_sizes()
            assign_scrub(sizes, writers_)
            scrub_whole_s, scrub_blobs = time.process_time() - t0, len(sizes)
            del sizes
    return {"backup_index_s": index_s, "backup_head_s": head_s, "backup_host_s": host_s,
            "backup_head_bytes": seal_bytes + len(index) + len(line),
            "backup_host_bytes": seal_bytes + len(index) + len(line) + len(part),
            "scrub_head_s": scrub_head_s, "scrub_sent_per_host": max(sent.values()), "scrub_host_s": scrub_host_s,
            "scrub_host_blobs": len(mine), "scrub_whole_s": scrub_whole_s, "scrub_blobs": scrub_blobs}


class _Request:
    """A restore's ``LoadRequest`` as the planners read it: the saved record and the target sharding
    (here its description: no jax devices)."""

    __slots__ = ("record", "sharding")

    def __init__(self, record, sharding):
        self.record, self.sharding = record, sharding


def resize_side(hosts: int, layers: int) -> dict:
    """The head's side of an elastic shrink, from the header alone: the slices are data-parallel twins
    (FSDP within a slice, as MaxText runs multi-slice) and the last slice is gone. Every surviving host's
    inventory parsed, the step chosen by its writers' parts (``step_views``: each box the lost slice wrote,
    a twin wrote too), and which parts each host reads on the smaller mesh (``writers.plan``: its own).
    No process and no jax device: the target is the smaller mesh's description."""
    slices = max(2, hosts // HOSTS_PER_SLICE)
    per_slice = hosts // slices
    n = hosts * DEVICES_PER_HOST
    def mesh(s: int) -> dict:
        return {"type": "named", "mesh_shape": [s, per_slice * DEVICES_PER_HOST], "axis_names": ["data", "fsdp"],
                "device_ids": list(range(s * per_slice * DEVICES_PER_HOST))}
    saved, target = mesh(slices), mesh(slices - 1)
    by_rank = {r: {k: {**m, "spec": ["fsdp"] + [None] * (r - 1)} for k, m in (("saved", saved), ("target", target))}
               for r in (1, 2)}
    records = [fmt.ArrayRecord(key=key, kind="jax", dtype=dtype, shape=shape, sharding=by_rank[len(shape)]["saved"])
               for key, shape, dtype in state_shapes(layers)]
    devices = {f"h{h}": tuple(range(h * DEVICES_PER_HOST, (h + 1) * DEVICES_PER_HOST)) for h in range(hosts)}
    digest = "d" * 64
    header = fmt.StepHeader(step=1, digest=digest, arrays=tuple(records), tree=None,
                            parts=tuple((h, "p" * 64) for h in devices), topology={"devices": devices}, fingerprint={})
    left = [f"h{h}" for h in range(hosts - per_slice)]
    wire = {}
    for i, h in enumerate(left):  # host k of every slice wrote the same share (twins)
        own = f"{i % per_slice:064x}"
        wire[h] = json.dumps({"host": h, "damaged": [], "steps": [
            {"step": 1, "blobs": 300, "local_blobs": 300, "step_blobs": 300, "digest": own,
             "held": protocol.encode_bitmap([True] * 300), "manifest": digest, "part": True, "own": own,
             "copies": []}]})

    assert n == len(saved["device_ids"])
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    view = step_views(inv, None, lambda s, d: header if d == digest else None)[1]
    assert view.by_writers and not view.by_parts and len(view.lost) == per_slice
    requests = [_Request(r, by_rank[len(r.shape)]["target"]) for r in records]
    needs = writers.plan(header, requests, view.part_holders, lambda d: f"h{d // DEVICES_PER_HOST}", left)
    spent = time.process_time() - t0
    assert needs is not None and not any(needs.values()), "a surviving host should read its own part"
    # `mtc status` of the same: the inventories, the views, and the step's copies from the header (each box
    # on the slices whose parts hold it: one slice fewer).
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    view = step_views(inv, None, lambda s, d: header if d == digest else None)[1]
    fewest = writers.copies(header, view.part_holders, lambda h: int(h[1:]) // per_slice)
    status_s = time.process_time() - t0
    assert fewest == slices - 1, (fewest, slices)
    # Replication of the step when one saving host died after the commit (every other host answers): its
    # share is its twins' (the header's ``writers.twins``), on the other slices; no manifest read.
    rows = {}
    for i, h in enumerate(devices):
        own = f"{i % per_slice:064x}"
        rows[h] = json.dumps({"host": h, "damaged": [], "steps": [
            {"step": 1, "blobs": 300, "local_blobs": 300, "step_blobs": 300, "digest": own,
             "held": protocol.encode_bitmap([True] * 300), "manifest": digest, "part": True, "own": own,
             "copies": []}]})
    topology = {h: i // per_slice for i, h in enumerate(devices)}
    quiet()
    t0 = time.process_time()
    inv = {h: (HostInventory.unreachable(h, "down") if h == "h1" else HostInventory.from_wire(h, json.loads(w)))
           for h, w in rows.items()}
    twins = writers.twins(header)
    covered = covered_by_shares(inv, 1, digest, list(devices), ReplicationStrategy(2), topology, twins)
    down_s = time.process_time() - t0
    assert covered == (slices > 2), covered
    return {"resize_s": spent, "resize_status_s": status_s, "replication_down_s": down_s}


def pieces_side(hosts: int, layers: int) -> dict:
    """The head's side of a restart after a host died whose part no host holds whole, but two hosts hold
    its blobs between them (a per-blob replication spreads a part; one cut short leaves pieces). Each
    matrix split over every device (no twin). Every host's inventory parsed (the two report the pieces:
    a bitmap each over the lost part's blobs), the step chosen by its writers' parts with the pieces
    (``step_views``), which parts each host reads on the same mesh (``writers.plan``: the replaced node,
    the lost part from the pieces), and `mtc status`'s copies. Before, the step went to the rows path
    (column "reading every row")."""
    slices = max(2, hosts // HOSTS_PER_SLICE)
    n = hosts * DEVICES_PER_HOST
    mesh = {"type": "named", "mesh_shape": [slices, n // slices], "axis_names": ["data", "fsdp"],
            "device_ids": list(range(n))}
    # A matrix split over every device (rows over a slice's devices, columns over the slices); a norm vector
    # over a slice's devices, the slices holding twins of it.
    by_rank = {1: {**mesh, "spec": ["fsdp"]}, 2: {**mesh, "spec": ["fsdp", "data"]}}
    records = [fmt.ArrayRecord(key=key, kind="jax", dtype=dtype, shape=shape, sharding=by_rank[len(shape)])
               for key, shape, dtype in state_shapes(layers)]
    per_part = len(records) * DEVICES_PER_HOST
    devices = {f"h{h}": tuple(range(h * DEVICES_PER_HOST, (h + 1) * DEVICES_PER_HOST)) for h in range(hosts)}
    digest = "d" * 64
    header = fmt.StepHeader(step=1, digest=digest, arrays=tuple(records), tree=None,
                            parts=tuple((h, "p" * 64) for h in devices), topology={"devices": devices}, fingerprint={})
    total = hosts * per_part
    wire = {}
    for i, h in enumerate(devices):
        own = f"{i:064x}"
        row = {"step": 1, "blobs": per_part, "local_blobs": per_part if i else 0, "step_blobs": per_part,
               "digest": own, "held": protocol.encode_bitmap([bool(i)] * per_part), "manifest": digest,
               "part": True, "own": own, "copies": []}
        if i in (1, 2):  # they keep the whole manifest: a bitmap over every blob, and a piece each of h0's part
            half = protocol.encode_bitmap([k % 2 == i - 1 for k in range(per_part)])
            row.update({"part": False, "step_blobs": total, "held": "f" * (total // 4), "copies": [own],
                        "pieces": [["h0", per_part, half]]})
        wire[h] = json.dumps({"host": h, "damaged": [], "steps": [row]})
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    view = step_views(inv, None, lambda s, d: header if d == digest else None)[1]
    assert view.by_writers and view.lost == ("h0",) and list(view.pieces["h0"]) == ["h1", "h2"], view.lost
    requests = [_Request(r, r.sharding) for r in records]
    needs = writers.plan(header, requests, view.sources, lambda d: f"h{d // DEVICES_PER_HOST}", list(devices),
                         pieced=view.pieces)
    spent = time.process_time() - t0
    assert needs is not None and needs["h0"] == {"h0"} and not any(needs[h] for h in devices if h != "h0"), needs
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    view = step_views(inv, None, lambda s, d: header if d == digest else None)[1]
    fewest = writers.copies(header, view.part_holders, lambda h: h, view.pieces)
    status_s = time.process_time() - t0
    assert fewest == 1, fewest
    return {"pieces_s": spent, "pieces_status_s": status_s,
            "pieces_received": sum(len(w) for w in wire.values()) / hosts}


def regroup_side(hosts: int, layers: int) -> dict:
    """A restore from the backup onto the same hosts grouped in half as many data-parallel slices, twice
    as wide (FSDP within a slice): each device's new box is half of a saved one, so a host reads the part
    of one writer and loads half of its boxes. The head plans which parts each host reads
    (``writers.plan``) and what each loads (``writers.loads``, sent with the fetch); one host's view of
    the parts it reads then says which blobs it downloads (``StepManifest.blob_sizes_for``), beside every
    blob of those parts (what it downloaded before) and the bytes it loads (the least it can download)."""
    slices = max(2, hosts // HOSTS_PER_SLICE)
    per_slice = hosts // slices
    width = per_slice * DEVICES_PER_HOST

    def mesh(s: int, w: int) -> dict:
        return {"type": "named", "mesh_shape": [s, w], "axis_names": ["data", "fsdp"], "device_ids": list(range(s * w))}

    by_rank = {r: {k: {**m, "spec": ["fsdp"] + [None] * (r - 1)}
                   for k, m in (("saved", mesh(slices, width)), ("target", mesh(slices // 2, 2 * width)))}
               for r in (1, 2)}
    records = [fmt.ArrayRecord(key=key, kind="jax", dtype=dtype, shape=shape, sharding=by_rank[len(shape)]["saved"])
               for key, shape, dtype in state_shapes(layers)]
    devices = {f"h{h}": tuple(range(h * DEVICES_PER_HOST, (h + 1) * DEVICES_PER_HOST)) for h in range(hosts)}
    header = fmt.StepHeader(step=1, digest="d" * 64, arrays=tuple(records), tree=None,
                            parts=tuple((h, "p" * 64) for h in devices), topology={"devices": devices}, fingerprint={})

    readers = list(devices)
    host_of = lambda d: f"h{d // DEVICES_PER_HOST}"  # noqa: E731
    quiet()
    t0 = time.process_time()
    requests = [_Request(r, by_rank[len(r.shape)]["target"]) for r in records]
    needs = writers.plan(header, requests, {w: {"backup"} for w in devices}, host_of, readers)
    loads = writers.loads(requests, host_of, readers)
    spent = time.process_time() - t0
    assert needs is not None and loads is not None
    reader = "h1"  # (host 0 loads half of its own part; host 1 half of host 0's)
    # Its view of the parts it reads: each writer's devices' boxes, one blob per (array, box).
    arrays, blob, described = [], 0, {}
    for rec in records:
        saved = described.get(rec.shape)
        if saved is None:
            saved = described[rec.shape] = shardings.described_device_boxes(rec.sharding, rec.shape)
        boxes = sorted({saved[d] for w in sorted(needs[reader]) for d in devices[w]})
        itemsize = rec.np_dtype.itemsize
        shards = []
        for box in boxes:
            shards.append(fmt.ShardRecord(box=box, blob=f"{blob:032x}", nbytes=math.prod(b - a for a, b in box) * itemsize))
            blob += 1
        arrays.append(dataclasses.replace(rec, shards=tuple(shards)))
    view = fmt.StepManifest(step=1, arrays=tuple(arrays), tree=None)
    wants = {k: boxes for keys, boxes in loads[reader] for k in keys}
    quiet()
    t0 = time.process_time()
    wanted = view.blob_sizes_for(wants)
    host_s = time.process_time() - t0
    loaded = sum(math.prod(b - a for a, b in box) * rec.np_dtype.itemsize
                 for rec in records for box in wants[rec.key])
    return {"regroup_head_s": spent, "regroup_host_s": host_s, "regroup_parts": len(needs[reader]),
            "regroup_whole_bytes": sum(view.blob_sizes().values()), "regroup_bytes": sum(wanted.values()),
            "regroup_loaded_bytes": loaded,
            "regroup_wants_bytes": len(json.dumps([[keys, boxes] for keys, boxes in loads[reader]],
                                                  separators=(",", ":")))}


def restore_by_rows(m: fmt.StepManifest, per_host: dict[str, list[fmt.HostShard]]) -> float:
    """Head CPU past the manifest's parse of a restore that reads every row (a host lost its part, a
    resharded target): the inventories mapped onto the blob names, every blob's holders."""
    wire = _inventory_wire(per_host, m.digest)
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    view = step_views(inv, lambda s, d: m)[1]
    holders = view.by_name(m.sorted_blob_names())
    assert holders is not None and all(holders.values())
    return time.process_time() - t0


def replication_decision(hosts: int, shards_per_host: int, twins: bool = True) -> tuple[float, int]:
    """(head CPU, bytes received) of the replication decision after a save, from every host's
    inventory row of the step. With ``twins`` (data parallelism over the slices): host k of every
    slice holds the same share, and the decision is that no copy is needed. Without (FSDP over
    every host): every share is planned to a host of another slice, share by share."""
    slices = max(2, hosts // HOSTS_PER_SLICE)
    per_slice = max(1, hosts // slices)
    # A share's digest is opaque to the head (the hosts compute it over their blob names).
    own = {k: f"{k:064x}" for k in range(slices * per_slice)}
    bitmap = protocol.encode_bitmap([True] * shards_per_host)
    wire, topology = {}, {}
    for h in range(slices * per_slice):
        k = h % per_slice if twins else h
        topology[f"h{h}"] = h // per_slice
        wire[f"h{h}"] = json.dumps({"host": f"h{h}", "damaged": [], "steps": [
            {"step": 1, "blobs": shards_per_host, "local_blobs": shards_per_host, "manifest": "d" * 64, "part": True,
             "own": own[k], "step_blobs": shards_per_host, "digest": own[k], "held": bitmap}]})
    quiet()
    t0 = time.process_time()
    inv = {h: HostInventory.from_wire(h, json.loads(w)) for h, w in wire.items()}
    ok = covered_by_shares(inv, 1, "d" * 64, list(topology), ReplicationStrategy(2), topology)
    if not twins:
        plan = plan_shares(inv, 1, "d" * 64, list(topology), ReplicationStrategy(2), topology, targets=topology)
        assert sum(len(v) for v in plan.values()) == len(topology)
    spent = time.process_time() - t0
    assert ok == twins
    return spent, sum(len(w) for w in wire.values())


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _whole_read(r: dict) -> str:
    """The CPU of reading the whole manifest, or the estimate it was skipped for."""
    if r["keeper_parse_s"] is None:
        return f"skipped (about {r['keeper_estimate_s']:.0f} s)"
    return f"{r['keeper_parse_s']:.2f} s ({r['keeper_parse_s'] / max(r['copy_s'], 1e-4):.0f}x a copy of its bytes)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="64,512,4096")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="skip reading the whole manifest when its estimate exceeds this")
    a = p.parse_args()
    rows = []
    per_shard_parse = None
    for h in [int(x) for x in a.hosts.split(",")]:
        est = None
        if per_shard_parse is not None:
            est = per_shard_parse * rows[-1]["shards"] * h / rows[-1]["hosts"]
        r = measure(h, a.layers, parse=est is None or est <= a.budget_s)
        r["keeper_estimate_s"] = est
        rows.append(r)
        if r["keeper_parse_s"] is not None:
            per_shard_parse = (r["keeper_parse_s"] + r["v1_parse_s"]) / max(1, r["shards"])
    print(f"## One save's control plane, simulated: {rows[0]['arrays']} arrays (--layers {a.layers}), "
          f"FSDP over hosts x {DEVICES_PER_HOST} devices, {KEEPERS} keepers\n")
    print("| hosts | shard rows | manifest | head CPU per save | the first save in the process | head sends "
          "| head receives | head sends per host "
          "| head receives per host | colocated transport: phase 2's rows to the keepers (head CPU; before: the "
          "manifest as a JSON string) | a host: its part | replication decision, data-parallel slices (head CPU) "
          "| replication plan, no twins (head CPU) "
          "| replication decision, a saving host down, data-parallel slices (head CPU) "
          "| reading the whole manifest (a restore) "
          "| its blob names alone (`status --verify`) | the same with row parts (mtc-host/1): size, read |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        head = r["head_check_s"] + r["head_build_s"] + r["head_phase2_s"]
        first = head - r["head_build_s"] + r["first_build_s"]
        keeper = _whole_read(r)
        names = f"{r['names_s']:.2f} s" if r["names_s"] is not None else "skipped"
        rows_v1 = (f"{_mib(r['v1_bytes'])}, {r['v1_parse_s']:.2f} s ({r['v1_parse_s'] / r['keeper_parse_s']:.1f}x)"
                   if r["v1_parse_s"] is not None else "skipped")
        print(f"| {r['hosts']} | {r['shards']:,} | {_mib(r['manifest_bytes'])} | {head * 1e3:,.0f} ms | "
              f"{first * 1e3:,.0f} ms | {_mib(r['head_sent'])} | {_mib(r['head_received'])} | {_mib(r['head_sent'] / r['hosts'])} | "
              f"{_mib(r['head_received'] / r['hosts'])} | {r['colocated_s'] * 1e3:,.0f} ms "
              f"({r['colocated_before_s'] * 1e3:,.0f} ms) | {r['host_part_s'] * 1e3:.1f} ms | "
              f"{r['replication_s'] * 1e3:,.0f} ms | {r['plan_s'] * 1e3:,.0f} ms | "
              f"{r['replication_down_s'] * 1e3:,.0f} ms | {keeper} | {names} | {rows_v1} |")
    print("\n## One restore's control plane onto the topology that saved the step (a restart), simulated\n")
    print("| hosts | head CPU | head sends | head receives | head sends per host | head receives per host "
          "| `mtc status` (head CPU) | elastic shrink, one data-parallel slice lost (head CPU) "
          "| `mtc status` after it (head CPU) "
          "| a host lost, its part in pieces on two others (head CPU: restore plan, `mtc status`) "
          "| reading every row instead (a host lost its part; head CPU) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        old = (f"{r['old_restore_s']:.2f} s" if r["old_restore_s"] is not None
               else f"skipped (about {r['keeper_estimate_s']:.0f} s and more)")
        print(f"| {r['hosts']} | {r['restore_s'] * 1e3:,.0f} ms | {_mib(r['restore_sent'])} | "
              f"{_mib(r['restore_received'])} | {_mib(r['restore_sent'] / r['hosts'])} | "
              f"{_mib(r['restore_received'] / r['hosts'])} | {r['status_s'] * 1e3:,.0f} ms | "
              f"{r['resize_s'] * 1e3:,.0f} ms | {r['resize_status_s'] * 1e3:,.0f} ms | "
              f"{r['pieces_s'] * 1e3:,.0f} ms, {r['pieces_status_s'] * 1e3:,.0f} ms | {old} |")
    if len(rows) >= 2:
        a0, a1 = rows[0], rows[-1]
        print(f"\n- restore, {a1['hosts'] / a0['hosts']:.0f}x the hosts: head bytes sent per host "
              f"{(a1['restore_sent'] / a1['hosts']) / (a0['restore_sent'] / a0['hosts']):.2f}x, received per host "
              f"{(a1['restore_received'] / a1['hosts']) / (a0['restore_received'] / a0['hosts']):.2f}x; head CPU at "
              f"{a1['hosts']} hosts {a1['restore_s']:.2f} s (target <= 1 s); an elastic shrink's "
              f"{a1['resize_s']:.2f} s (target <= 5 s)")
    print("\n## One restore from the backup onto the topology that saved the step (every ramdisk lost)\n")
    print("| hosts | finalizing host: part index (CPU) | head: reads (bytes) | head CPU | each host: reads (bytes) "
          "| each host CPU | each host before: the whole manifest (bytes) | each host before (CPU) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['hosts']} | {r['backup_index_s'] * 1e3:,.0f} ms | {_mib(r['backup_head_bytes'])} | "
              f"{r['backup_head_s'] * 1e3:,.0f} ms | {_mib(r['backup_host_bytes'])} | {r['backup_host_s'] * 1e3:,.1f} ms | "
              f"{_mib(r['manifest_bytes'])} | {_whole_read(r)} |")
    print("\n## A restore from the backup onto half as many data-parallel slices, twice as wide (every ramdisk "
          "lost): what one host downloads\n")
    print("| hosts | slices, saved -> restored | head CPU: which parts, what each host loads | sent with each "
          "host's fetch | the host: parts it reads | their blobs (downloaded before) | downloaded now "
          "| the bytes it loads | now / the least | the host's CPU to choose |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        slices = max(2, r["hosts"] // HOSTS_PER_SLICE)
        print(f"| {r['hosts']} | {slices} -> {slices // 2} | {r['regroup_head_s'] * 1e3:,.0f} ms | "
              f"{_mib(r['regroup_wants_bytes'])} | {r['regroup_parts']} | {_mib(r['regroup_whole_bytes'])} | "
              f"{_mib(r['regroup_bytes'])} | {_mib(r['regroup_loaded_bytes'])} | "
              f"{r['regroup_bytes'] / r['regroup_loaded_bytes']:.2f}x | {r['regroup_host_s'] * 1e3:,.1f} ms |")
    print("\n## A backup scrub (the newest backup), by parts: in the background of the training process\n")
    print("| hosts | head CPU: header, who reads which part | head sends per host | a host: header and its part "
          "read, the blobs that fall to it (CPU) | blobs it hashes | head before: whole manifest, each blob to a "
          "host (CPU) | unique blobs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        whole = f"{r['scrub_whole_s']:.2f} s" if r["scrub_whole_s"] is not None else "skipped"
        blobs = f"{r['scrub_blobs']:,}" if r["scrub_blobs"] is not None else "skipped"
        print(f"| {r['hosts']} | {r['scrub_head_s'] * 1e3:,.0f} ms | {r['scrub_sent_per_host']} B | "
              f"{r['scrub_host_s'] * 1e3:,.0f} ms | {r['scrub_host_blobs']:,} | {whole} | {blobs} |")
    print("\n## A newer step whose lost host's blobs are looked for in a backup of another step (one host's part "
          "lost; the backup holds them): per backup asked\n")
    print("| hosts | blobs looked for | a host: reads the backup's manifest for them (CPU) | head receives "
          "| head before: the backup's whole manifest (bytes) | head before (CPU) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["among_s"] is None:
            print(f"| {r['hosts']} | skipped | | | {_mib(r['manifest_bytes'])} | {_whole_read(r)} |")
            continue
        print(f"| {r['hosts']} | {r['among_asked']:,} | {r['among_s'] * 1e3:,.0f} ms | {r['among_bytes']:,} B | "
              f"{_mib(r['manifest_bytes'])} | {_whole_read(r)} |")
    if len(rows) >= 2:
        a0, a1 = rows[0], rows[-1]
        k = a1["hosts"] / a0["hosts"]
        per0, per1 = a0["head_sent"] / a0["hosts"], a1["head_sent"] / a1["hosts"]
        rec0, rec1 = a0["head_received"] / a0["hosts"], a1["head_received"] / a1["hosts"]
        head1 = a1["head_check_s"] + a1["head_build_s"] + a1["head_phase2_s"]
        print(f"\n- {k:.0f}x the hosts: head bytes sent per host {per1 / per0:.2f}x, received per host "
              f"{rec1 / rec0:.2f}x (target: 1.0x, constant in hosts)")
        print(f"- head CPU per save at {a1['hosts']} hosts: {head1:.2f} s (target <= 1 s; the first save in the "
              f"process {head1 - a1['head_build_s'] + a1['first_build_s']:.2f} s); with the replication "
              f"decision of data-parallel slices: {head1 + a1['replication_s']:.2f} s "
              f"(replication {a0['replication_s'] / a0['hosts'] * 1e6:.0f} -> "
              f"{a1['replication_s'] / a1['hosts'] * 1e6:.0f} us per host, no manifest read); without twins, "
              f"every share planned to another slice: {head1 + a1['plan_s']:.2f} s "
              f"({a0['plan_s'] / a0['hosts'] * 1e6:.0f} -> {a1['plan_s'] / a1['hosts'] * 1e6:.0f} us per host)")
        print(f"- had phase 2 sent the whole manifest to every host (the design before): head sends "
              f"{_mib(a1['before_sent'])} per save at {a1['hosts']} hosts, {_mib(a1['before_sent'] / a1['hosts'])} "
              f"per host ({a1['before_sent'] / a1['head_sent']:.0f}x)")


if __name__ == "__main__":
    main()
