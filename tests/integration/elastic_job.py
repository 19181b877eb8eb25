"""One phase of a training job for the elastic-resize tests, run as its own process.

    python elastic_job.py ROOT SLICES HOSTS DEVICES save|restore STEP OUT [--replication-factor N]
                          [--backup DIR] [--data-parallel]

The head gets DEVICES CPU devices (set before jax is imported: a job that lost a slice has
fewer devices); LocalCluster starts SLICES x HOSTS sidecar daemons on ROOT (their ramdisks
stay there between phases, like a node's ramdisk across a job restart). ``save`` saves
``state(STEP)`` laid out on a (SLICES, DEVICES / SLICES) mesh; ``restore`` restores STEP onto
this phase's mesh and writes the global arrays to OUT (.npz) with the restore report in
OUT.json, for the test to compare bit for bit, with how many shard rows the head parsed.
``--data-parallel``: every array replicated over "data" (the slices are twins, as MaxText runs
multi-slice); otherwise some are split over "data" too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def state(step: int) -> dict[str, np.ndarray]:
    """The global arrays of step ``step``: any mesh shape up to 8 devices divides them."""
    import ml_dtypes

    rng = np.random.default_rng(1000 + step)
    return {
        "w": rng.standard_normal((64, 48)).astype(np.float32),  # replicated over "data": twins
        "u": rng.standard_normal((64, 40)).astype(np.float32),  # split over both axes
        "e": rng.standard_normal((128, 8)).astype(ml_dtypes.bfloat16),  # split over all devices
        "c": rng.integers(0, 100, (16,), dtype=np.int32),  # fully replicated
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("slices", type=int)
    p.add_argument("hosts", type=int)
    p.add_argument("devices", type=int)
    p.add_argument("mode", choices=("save", "restore"))
    p.add_argument("step", type=int)
    p.add_argument("out")
    p.add_argument("--replication-factor", type=int, default=2)
    p.add_argument("--backup", default="")
    p.add_argument("--data-parallel", action="store_true")
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import logging
    logging.basicConfig(level=os.environ.get("EJ_LOG", "WARNING"))
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig
    from mtc.sidecar.local_cluster import LocalCluster

    mesh = Mesh(np.array(jax.devices()).reshape(a.slices, -1), ("data", "model"))
    specs = {"w": P(None, "model"), "u": P("data", "model"), "e": P(("data", "model")), "c": P()}
    if a.data_parallel:
        specs.update(u=P(None, "model"), e=P("model"))
    from mtc.shared import format as fmt

    parsed = [0]  # shard rows the head parsed (host parts read by PartColumns.from_json)
    real = fmt.PartColumns.from_json.__func__

    def counting(cls, data, **kw):
        part = real(cls, data, **kw)
        parsed[0] += len(part)
        return part

    fmt.PartColumns.from_json = classmethod(counting)
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    backup = {"base_output_directory": a.backup, "run_name": "elastic",
              "multi_tier_checkpointing_backup_interval_steps": 1} if a.backup else {}
    with LocalCluster(a.root, a.slices, a.hosts, devices_per_host=a.devices // (a.slices * a.hosts)) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=a.root, cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, replication_factor=a.replication_factor, **backup)
        with CheckpointManager(cfg) as m:
            if a.mode == "save":
                m.save(a.step, {k: jax.device_put(v, shardings[k]) for k, v in state(a.step).items()})
                m.wait_until_finished()
                if a.backup:
                    m.wait_for_backup()
                rep = m.wait_for_replication()
                result = {"replicated": bool(rep and rep.replicated)}
            else:
                target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                          for k, v in state(a.step).items()}
                restored = m.restore(a.step, target=target)
                for k, x in restored.items():
                    assert x.sharding == shardings[k], (k, x.sharding)
                np.savez(a.out, **{k: np.asarray(x) for k, x in restored.items()})
                rep = m.last_restore_report
                result = {"bytes_by_tier": rep.bytes_by_tier, "steps": m.all_steps(), "rows_parsed": parsed[0],
                          "source": rep.source}
    with open(a.out + ".json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
