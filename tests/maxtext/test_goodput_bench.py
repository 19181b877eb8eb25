"""The goodput benchmark's accounting, on its smallest configuration: four failures of different
classes, struck at their drawn wall times (during recoveries too), under mtc (its supervisor and
standby in the head pod; cluster mode, real daemons, real MaxText) and under MaxText's standard
checkpointing with the same supervisor: the training process killed (restarted in the pod), a
slice lost (the training process dies with it; the slice comes back empty after the delay, and the
supervisor's restart waits for it), a
sidecar killed (the training goes on through it), the head pod lost (a new pod, cold, after the
delay). Then the figures are checked against the run's own marks: each recovery's stages add up to
it (failure to first step, or to the next failure that cut it), the steps recomputed are the steps
that more than one process trained, and the final state and every step's metrics are the
uninterrupted run's, bit for bit."""

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

FAULTS = ["kill_head", "slice_lost", "kill_sidecar", bench_goodput.POD_LOST]
DELAY = 2.0
MTBF = 5.0


def _marks(pod: Path) -> list[dict]:
    return [json.loads(ln) for ln in (pod / "marks.jsonl").read_text().splitlines() if ln.endswith("}")]


def test_smallest_run_accounts_for_every_second_and_step(maxtext_python, tmp_path, ramdisk):
    seed = next(s for s in range(200) if {f.cls for f in bench_goodput.schedule(s, MTBF, FAULTS, 1e4)[:4]} == set(FAULTS)
                and bench_goodput.schedule(s, MTBF, FAULTS, 1e4)[0].cls != "kill_sidecar")
    out = tmp_path / "goodput.json"
    work = ramdisk / "work"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_goodput.py"), "--model", "small", "--steps", "200",
                        "--mtbf", str(MTBF), "--seed", str(seed), "--faults", ",".join(FAULTS), "--max-failures", "4",
                        "--contenders", "mtc,orbax-supervised", "--mtc-cost", "blocked", "--restart-delay", str(DELAY),
                        "--workdir", str(work), "--json", str(out),
                        "--timeline", str(tmp_path / "goodput.png")], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bit for bit" in r.stdout and "failures at their drawn times" in r.stdout, r.stdout[-3000:]
    doc = json.loads(out.read_text())
    accs = {a["name"]: a for a in doc["contenders"]}
    assert set(accs) == {"mtc", "orbax-supervised"}
    for name, acc in accs.items():
        assert acc["final_equal"] and acc["metrics_equal"], acc
        assert acc["supervised"]
        # No process ends that the schedule did not end: a sidecar killed costs failed saves, a slice
        # lost a restore that waits for it, never a crash.
        assert not [e for e in acc["events"] if "by itself" in e["what"]], (name, acc["events"])
        ended = [k for k in acc["strikes"] if k["ended"]]
        assert [rec["cls"].removesuffix(" (cut)") for rec in acc["recoveries"]] == [k["cls"] for k in ended], \
            (name, acc["recoveries"], acc["strikes"])
        for rec, k in zip(acc["recoveries"], ended):
            st = rec["stages"]
            assert rec["failed_at"] == k["t"]
            parts = [v for n, v in st.items() if n != "total" and v is not None]
            assert all(p >= 0 for p in parts) and abs(sum(parts) - st["total"]) < 1e-6, (name, rec)
            if rec["cut"]:  # the next end cut it: it lasted until then
                nxt = min(x["t"] for x in ended if x["t"] > k["t"])
                assert abs(st["total"] - (nxt - rec["failed_at"])) < 1e-6, (name, rec)
                continue
            assert abs(st["total"] - (rec["first_step_at"] - rec["failed_at"])) < 1e-6, (name, rec)
            if k["cls"] == bench_goodput.POD_LOST:  # a new pod, after the delay
                assert rec["kind"] == "restart" and st["restart_delay"] >= DELAY, (name, rec)
            else:  # the supervisor's restart in the pod: the standby had imported everything
                assert rec["kind"] == "in-pod" and st["start_imports"] < 0.5, (name, rec)
                if k["cls"] == "kill_head":  # at once, past what a standby still importing had left of it
                    assert st["restart_delay"] < DELAY + rec["standby_warming_s"], (name, rec)
                    assert rec["standby_warming_s"] <= st["restart_delay"], (name, rec)
                else:  # once the lost slice is back: nothing trains without it
                    assert st["restart_delay"] >= DELAY, (name, rec)
            restored = re.search(r"(?:restored step|directory step) (\d+)", next(iter(rec["restore"].values()), ""))
            if restored:
                assert rec["resumed_at"] == int(restored.group(1)) + 1, (name, rec)
            else:
                assert rec["resumed_at"] == 0, (name, rec)
        # Steps recomputed: the steps that more than one process trained, from the marks themselves.
        trained: list[int] = []
        restored_steps: set[int] = set()
        for pod in sorted((work / name).glob("pod*")):
            by_pid: dict[int, set[int]] = {}
            for m in _marks(pod):
                if m["mark"] == "step":
                    by_pid.setdefault(m["pid"], set()).add(m["step"])
                elif m["mark"] in ("mtc_restored", "maxtext_restored"):
                    restored_steps.add(int(re.search(r"(?:restored step|directory step) (\d+)", m["line"]).group(1)))
            for steps in by_pid.values():
                trained += sorted(steps)
        assert acc["recomputed"] == len(trained) - len(set(trained)), (name, acc["recomputed"])
        # Every step was trained. MaxText logs a step's "completed step" line one step later (its metric
        # logger holds one step back), so a process killed after saving step N and before training N + 1
        # never logs N: the restore of N that follows is what shows N was trained. Only such a step may
        # go unmarked.
        unmarked = set(range(200)) - set(trained)
        assert unmarked <= restored_steps, (name, sorted(unmarked), sorted(restored_steps))
        assert set(trained) <= set(range(200))
        assert 0 < acc["ratio"] < 1 and acc["wall_s"] > acc["ideal_s"]
    mtc = accs["mtc"]
    assert {k["cls"] for k in mtc["strikes"]} == set(FAULTS)
    assert any(e["what"].startswith("kill -9 sidecar") for e in mtc["events"]), mtc["events"]
    assert any(rec["kind"] == "in-pod" and not rec["cut"] for rec in mtc["recoveries"]), mtc["recoveries"]
    assert (tmp_path / "goodput.png").stat().st_size > 0
