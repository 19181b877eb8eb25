"""The goodput benchmark's elastic slice loss, on its smallest configuration: mtc in MaxText's
elastic mode (real MaxText, real daemons, 2 slices x 2 hosts; Pathways' slice map and health
check stood in for on CPU by bench/pathways_cpu.py). One slice's sidecars are killed and their
ramdisks wiped while training; the training process stays: mtc's next save raises the lost host
(DATA_LOSS), MaxText's elastic retry waits for the slice (back, empty), initializes again in the
same process and restores through mtc. Checked against the run's own marks and logs: one process
for the whole run, the recovery's stages add up, the restore came through mtc at a step at least
the newest one replicated before the fault, the steps recomputed are those the log shows twice,
and the final state and every step's metrics are the uninterrupted run's, bit for bit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.maxtext, pytest.mark.integration]

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "bench"))
import bench_goodput  # noqa: E402

DELAY = 2.0


def test_elastic_slice_loss_recovers_in_the_same_process(maxtext_python, tmp_path, ramdisk):
    out, work = tmp_path / "goodput.json", ramdisk / "work"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_goodput.py"), "--model", "small", "--steps", "40",
                        "--mtbf", "15", "--seed", "3", "--faults", bench_goodput.ELASTIC, "--max-failures", "1",
                        "--defer-failures", "--fault-min-steps", "10",
                        "--contenders", "mtc", "--mtc-cost", "blocked", "--restart-delay", str(DELAY),
                        "--workdir", str(work), "--json", str(out), "--timeline", str(tmp_path / "g.png")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (mtc,) = json.loads(out.read_text())["contenders"]
    assert mtc["final_equal"] and mtc["metrics_equal"], mtc

    # One training process for the whole run: one pod, one pid in all its marks, no exit but the last.
    pods = sorted((work / "mtc").glob("pod*"))
    assert [p.name for p in pods] == ["pod0"], pods
    marks = [json.loads(ln) for ln in (pods[0] / "marks.jsonl").read_text().splitlines()]
    assert len({m["pid"] for m in marks}) == 1
    assert [m["mark"] for m in marks].count("start") == 1 and [m["mark"] for m in marks].count("final") == 1
    assert not [e for e in mtc["events"] if "by itself" in e["what"]], mtc["events"]

    (rec,) = mtc["recoveries"]
    assert rec["cls"] == bench_goodput.ELASTIC and rec["kind"] == "elastic" and rec["pid"] == marks[0]["pid"], rec
    assert "DATA_LOSS" in rec["error"], rec
    st = rec["stages"]
    parts = [st[name] for name in bench_goodput.ELASTIC_STAGES]
    assert all(p is not None and p >= 0 for p in parts), st
    assert all(st[name] is None for name in bench_goodput.STAGES if name not in bench_goodput.ELASTIC_STAGES), st
    assert abs(sum(parts) - st["total"]) < 1e-6, st
    assert abs(st["total"] - (rec["first_step_at"] - rec["failed_at"])) < 1e-6, rec
    assert st["detect"] + st["slice_wait"] >= DELAY, st  # the slice is back DELAY s after the loss, no sooner

    # The restore came through mtc, at least at the newest step replicated to the other slice before
    # the fault (the log before the retry's "Elastic event detected").
    log = (pods[0] / "log.txt").read_text(errors="replace")
    before, _, after = log.partition("Elastic event detected")
    assert after, "the elastic retry never caught the lost host's error"
    spared = [int(m) for m in re.findall(r"- replicate step (\d+);.*replicated=True", before)]
    assert spared, "no step was replicated before the fault"
    restored = int(re.search(r"restored step (\d+)", rec["restore"].get("mtc", "")).group(1))
    assert restored >= max(spared) and rec["resumed_at"] == restored + 1, (rec, max(spared))
    assert "mtc: restored step" in after

    # Steps recomputed: the steps the process logged twice (once per attempt), read from its log.
    logged = [int(m) for m in re.findall(r"completed step: (\d+)", log)]
    assert set(logged) == set(range(40))
    assert mtc["recomputed"] == len(logged) - len(set(logged)) == rec["recomputed"], (mtc["recomputed"], logged)
