"""What a killed training process costs: from its kill -9 to the first step trained after it, by stage.

    python bench/bench_restart.py [--model small|default] [--kills 3] [--period 2] [--json FILE]

Real MaxText on mtc (colocated mode: one process; its ramdisk a /dev/shm folder, backups to a local
folder), the bench_goodput model and data, the same pod throughout (one home, so JAX's private
compilation cache is found again, as in a pod whose container restarts). The training process is
killed with SIGKILL right after a step, ``--kills`` times, three ways in one run:

- ``standby``: ``python3 -m mtc.head.maxtext``'s supervisor (``mtc.head.supervisor``) around the
  training process: the kill is seen, the warm standby takes over;
- ``in-place``: the same with ``MTC_STANDBY=0``: the supervisor starts a new process at once (cold
  imports);
- ``new-process``: no supervisor: the harness starts a new process as soon as the old one is reaped
  (what a pod restart costs, less the pod's own restart delay, which comes on top: 5 s is
  bench_goodput's default).

Each recovery is cut at bench/goodput_probe.py's marks: ``start`` (the kill to the program running:
detection, the promotion or the new interpreter), ``imports``, ``init`` (MaxText's initialize: config,
JAX's devices), ``setup`` (until the restore), ``restore``, ``compile`` (the train step, from the
cache), ``first step``. Medians over the kills; the machine's load is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import bench_goodput as gp  # noqa: E402

STAGES = ("start", "imports", "init", "setup", "restore", "compile", "first_step")
CHAIN = (("imports", "imported"), ("init", "initialized"), ("setup", "restore_begin"), ("restore", "restore_end"),
         ("compile", "compiled"), ("first_step", "step"))
WAYS = ("standby", "in-place", "new-process")


def _marks(path: Path) -> list[dict]:
    return gp._read_marks(path)


def _after(marks: list[dict], pid: int, name: str, t: float) -> float | None:
    return next((m["t"] for m in marks if m["pid"] == pid and m["mark"] == name and m["t"] >= t
                 and (name != "compiled" or m.get("prefix") == "train")), None)


def stages(marks: list[dict], killed_at: float, killed_pid: int) -> dict:
    """The recovery after the kill of ``killed_pid`` at ``killed_at``: seconds per stage and in all."""
    start = next((m for m in marks if m["mark"] == "start" and m["pid"] != killed_pid and m["t"] >= killed_at), None)
    if start is None:
        return {}
    out = {"start": start["t"] - killed_at}
    t = start["t"]
    for name, mark in CHAIN:
        at = _after(marks, start["pid"], mark, t)
        if at is None:
            return {}
        out[name] = at - t
        t = at
    out["total"] = t - killed_at
    return out


def run_way(way: str, runner: gp.Runner, work: Path, kills: int, period: int) -> list[dict]:
    d = work / way
    shutil.rmtree(d, ignore_errors=True)
    (d / "home").mkdir(parents=True)
    marks = d / "marks.jsonl"
    extra = ["enable_checkpointing=True", "enable_multi_tier_checkpointing=True",
             f"local_checkpoint_directory={d / 'ramdisk'}", f"local_checkpoint_period={period}",
             f"multi_tier_checkpointing_backup_interval_steps={period * 4}", "checkpoint_period=1000000"]
    flags = runner.flags(d / "bucket", d / "metrics.txt", extra)
    env = runner.env(d / "home", marks, {"MTC_PEER_TOKEN": "bench-restart-token-0123456789abcdef",
                                         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    if way == "in-place":
        env["MTC_STANDBY"] = "0"
    from mtc.head.maxtext import WARM

    probe = [runner.py, str(gp.PROBE), "mtc", *flags]
    cmd = [runner.py, "-m", "mtc.head.supervisor", "--warm", ",".join(WARM), "--", *probe[1:]] if way != "new-process" \
        else probe
    log = (d / "log.txt").open("ab")

    def spawn() -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=d / "home", env=env, stdout=log, stderr=subprocess.STDOUT)

    proc = spawn()
    results, seen_steps = [], 0
    try:
        for k in range(kills):
            deadline = time.monotonic() + 900
            # Kill right after a step, at least two steps into the current process and after a commit.
            while True:
                assert proc.poll() is None, (d / "log.txt").read_text()[-3000:]
                assert time.monotonic() < deadline, "no step"
                ms = _marks(marks)
                steps = [m for m in ms if m["mark"] == "step"]
                current = steps[-1]["pid"] if steps else None
                mine = [m for m in steps if m["pid"] == current]
                if len(mine) >= 2 + period and len(steps) > seen_steps:
                    break
                time.sleep(0.02)
            time.sleep(0.05)
            killed_at = time.time()
            os.kill(current, signal.SIGKILL)
            if way == "new-process":
                proc.wait()
                proc = spawn()
            while True:  # until the first step after the kill
                assert time.monotonic() < deadline, (d / "log.txt").read_text()[-3000:]
                ms = _marks(marks)
                st = stages(ms, killed_at, current)
                if st:
                    break
                time.sleep(0.05)
            seen_steps = len([m for m in ms if m["mark"] == "step"])
            results.append(st)
            print(f"  {way} kill {k + 1}: {st['total']:.2f} s to the first step after it", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(gp.MODELS), default="small")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--period", type=int, default=2, help="local_checkpoint_period (2)")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    a.steps = 100000  # the run is stopped after the kills (SIGTERM)
    ways = [w for w in a.ways.split(",") if w]
    py = str(gp.mx_env.ensure())
    maxtext_dir = Path(subprocess.run([py, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    work = Path(tempfile.mkdtemp(prefix="mtc-restart-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    model = gp.MODELS[a.model]
    data = work / "data" / "data-train-00000.parquet"
    data.parent.mkdir(parents=True)
    subprocess.run([py, "-c", gp.MAKE_DATA, str(data), "1", str(model["rows"])], check=True)
    runner = gp.Runner(a, py, maxtext_dir, data, work, model)
    out = {}
    try:
        for way in ways:
            out[way] = run_way(way, runner, work, a.kills, a.period)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nkill -9 of the training process to its first step after, seconds (median of {a.kills}; model "
          f"{a.model}; {os.cpu_count()} cores, load average {load[0]:.1f})\n")
    print("| way | " + " | ".join(STAGES) + " | total | min-max |")
    print("|---|" + "---|" * (len(STAGES) + 2))
    for way, rs in out.items():
        med = {s: statistics.median(r[s] for r in rs) for s in (*STAGES, "total")}
        tot = [r["total"] for r in rs]
        print(f"| {way} | " + " | ".join(f"{med[s]:.2f}" for s in STAGES) + f" | {med['total']:.2f} | "
              f"{min(tot):.2f}-{max(tot):.2f} |")
    if "standby" in out and "new-process" in out:
        s = statistics.median(r["total"] for r in out["standby"])
        n = statistics.median(r["total"] for r in out["new-process"])
        print(f"\nstandby / new-process: {s / n:.2f} (a pod restart adds its restart delay to new-process)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
