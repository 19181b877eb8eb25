"""``mtc plan``: how often to checkpoint to each tier, and the goodput it buys.

The model (first-order Young/Daly, per tier). Failures arrive at random, one every ``mtbf``
seconds for the whole job. A fraction ``backup_fraction`` of them loses every ramdisk (the
whole cluster, or both copies of a shard) and needs the backup; the others are recovered from
the hosts: from RAM (a process or pod restart) or, for a fraction ``peer_fraction`` of them (a
replaced host, a lost slice), from a peer. For a tier checkpointed every ``tau`` seconds at a
cost ``c`` to training and recovered in ``r`` seconds, each failure it serves loses on average
``tau / 2`` of work plus ``r``, so the fraction of time wasted is, to first order,

    waste(tau) = c / tau + (tau / 2 + r) / M_tier,      M_tier = mtbf / (share of failures it serves)

minimised at ``tau* = sqrt(2 c M_tier)`` (Young's formula). A tier is never checkpointed more
often than it takes to write (``tau >= write time``). Every failure also costs ``restart_s``
besides its restore (detecting it, the new process, its imports, JAX's initialisation and
compilation, the first step), whatever the intervals (so it moves no interval).

Goodput is the share of wall time left after the failures, ``1 - F`` with
``F = sum over tiers of (tau / 2 + r) / M_tier + restart_s / mtbf``, of which the checkpoints
take their part: ``goodput = (1 - F) / (1 + C)``, ``C = sum over tiers of c / tau`` (each
``tau`` of training costs ``c`` more). To first order this is ``1 - C - F``, the sum of the
tiers' waste; the quotient stays right where failures are frequent against the restart and the
first-order sum runs to zero (``bench/bench_goodput.py`` compares both with real MaxText under
failures).

Costs are per host (each host writes and reads its own part in parallel, so a job's cost is a
host's): with mtc the training loop pays only the device-to-host copy of a local save
(``local_blocked_s``); writing it (``local_write_s``) and the backup (``backup_s``) run in the
background, charged ``backup_overhead`` (default 5 %) of the upload's duration for the network
and CPU it takes from the step. Two baselines, on the same numbers: **backup-only** (checkpoints go to the bucket
only: every failure restores from the backup, saves are asynchronous but cannot be more
frequent than a backup takes), and **blocking saves** (the same two tiers, but training waits
for every local write and every backup upload).

Assumptions: failures are independent and exponential; one failure at a time (recovery is
short against the MTBF); restore times do not depend on when the failure hits; the background
work of mtc does not slow the training step (on a real accelerator the host CPU and network
are otherwise idle; measure yours with ``bench/bench_maxtext.py``).
"""

from __future__ import annotations

import dataclasses
import math

from mtc.shared.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds, per host, for its share of the checkpoint."""

    local_blocked_s: float  # what a local save blocks training (the device-to-host copy)
    local_write_s: float  # a whole local save (copy + write to the ramdisk)
    backup_s: float  # one backup upload of a host's share
    restore_ram_s: float
    restore_peer_s: float
    restore_backup_s: float
    restart_s: float = 0.0  # what every failure costs besides its restore (the new process, up to its first step)


@dataclasses.dataclass(frozen=True)
class TierPlan:
    interval_s: float
    saving: float  # c / tau: what its checkpoints add to each second of training
    failures: float  # (tau / 2 + r) / M_tier: the share of wall time the failures it serves lose

    @property
    def waste(self) -> float:
        """The fraction of time lost to this tier's saves and the failures it serves (first order)."""
        return self.saving + self.failures


@dataclasses.dataclass(frozen=True)
class Plan:
    local: TierPlan
    backup: TierPlan
    goodput: float
    backup_only_interval_s: float
    backup_only_goodput: float
    blocking_local_interval_s: float
    blocking_backup_interval_s: float
    blocking_goodput: float


def tier(cost: float, interval: float, restore: float, mtbf: float) -> TierPlan:
    """One tier checkpointed every ``interval`` seconds at ``cost`` each, serving a failure every
    ``mtbf`` seconds that loses half an interval of work plus ``restore``."""
    return TierPlan(interval, cost / interval, (interval / 2 + restore) / mtbf)


