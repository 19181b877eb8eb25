"""The soak's head: one training process, driven by the soak over stdin/stdout (JSON lines).

    python soak_head.py SEED WORKDIR

It owns one ``CheckpointManager`` at a time, over a subset of the cluster's hosts (a lost slice
means fewer hosts and devices). The soak kills it with SIGKILL and starts another, as a job
restart would. Each command is one JSON object a line; each answer one JSON line:

- ``{"op": "open", "spec": PATH, "hosts": [...], "config": {...}}``: a manager on those hosts
  (their devices, in spec order), with ``MTCConfig(**config)``; closes the previous one.
- ``{"op": "save", "step": N}``: saves ``state(SEED, N)``; answers once the device-to-host copy
  is done (the save goes on in the background).
- ``{"op": "wait"}``: ``wait_until_finished()``; ``{"op": "wait_backup"}``, ``{"op": "wait_replication"}``.
- ``{"op": "steps"}``: ``all_steps()`` and ``latest_step()``.
- ``{"op": "restore", "step": N | null}``: restores N (null: the latest step) onto this
  manager's mesh and answers the step, the digest of what came back and the report.
- ``{"op": "close"}``.

Every failure is an answer (``{"error": TYPE, "message": ..., "hosts": ...}``), never an exit.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import soak_state  # noqa: E402
from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher  # noqa: E402

MODEL = 4  # devices on the "model" axis; "data" is the rest


def _listing_deadline() -> None:
    """``MTC_SOAK_LISTING_DEADLINE_S``: the short CI variant lists an unreachable bucket for less than
    mtc's 30 s, so a restart during an outage costs seconds there (the long soak keeps mtc's own)."""
    raw = os.environ.get("MTC_SOAK_LISTING_DEADLINE_S")
    if raw:
        from mtc.head.restore import restorer

        restorer.LISTING_DEADLINE_S = float(raw)


class Head:
    def __init__(self, seed: int, workdir: Path):
        self.seed = seed
        self.workdir = workdir
        self.mgr: CheckpointManager | None = None
        self.shardings: dict | None = None
        self.opened = 0
        self.spec_key = None

    def open(self, spec: str, hosts: list[str], config: dict) -> dict:
        self.close()
        self.spec, self.hosts = Path(spec), list(hosts)
        self.sub = self.workdir / f"head-{os.getpid()}-{self.opened}.json"
        self.opened += 1
        doc = self._refresh(force=True)
        # The spec lists hosts in device order: the first hosts of the full spec own the first devices.
        devices, start = sorted(jax.devices(), key=lambda d: d.id), 0
        live = []
        for h in doc["hosts"]:
            n = h["devices"]
            if h["id"] in hosts:
                live += devices[start:start + n]
            start += n
        cfg = MTCConfig(**{**config, "cluster_spec": str(self.sub)})
        mesh = Mesh(np.array(live).reshape(-1, MODEL), ("data", "model"))
        self.shardings = {k: NamedSharding(mesh, P(*spec_)) for k, (_, _, _, spec_) in soak_state.LEAVES.items()}
        self.mgr = CheckpointManager(cfg, dispatcher=ClusterDispatcher(cfg, devices=live))
        return {"devices": len(live)}

    def _refresh(self, force: bool = False) -> dict:
        """Keep this head's spec (a subset of the cluster's) in step with the cluster's: a restarted
        daemon has a new address, which the dispatcher picks up from its spec file."""
        st = self.spec.stat()
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if force or key != self.spec_key:
            doc = json.loads(self.spec.read_text())
            entries = [h for h in doc["hosts"] if h["id"] in self.hosts]
            tmp = self.sub.with_suffix(".tmp")
            tmp.write_text(json.dumps({**doc, "hosts": entries}))
            os.replace(tmp, self.sub)
            self.spec_key, self.spec_doc = key, doc
        return self.spec_doc

    def save(self, step: int) -> dict:
        arrays = soak_state.state(self.seed, step)
        placed = {k: jax.device_put(v, self.shardings[k]) for k, v in arrays.items()}
        started = self.mgr.save(step, placed, force=True)
        return {"started": bool(started), "digest": soak_state.digest(arrays)}

    def restore(self, step: int | None) -> dict:
        chosen = self.mgr.latest_step() if step is None else step
        if chosen is None:
            return {"step": None}
        target = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.shardings[k])
                  for k, (shape, dtype, _, _) in soak_state.LEAVES.items()}
        got = self.mgr.restore(chosen, target=target)
        wrong_sharding = sorted(k for k, x in got.items() if x.sharding != self.shardings[k])
        rep = self.mgr.last_restore_report
        return {"step": chosen, "digest": soak_state.digest({k: np.asarray(x) for k, x in got.items()}),
                "wrong_sharding": wrong_sharding, "bytes_by_tier": dict(rep.bytes_by_tier) if rep else {}}

    def close(self) -> dict:
        if self.mgr is not None:
            m, self.mgr = self.mgr, None
            m.close()
        return {}

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "open":
            return self.open(cmd["spec"], cmd["hosts"], cmd.get("config") or {})
        if op == "close":
            return self.close()
        if self.mgr is None:
            raise RuntimeError(f"{op}: no manager open")
        self._refresh()
        if op == "save":
            return self.save(int(cmd["step"]))
        if op == "wait":
            self.mgr.wait_until_finished()
            return {}
        if op == "wait_backup":
            rep = self.mgr.wait_for_backup()
            return {"step": getattr(rep, "step", None), "name": getattr(rep, "name", None)}
        if op == "wait_replication":
            rep = self.mgr.wait_for_replication()
            return {"replicated": bool(rep and rep.replicated)}
        if op == "steps":
            return {"all": self.mgr.all_steps(), "latest": self.mgr.latest_step()}
        if op == "restore":
            return self.restore(cmd.get("step"))
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    seed, workdir = int(sys.argv[1]), Path(sys.argv[2])
    _listing_deadline()
    head = Head(seed, workdir)
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else that prints goes to the log, not into the answers
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer = {"ok": True, **head.handle(cmd)}
        except Exception as e:  # noqa: BLE001 - every failure is reported to the soak, which judges it
            answer = {"ok": False, "error": type(e).__name__, "message": str(e)[:3000],
                      "hosts": sorted(getattr(e, "hosts", {}) or {}), "step": getattr(e, "step", None),
                      "traceback": traceback.format_exc()[-3000:]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    head.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
