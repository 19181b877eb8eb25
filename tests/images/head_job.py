"""The head's side of the image test, run inside the mtc-head container (not by pytest):

    python head_job.py save|restore|fingerprint CLUSTER_SPEC OUT_DIR

``save`` saves ``state()`` (step 5, laid out over the 4 CPU devices of 1 slice x 2 hosts) to
the sidecar daemons of CLUSTER_SPEC, waits for the commit and the replication, and writes the
global arrays' bytes to OUT_DIR/saved/. ``restore`` (a new process, as after a restart)
restores the newest step onto the same layout and writes OUT_DIR/restored/ and the restore
report. A refused sidecar (``VersionMismatchError``) writes its message to OUT_DIR/refused.txt
and exits 3.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.shared.errors import VersionMismatchError  # noqa: E402

STEP = 5


def state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2026)
    return {
        "w": rng.standard_normal((64, 48)).astype(np.float32),  # split over both hosts' devices
        "e": rng.standard_normal((128, 8)).astype(ml_dtypes.bfloat16),  # split over every device
        "c": rng.integers(0, 1 << 30, (16,), dtype=np.int32),  # replicated
    }


def shardings() -> dict[str, NamedSharding]:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("host", "dev"))
    return {"w": NamedSharding(mesh, P("host", "dev")), "e": NamedSharding(mesh, P(("host", "dev"))),
            "c": NamedSharding(mesh, P())}


def dump(arrays: dict, folder: Path) -> None:
    """Each array's raw bytes, with its dtype and shape: compared byte for byte by the test."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {}
    for k, a in arrays.items():
        a = np.asarray(a)
        (folder / f"{k}.bin").write_bytes(a.tobytes())
        meta[k] = {"dtype": str(a.dtype), "shape": list(a.shape)}
    (folder / "arrays.json").write_text(json.dumps(meta, sort_keys=True))


def main() -> int:
    mode, spec, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode == "fingerprint":
        from mtc.shared.version import fingerprint

        print(json.dumps(fingerprint()))
        return 0
    cfg = MTCConfig(local_checkpoint_directory="/tmp/mtc", cluster_spec=spec, local_checkpoint_period=1,
                    replication_factor=2, prefetch_on_start=False)
    sh = shardings()
    try:
        with CheckpointManager(cfg) as m:
            if mode == "save":
                values = state()
                placed = {k: jax.device_put(v, sh[k]) for k, v in values.items()}
                if not m.save(STEP, placed):
                    raise SystemExit(f"save({STEP}) did not start a save")
                m.wait_until_finished()
                rep = m.wait_for_replication()
                dump(values, out / "saved")
                (out / "save.json").write_text(json.dumps({"replication": repr(rep)}))
            else:
                step = m.latest_step()
                target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in state().items()}
                restored = m.restore(step, target=target)
                for k, v in restored.items():
                    if v.sharding != sh[k]:
                        raise SystemExit(f"{k} came back with sharding {v.sharding}, not {sh[k]}")
                dump(restored, out / "restored")
                r = m.last_restore_report
                (out / "restore.json").write_text(json.dumps({"step": step, "bytes_by_tier": r.bytes_by_tier}))
    except VersionMismatchError as e:
        (out / "refused.txt").write_text(str(e))
        print(e, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
