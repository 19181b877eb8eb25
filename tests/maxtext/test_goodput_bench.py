"""The goodput benchmark's accounting, on its smallest configuration: three failures of different
classes under mtc (cluster mode, real daemons, real MaxText): the training process killed, a slice
lost, a sidecar killed (the training goes on through it: its saves fail until the sidecar is
back, and the job does not end). Then the figures are checked against the run's own logs: each
recovery's stages add up to it (failure to first step), the steps recomputed are the steps that
more than one process logged, and the final state and every step's metrics are the uninterrupted
run's, bit for bit."""

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


def test_smallest_run_accounts_for_every_second_and_step(maxtext_python, tmp_path, ramdisk):
    faults = ["kill_head", "slice_lost", "kill_sidecar"]
    seed = next(s for s in range(100) if len({f.cls for f in bench_goodput.schedule(s, 15, faults, 1e4)[:3]}) == 3)
    out = tmp_path / "goodput.json"
    work = ramdisk / "work"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_goodput.py"), "--model", "small", "--steps", "60",
                        "--mtbf", "15", "--seed", str(seed), "--faults", ",".join(faults), "--max-failures", "3",
                        "--contenders", "mtc", "--mtc-cost", "blocked", "--restart-delay", "2",
                        "--workdir", str(work), "--json", str(out),
                        "--timeline", str(tmp_path / "goodput.png")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    (mtc,) = doc["contenders"]
    assert mtc["final_equal"] and mtc["metrics_equal"], mtc
    restarts = [f["cls"] for f in doc["schedule"][:3] if f["cls"] != "kill_sidecar"]
    events = [e["what"] for e in mtc["events"]]
    # No process ends that the schedule did not end: a sidecar killed during saves (the last ones
    # included) costs failed saves, never the training process.
    for e in [e for e in mtc["events"] if "by itself" in e["what"]]:
        log = (work / "mtc" / f"pod{e['segment']}" / "log.txt").read_text(errors="replace")
        raise AssertionError((e, [ln for ln in log.splitlines() if "Error" in ln and "CLEANUP" not in ln][-5:]))
    assert [rec["cls"] for rec in mtc["recoveries"]] == restarts, mtc["recoveries"]
    assert any(e.startswith("kill -9 sidecar") for e in events), events
    for rec in mtc["recoveries"]:
        st = rec["stages"]
        assert rec["kind"] == "restart", rec
        parts = [st[name] for name in bench_goodput.RESTART_STAGES]
        assert all(p is not None and p >= 0 for p in parts), st
        assert all(st[name] is None for name in bench_goodput.STAGES if name not in bench_goodput.RESTART_STAGES), st
        assert abs(sum(parts) - st["total"]) < 1e-6, st
        assert abs(st["total"] - (rec["first_step_at"] - rec["failed_at"])) < 1e-6, rec
        assert st["restart_delay"] >= 2.0, st
        # A recovery restores, through mtc, at least the newest step the fault spared, as the killed
        # process's log says: committed (a process killed), or replicated to the other slice (a
        # slice lost). A failure that struck before any such step (a failure can strike a process
        # at its first step) trains from step 0.
        before = (work / "mtc" / f"pod{rec['segment'] - 1}" / "log.txt").read_text(errors="replace")
        pattern = r"- replicate step (\d+);.*replicated=True" if rec["cls"] == "slice_lost" else r"- save step (\d+);"
        spared = [int(m) for m in re.findall(pattern, before)]
        if spared:
            assert "mtc" in rec["restore"] and rec["resumed_at"] >= max(spared) + 1, (rec, max(spared))
        else:
            assert "mtc" in rec["restore"] or rec["resumed_at"] == 0, rec
    # Steps recomputed: the steps that more than one process logged, read from the logs themselves.
    logged: list[int] = []
    for log in sorted((work / "mtc").glob("pod*/log.txt")):
        logged += sorted({int(m) for m in re.findall(r"completed step: (\d+)", log.read_text(errors="replace"))})
    again = len(logged) - len(set(logged))
    assert mtc["recomputed"] == again, (mtc["recomputed"], again)
    assert set(logged) == set(range(60))
    assert 0 < mtc["ratio"] < 1 and mtc["wall_s"] > mtc["ideal_s"]
    assert (tmp_path / "goodput.png").stat().st_size > 0
