"""A small training program for the supervisor's tests (run by path): real mtc saves and restores on a
real ramdisk folder; each step's state depends on the one before, so a restart that lost or repeated
a step ends with another final state. It prints one JSON event a line on stdout.

    python supervised_train.py ROOT STEPS OUT   (env: STEP_SLEEP seconds a step, CRASH=1: exit 3 at once,
                                                 BAD_INPUT=1: exit 2 at once, PORT: metrics port,
                                                 BACKUP_ROOT: back up there (every 1000 steps) and watch
                                                 for backups asked by SIGUSR1)
"""

import hashlib
import json
import os
import signal
import sys
import time

from mtc.head import supervisor


def event(**kw):
    print(json.dumps({"pid": os.getpid(), "t": time.time(), **kw}), flush=True)


prom = supervisor.promotion()
event(event="start", restart=prom.get("restart"), warm_jax="jax" in prom.get("warm", []),
      jax_imported_before_go="jax" in prom.get("warm", []) and "jax" in sys.modules)
if os.environ.get("BAD_INPUT"):
    print("bad flag: nope", file=sys.stderr)
    sys.exit(2)
if os.environ.get("CRASH"):
    sys.exit(3)

import numpy as np  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402

root, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
backup = os.environ.get("BACKUP_ROOT")
cfg = MTCConfig(local_checkpoint_directory=root, local_checkpoint_period=1, local_max_to_keep=3,
                metrics_port=int(os.environ.get("PORT", "0")), metrics_address="127.0.0.1",
                **(dict(base_output_directory=backup, run_name="job",
                        multi_tier_checkpointing_backup_interval_steps=1000) if backup else {}))
with CheckpointManager(cfg) as m:
    if backup:
        m.watch_backup_requests()
    step = m.latest_step()
    if step is None:
        step, state = 0, {"w": np.arange(4096, dtype=np.float32), "n": np.int64(0)}
    else:
        state = m.restore(step)
    event(event="restored", step=step)
    while step < steps:
        step += 1
        state = {"w": state["w"] * np.float32(1.001) + np.float32(step), "n": state["n"] + step}
        m.save(step, state)
        m.wait_until_finished()
        if backup:
            m.wait_for_backup()
        event(event="trained", step=step, **({"backups": sorted(b["step"] for b in m.backups())} if backup else {}))
        if stop:
            event(event="preempted", step=step)
            sys.exit(0)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
digest = hashlib.sha256(state["w"].tobytes() + np.int64(state["n"]).tobytes()).hexdigest()
with open(out, "w") as f:
    f.write(digest)
event(event="done", step=step, digest=digest)