def goodput(tiers: "list[TierPlan]", restart_s: float, mtbf_s: float) -> float:
    """The share of wall time that trains: ``(1 - F) / (1 + C)`` (see the module docstring)."""
    failures = sum(t.failures for t in tiers) + restart_s / mtbf_s
    return (1 - failures) / (1 + sum(t.saving for t in tiers))


def _tier(cost: float, mtbf_tier: float, restore: float, floor: float) -> TierPlan:
    """Young's optimum for one tier, not below ``floor`` (the time one checkpoint takes)."""
    if math.isinf(mtbf_tier):  # the tier serves no failure: it need not be written at all
        return TierPlan(math.inf, 0.0, 0.0)
    tau = max(floor, math.sqrt(2 * cost * mtbf_tier))
    return tier(cost, tau, restore, mtbf_tier)


def plan(costs: Costs, *, mtbf_s: float, backup_fraction: float = 0.05, peer_fraction: float = 0.5,
         backup_overhead: float = 0.05) -> Plan:
    """The recommended intervals and the expected goodput (see the module docstring).

    ``backup_overhead`` is the share of an asynchronous upload's duration charged to training
    (the host's network and CPU it takes while the step runs).
    """
    if not mtbf_s > 0 or math.isinf(mtbf_s):
        raise ConfigError(f"--mtbf must be a positive, finite time, got {mtbf_s!r}")
    for name, v in (("backup_fraction", backup_fraction), ("peer_fraction", peer_fraction),
                    ("backup_overhead", backup_overhead)):
        if not 0 <= v <= 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be between 0 and 1, got {v}")
    for f in dataclasses.fields(costs):
        v = getattr(costs, f.name)
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"cost {f.name} must be a finite number of seconds >= 0, got {v!r}")
    local_share = 1 - backup_fraction
    m_local = mtbf_s / local_share if local_share > 0 else math.inf
    m_backup = mtbf_s / backup_fraction if backup_fraction > 0 else math.inf
    r_local = (1 - peer_fraction) * costs.restore_ram_s + peer_fraction * costs.restore_peer_s
    # mtc: training pays the device-to-host copy per local save, and the overhead share of each
    # background upload per backup.
    upload = backup_overhead * costs.backup_s
    local = _tier(costs.local_blocked_s, m_local, r_local, costs.local_write_s)
    backup = _tier(upload, m_backup, costs.restore_backup_s, costs.backup_s)
    restart = costs.restart_s  # every failure, whichever tier restores it
    # Backup-only: every failure restores from the bucket; saves asynchronous (the copy, plus the
    # upload's overhead), never more often than an upload takes.
    only = _tier(costs.local_blocked_s + upload, mtbf_s, costs.restore_backup_s, costs.backup_s)
    # Blocking saves: both tiers, training waits for each local write and each backup upload.
    b_local = _tier(costs.local_write_s, m_local, r_local, costs.local_write_s)
    b_backup = _tier(costs.backup_s, m_backup, costs.restore_backup_s, costs.backup_s)
    return Plan(local=local, backup=backup, goodput=goodput([local, backup], restart, mtbf_s),
                backup_only_interval_s=only.interval_s, backup_only_goodput=goodput([only], restart, mtbf_s),
                blocking_local_interval_s=b_local.interval_s, blocking_backup_interval_s=b_backup.interval_s,
                blocking_goodput=goodput([b_local, b_backup], restart, mtbf_s))


def costs_from_rates(bytes_per_host: float, *, d2h_gbps: float, write_gbps: float, backup_gbps: float,
                     ram_read_gbps: float, peer_gbps: float, backup_read_gbps: float) -> Costs:
    """Costs of one host's share at the given rates (GB/s)."""
    b = bytes_per_host / 1e9
    return Costs(local_blocked_s=b / d2h_gbps, local_write_s=b / d2h_gbps + b / write_gbps, backup_s=b / backup_gbps,
                 restore_ram_s=b / ram_read_gbps, restore_peer_s=b / peer_gbps + b / ram_read_gbps,
                 restore_backup_s=b / backup_read_gbps + b / ram_read_gbps)


