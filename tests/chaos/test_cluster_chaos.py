"""kill -9 of one sidecar daemon at random moments of saves, on a 2 x 2 cluster of real daemons.

What must hold after every trial:
- a save either succeeds or raises SaveError naming exactly the killed host;
- while the host is down, latest_step() confirms nothing;
- once it is back, latest_step() is the newest step whose save succeeded, every step in
  all_steps() is one whose save succeeded, no host keeps a failed step committed on disk, and
  the latest step restores bit for bit.

Trials are random-timing kills (a timer fires somewhere in the save) plus deterministic kills
at each named crash point of the sidecar (``MTC_CRASH_AT``). ``MTC_CHAOS_SEED`` replays a run,
``MTC_CHAOS_TRIALS`` sets the number of random trials.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_trees_bitwise_equal, random_array
from mtc.head import CheckpointManager, MTCConfig
from mtc.shared.errors import SaveError, StepsUnconfirmedError
from mtc.sidecar.local_cluster import LocalCluster
from mtc.sidecar.faults import CRASH_POINTS

SAVE_POINTS = sorted(CRASH_POINTS - {"between_uploads"})  # the crash points of a save

pytestmark = pytest.mark.chaos

RANDOM_TRIALS = int(os.environ.get("MTC_CHAOS_TRIALS", "24"))


def make_state(seed: int) -> dict:
    """About 6 MiB: big enough that a save takes a while, so random kills land inside it."""
    rng = np.random.default_rng(seed)
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return {
        "w": jax.device_put(random_array(rng, (512, 1024), np.float32), NamedSharding(m, P("data", "model"))),
        "v": jax.device_put(random_array(rng, (256, 1024), np.float32), NamedSharding(m, P(None, "model"))),
        "b": jax.device_put(random_array(rng, (1024,), np.float32), NamedSharding(m, P())),
        "rng": random_array(rng, (2,), np.uint32),
        "step": seed,
    }


def committed_on_disk(cluster: LocalCluster, host: str) -> set[int]:
    return {int(p.name[:12]) for p in (cluster.store_root(host) / "steps").iterdir() if p.name.endswith(".json")
            and not p.name.startswith(".")}


def test_kill_9_of_a_daemon_during_saves_never_exposes_a_partial_step(ramdisk):
    seed = int(os.environ.get("MTC_CHAOS_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    why = f"(replay with MTC_CHAOS_SEED={seed})"
    trials = [("random", None)] * RANDOM_TRIALS + [("point", p) for p in SAVE_POINTS] * 2
    rng.shuffle(trials)
    outcomes = {"ok": 0, "failed": 0}
    with LocalCluster(ramdisk / "cluster", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, restore_host_wait_s=0)  # a host down: answer at once
        with CheckpointManager(cfg) as m:
            good: dict[int, dict] = {}
            # Clean saves first: the baseline, and how long a (warm) save takes here.
            for step in (1, 2):
                t0 = time.perf_counter()
                good[step] = make_state(step)
                m.save(step, good[step])
                m.wait_until_finished()
                save_s = time.perf_counter() - t0
            for i, (kind, point) in enumerate(trials):
                step = i + 3
                state = make_state(step)
                victim = rng.choice(cluster.hosts)
                killer = None
                if kind == "point":
                    cluster.restart(victim, env={"MTC_CRASH_AT": point})
                else:
                    killer = threading.Timer(rng.uniform(0, 1.5 * save_s), cluster.kill, (victim,))
                    killer.start()
                what = f"trial {i} ({kind} {point or ''}, victim {victim}, step {step}) {why}"
                m.save(step, state)
                try:
                    m.wait_until_finished()
                    good[step] = state
                    outcomes["ok"] += 1
                except SaveError as e:
                    phase = "phase 1" if "phase 1" in str(e) else "phase 2" if "phase 2" in str(e) else "other"
                    outcomes[phase] = outcomes.get(phase, 0) + 1
                    outcomes["failed"] += 1
                    assert e.step == step, what
                    assert set(e.hosts) == {victim}, f"{what}: {e.hosts}"
                if killer is not None:
                    killer.join()
                if kind == "point":
                    assert cluster.wait(victim) == -signal.SIGKILL, f"{what}: the crash point was not reached"
                cluster.kill(victim)  # a kill that came after the save, or none: kill now
                with pytest.raises(StepsUnconfirmedError, match=victim):  # nothing confirmed while a host is down
                    m.latest_step()
                cluster.restart(victim)

                steps = m.all_steps()
                assert steps and steps[-1] == max(good), f"{what}: all_steps {steps}, good {sorted(good)}"
                assert set(steps) <= set(good), f"{what}: a failed step is listed: {steps}"
                # The head aborted failed steps on every host once it reached them again.
                for h in cluster.hosts:
                    assert committed_on_disk(cluster, h) <= set(good), f"{what}: {h} keeps a failed step"
                assert_trees_bitwise_equal(good[steps[-1]], m.restore(), check_sharding=True)
            # Every step still listed restores bit for bit.
            for s in m.all_steps():
                assert_trees_bitwise_equal(good[s], m.restore(s))
    print(f"chaos: {len(trials)} trials, save {save_s * 1e3:.0f} ms, {outcomes} {why}")
    assert outcomes["failed"] >= 2 * len(SAVE_POINTS), outcomes  # every crash point fails its save
