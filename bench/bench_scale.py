"""The control plane at the seed's scale, by simulation: what one save costs the head, against hosts.

    python bench/bench_scale.py [--hosts 64,512,4096] [--layers 32] [--budget-s 120]

No processes: the step manifest of a MaxText-like state (``--layers`` transformer layers of 9
arrays each, plus the embedding and the final norm; FSDP: dim 0 of every array sharded over all
devices) is built with mtc's own format code (``mtc.shared.format``) for a synthetic topology
of H hosts x 8 devices, as the head builds it after phase 1. Measured per save, for each H:

- manifest bytes (the ``to_json`` the head commits), and head CPU to build and encode it;
- one host's CPU to parse and check it (each host does this at phase 2);
- the bytes the head sends and receives per save: phase 1 sends each host its shard list and
  gets its host manifest back; phase 2 sends every host the whole step manifest (today's design);
- head bytes per host per save, whose growth with H is what issue [11] targets (constant for a
  fixed per-host share).

Sizes in the largest topologies can exceed what this machine holds or ``--budget-s``; those
rows are skipped with a note rather than extrapolated. Ratios in one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from mtc.shared import format as fmt

DEVICES_PER_HOST = 8
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


def _blob(i: int) -> str:
    return f"{i:032x}"


def build(hosts: int, layers: int) -> tuple[fmt.StepManifest, dict[str, list[fmt.HostShard]]]:
    """The step manifest and each host's phase-1 shards, for FSDP over hosts x 8 devices."""
    n = hosts * DEVICES_PER_HOST
    host_of = [f"h{d // DEVICES_PER_HOST}" for d in range(n)]
    per_host: dict[str, list[fmt.HostShard]] = {f"h{h}": [] for h in range(hosts)}
    records, blob = [], 0
    for a, (key, shape, dtype) in enumerate(state_shapes(layers)):
        k = math.gcd(shape[0], n)  # pieces along dim 0; n // k devices hold each (replicas)
        rows = shape[0] // k
        itemsize = fmt.dtype_from_name(dtype).itemsize
        rest = math.prod(shape[1:])
        shards = []
        for piece in range(k):
            box = ((piece * rows, (piece + 1) * rows),) + tuple((0, s) for s in shape[1:])
            devices = tuple(range(piece, n, k))
            nbytes = rows * rest * itemsize
            shards.append(fmt.ShardRecord(box, _blob(blob), nbytes, devices))
            for h in sorted({host_of[d] for d in devices}):
                per_host[h].append(fmt.HostShard(a, box, _blob(blob), nbytes))
            blob += 1
        sharding = {"type": "named", "mesh_shape": [n], "axis_names": ["fsdp"], "device_ids": list(range(n)),
                    "spec": ["fsdp"] + [None] * (len(shape) - 1)}
        records.append(fmt.ArrayRecord(key=key, kind="jax", dtype=dtype, shape=shape, sharding=sharding,
                                       shards=tuple(shards)))
    tree = {"t": "dict", "k": [r.key for r in records], "v": [{"t": "leaf", "i": i} for i in range(len(records))]}
    return fmt.StepManifest(step=1, arrays=tuple(records), tree=tree, topology={"hosts": sorted(per_host)}), per_host


def measure(hosts: int, layers: int) -> dict:
    t0 = time.process_time()
    manifest, per_host = build(hosts, layers)
    t1 = time.process_time()
    data = manifest.to_json()
    t2 = time.process_time()
    fmt.StepManifest.from_json(data)
    t3 = time.process_time()
    # Phase 1: the head sends each host its shard list and receives its host manifest.
    sent1 = recv1 = 0
    t_parse = 0.0
    for h, shards in per_host.items():
        args = {"step": 1, "part": 0, "shards": [[s.array, [list(p) for p in s.box]] for s in shards]}
        sent1 += len(json.dumps(args, separators=(",", ":")))
        hm = fmt.HostManifest(step=1, host=h, shards=tuple(shards), written_bytes=0, seconds=0.0).to_json()
        recv1 += len(hm)
        if h == "h0":
            p0 = time.process_time()
            fmt.HostManifest.from_json(hm)
            t_parse = time.process_time() - p0
    return {"hosts": hosts, "devices": hosts * DEVICES_PER_HOST, "arrays": len(manifest.arrays),
            "blobs": len(manifest.blob_names()), "manifest_bytes": len(data),
            "head_build_s": t1 - t0, "head_encode_s": t2 - t1, "host_parse_s": t3 - t2,
            "head_parse_phase1_s": t_parse * hosts,
            "head_sent": sent1 + len(data) * hosts, "head_received": recv1}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="64,512,4096")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=120.0, help="skip a topology whose estimate exceeds this")
    a = p.parse_args()
    rows, skipped = [], []
    per_blob_s = None
    for h in [int(x) for x in a.hosts.split(",")]:
        if per_blob_s is not None:
            est = per_blob_s * rows[-1]["blobs"] * h / rows[-1]["hosts"]  # blobs grow with the devices
            if est > a.budget_s:
                skipped.append((h, est))
                continue
        r = measure(h, a.layers)
        rows.append(r)
        per_blob_s = (r["head_build_s"] + r["head_encode_s"] + r["host_parse_s"]) / max(1, r["blobs"])
    print(f"## One save's control plane, simulated: {rows[0]['arrays'] if rows else '?'} arrays "
          f"(--layers {a.layers}), FSDP over hosts x {DEVICES_PER_HOST} devices\n")
    print("| hosts | blobs | manifest | head: build + encode | a host: parse + check | head: parse phase-1 answers "
          "| head sends | head receives | head sends per host |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['hosts']} | {r['blobs']:,} | {_mib(r['manifest_bytes'])} | "
              f"{r['head_build_s'] + r['head_encode_s']:.2f} s | {r['host_parse_s']:.2f} s | "
              f"{r['head_parse_phase1_s']:.2f} s | {_mib(r['head_sent'])} | {_mib(r['head_received'])} | "
              f"{_mib(r['head_sent'] / r['hosts'])} |")
    if len(rows) >= 2:
        a0, a1 = rows[0], rows[-1]
        k = a1["hosts"] / a0["hosts"]
        print(f"\n- {k:.0f}x the hosts: manifest {a1['manifest_bytes'] / a0['manifest_bytes']:.1f}x, head bytes sent "
              f"{a1['head_sent'] / a0['head_sent']:.1f}x, head bytes sent per host "
              f"{(a1['head_sent'] / a1['hosts']) / (a0['head_sent'] / a0['hosts']):.1f}x (target: 1.0x)")
    for h, est in skipped:
        print(f"- {h} hosts: skipped, about {est:.0f} s of CPU by the smaller rows' cost per blob "
              f"(over --budget-s {a.budget_s:g}); phase 2 would send the whole manifest to each of {h} hosts")


if __name__ == "__main__":
    main()