def measure_rates(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of each cost on this machine, measured with mtc itself (colocated, in this process)
    on a ramdisk folder (/dev/shm when present) and a backup directory in the temp directory;
    the peer rate is a raw loopback socket copy (no second host here)."""
    import os
    import shutil
    import socket
    import tempfile
    import threading
    import time

    import jax
    import numpy as np

    from mtc.head.manager import CheckpointManager
    from mtc.shared.config import MTCConfig

    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    ram, disk = tempfile.mkdtemp(prefix="mtc-plan-", dir=shm), tempfile.mkdtemp(prefix="mtc-plan-backup-")
    rng = np.random.default_rng(0)
    n = nbytes // 4 // 4
    state = {f"a{i}": jax.device_put(rng.standard_normal(n, dtype=np.float32)) for i in range(4)}
    total = sum(int(x.nbytes) for x in state.values())
    gb = total / 1e9
    cfg = dict(local_checkpoint_period=1, base_output_directory=disk, run_name="plan",
               multi_tier_checkpointing_backup_interval_steps=1000, prefetch_on_start=False)  # step 0 only
    try:
        with CheckpointManager(MTCConfig(local_checkpoint_directory=ram, **cfg)) as m:
            m.save(0, state)
            m.wait_until_finished()
            backup = m.wait_for_backup()
            # The first saves land in fresh ramdisk files (first-touch page faults, until the pruned
            # steps' files are reused: local_max_to_keep + 1 saves); then saves until the device-to-host
            # figure is stable (the last three within 20 % of their median), at most twelve.
            blocked, writes = [], []
            for step in range(1, 13):
                state = jax.block_until_ready({k: v + 1 for k, v in state.items()})  # the step, not the save
                m.save(step, state)
                m.wait_until_finished()
                save = m.last_save_report
                blocked.append(save.blocked_s)
                writes.append(max(save.total_s - save.blocked_s, 1e-6))
                last = sorted(blocked[-3:])
                if step >= 6 and (last[-1] - last[0]) <= 0.2 * last[1]:
                    break
            t0 = time.perf_counter()
            jax.block_until_ready(m.restore(step))
            ram_s = time.perf_counter() - t0
        ram2 = tempfile.mkdtemp(prefix="mtc-plan-", dir=shm)  # every ramdisk lost: from the backup
        try:
            with CheckpointManager(MTCConfig(local_checkpoint_directory=ram2, **cfg)) as m:
                t0 = time.perf_counter()
                jax.block_until_ready(m.restore(0))
                backup_read_s = time.perf_counter() - t0
        finally:
            shutil.rmtree(ram2, ignore_errors=True)
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    a, b = socket.socketpair()
    payload = np.ones(total, np.uint8)
    sink = np.zeros(total, np.uint8)  # touched: the copy, not page faults, is what is timed

    def send() -> None:
        a.sendall(memoryview(payload))

    peer_s = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        th = threading.Thread(target=send)
        th.start()
        view, got = memoryview(sink), 0
        while got < total:
            got += b.recv_into(view[got:], min(16 << 20, total - got))
        th.join()
        peer_s = min(peer_s, time.perf_counter() - t0)
    a.close()
    b.close()
    # The least of the steady saves (the first three land in fresh files): what a save costs when
    # nothing else runs on the cores. Noise only adds time, so the least is the figure two runs on a
    # busy machine agree on, where a median moves with the load.
    warm = sorted(blocked[3:])
    rates = {"d2h": gb / warm[0], "write": gb / min(writes[3:]),
             "backup": gb / max(backup.seconds, 1e-6), "ram_read": gb / ram_s, "peer": gb / peer_s,
             "backup_read": gb / backup_read_s}
    spread = {"d2h": (gb / warm[-1], gb / warm[0]), "saves": len(blocked)}
    return {**rates, "_spread": spread}
