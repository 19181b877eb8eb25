"""``mtc plan``: how often to checkpoint to each tier, and the goodput it buys (``mtc.head.tools.plan``
does the arithmetic; this prints it)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes


def _duration(text: str, flag: str = "--mtbf") -> float:
    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(t[-1:], None)
    try:
        return float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a duration (e.g. 1h, 30m, 3600)") from None


def _numbers(flag: str, text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: each of the comma-separated values must be a number") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from mtc.head.tools import plan as planner

    def fail(msg: str) -> int:
        print(f"mtc plan: error: {msg}", file=sys.stderr)
        return 2

    notes: list[str] = []
    try:
        mtbf = _duration(args.mtbf)
        for flag, v in (("--params", args.params), ("--step-time", args.step_time),
                        ("--bytes-per-param", args.bytes_per_param)):
            if not (math.isfinite(v) and v > 0):
                return fail(f"{flag} must be a positive, finite number, got {v:g}")
        if args.hosts < 1 or args.slices < 1:
            return fail("--hosts and --slices must be positive")
        per_host = args.params * args.bytes_per_param / args.hosts
        if args.costs:
            vals = _numbers("--costs", args.costs)
            if len(vals) != 6:
                return fail("--costs takes 6 numbers: blocked,write,backup,restore_ram,restore_peer,restore_backup")
            costs, how = planner.Costs(*vals), "given (--costs)"
        elif args.rates or args.measure:
            if args.measure:
                r = planner.measure_rates()
                lo, hi = r.pop("_spread")["d2h"]
                how = "measured with mtc on this machine (--measure)"
                if hi > 1.5 * lo:
                    notes.append(f"the device-to-host rate varied from {lo:.2f} to {hi:.2f} GB/s over the last saves "
                                 "(a busy machine?): the recommendation moves with it; measure again when the machine "
                                 "is quiet, or give --rates")
            else:
                vals = _numbers("--rates", args.rates)
                if len(vals) != 6 or min(vals) <= 0:
                    return fail("--rates takes 6 positive GB/s: d2h,write,backup,ram_read,peer,backup_read")
                r = dict(zip(("d2h", "write", "backup", "ram_read", "peer", "backup_read"), vals))
                how = "from the rates given (--rates)"
            costs = planner.costs_from_rates(per_host, d2h_gbps=r["d2h"], write_gbps=r["write"],
                                             backup_gbps=r["backup"], ram_read_gbps=r["ram_read"],
                                             peer_gbps=r["peer"], backup_read_gbps=r["backup_read"])
            how += " (GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) + ")"
        else:
            return fail("give the costs: --measure (measure them here), --rates or --costs")
        restart = _duration(args.restart, "--restart")
        if not (math.isfinite(restart) and restart >= 0):
            return fail(f"--restart must be a finite time >= 0, got {args.restart!r}")
        costs = dataclasses.replace(costs, restart_s=restart)
        p = planner.plan(costs, mtbf_s=mtbf, backup_fraction=args.backup_fraction, peer_fraction=args.peer_fraction,
                         backup_overhead=args.backup_overhead)
    except (ConfigError, ValueError) as e:
        return fail(str(e))
    if p.goodput <= 0:
        return fail(f"with a failure every {mtbf:g} s this job makes no progress under any checkpoint interval "
                    f"(a local save blocks {costs.local_blocked_s:.2f} s and takes {costs.local_write_s:.2f} s, a restore "
                    f"from RAM {costs.restore_ram_s:.2f} s): the MTBF must be much longer than these; check --mtbf "
                    "(e.g. 1h, 30m)")
    if math.isfinite(p.backup.interval_s) and p.local.interval_s > p.backup.interval_s:
        notes.append(f"local checkpoints would be rarer (every {p.local.interval_s:.0f} s) than backups (every "
                     f"{p.backup.interval_s:.0f} s): the local save's blocked time ({costs.local_blocked_s:.2f} s) is "
                     "large against the backup's charged overhead; check the costs (a busy machine measures slow "
                     "copies), or raise --backup-overhead")
    period = max(1, round(p.local.interval_s / args.step_time))
    minutes = max(1, math.ceil(p.backup.interval_s / 60)) if math.isfinite(p.backup.interval_s) else None
    print(f"{args.params:.3g} parameters x {args.bytes_per_param:g} B over {args.hosts} hosts per slice "
          f"({args.slices} slice(s)): {format_bytes(int(per_host))} per host; MTBF {mtbf:.0f} s; "
          f"{args.backup_fraction:.0%} of failures need the backup, {args.peer_fraction:.0%} of the rest a peer")
    print(f"costs per host, {how}:")
    for name, v in dataclasses.asdict(costs).items():
        if name == "restart_s" and not v:  # --restart not given: no line that reads as "a restart is free"
            continue
        print(f"  {name:18} {v:9.2f} s")
    print("recommended:")
    print(f"  local_checkpoint_period={period}  (every {p.local.interval_s:.0f} s = sqrt(2 x blocked x MTBF_local), "
          f"at {args.step_time:g} s a step)")
    print("  multi_tier_checkpointing_backup_interval_minutes=" + (f"{minutes}" if minutes else "none (no failure "
          "needs it)") + (f"  (every {p.backup.interval_s:.0f} s = sqrt(2 x overhead x upload x MTBF_backup), "
                          "at least one upload)" if minutes else ""))
    print("expected goodput ((1 - F) / (1 + C): F = sum over tiers of (tau/2 + restore)/MTBF_tier + restart/MTBF, "
          "C = sum of cost/tau):")
    print(f"  mtc (RAM + peers + backup)  {p.goodput:8.2%}")
    print(f"  backup only                 {p.backup_only_goodput:8.2%}  (checkpoints every "
          f"{p.backup_only_interval_s:.0f} s, every failure restores from the bucket)")
    print(f"  blocking saves              {p.blocking_goodput:8.2%}  (training waits for each local write and "
          "each backup)")
    for n in notes:
        print(f"warning: {n}", file=sys.stderr)
    return 0
