"""A failed injection is an outcome of its trial, recorded in the soak's table, never the end of the run.

Found under load: the soak crashed inside its own fault injection, ``fault_ramdisk_full``, when opening
the filler file raised ENOSPC. Here the soak runs one trial of that class on real tmpfs ramdisks that
are already full when the filler is created (no inode left: a real remount of each host's tmpfs), with
real daemons and a real head; the trial must record the failed injection and still check the
invariants (a restore bit for bit, the next save) as after any trial.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import soak

pytestmark = pytest.mark.chaos


def _remount(d: Path, nr_inodes: int) -> None:
    r = subprocess.run(["mount", "-o", f"remount,nr_inodes={nr_inodes}", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"remount {d} with nr_inodes={nr_inodes}: {r.stderr.strip()}")


def _no_inode_left(d: Path) -> int:
    """Let the tmpfs at ``d`` hold no more files than it holds now; returns its inode limit before."""
    for _ in range(20):  # a daemon may create a file between the count and the remount
        st = os.statvfs(d)
        try:
            _remount(d, st.f_files - st.f_ffree)
            return st.f_files
        except OSError:
            continue
    raise OSError(f"could not fill {d}'s inodes")


def test_a_filler_that_cannot_be_created_on_a_full_ramdisk_is_recorded_not_a_crash(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root: the soak's ramdisks are tmpfs mounts")
    injected = soak.FAULTS["ramdisk_full"]
    seen: list[str] = []

    def on_full_ramdisks(s: soak.Soak, r, cls: str, d: dict) -> None:
        for op in ("wait", "wait_replication", "wait_backup"):  # nothing in flight while the disks are full
            s.head.call(op)
        limits = {h: _no_inode_left(s.cluster.ramdisk(h)) for h in s.live}
        try:
            with pytest.raises(OSError):  # the ramdisk really is full: no file can be created on it
                open(s.cluster.ramdisk(s.live[0]) / "probe", "wb").close()
            injected(s, r, cls, d)
        except OSError as e:
            seen.append(str(e))
            raise
        finally:
            for h, n in limits.items():
                _remount(s.cluster.ramdisk(h), n)

    monkeypatch.setitem(soak.FAULTS, "ramdisk_full", on_full_ramdisks)
    lines: list[str] = []
    run = soak.run_soak(7, trials=1, trials_per_segment=1, segments=[((1, 4), "local")], only=["ramdisk_full"],
                        out=lines.append)

    assert seen and "No space left on device" in seen[0], seen  # the filler's open raised ENOSPC ...
    st = run.stats["ramdisk_full"]
    # ... and the run went on: the trial is recorded as a failed injection, its checks held.
    assert (st.injected, st.inject_failed, st.survived, st.restores) == (0, 1, 1, 1), st
    assert run.trial == 1
    (note,) = [n for n in run.notes if n.startswith("ramdisk_full: the injection failed")]
    assert "OSError" in note and "No space left on device" in note and "filler" in note, note
    assert "injection_failed" in run.schedule[-1] and "No space left on device" in run.schedule[-1]
    row = [r for r in run.summary_rows() if r[0] == "ramdisk_full"][0]
    assert dict(zip(soak.HEADER, row))["injection failed"] == "1"
    assert "| ramdisk_full | 0 | 1 | 1 | 1 | 0 | 0 |" in soak.format_table(run.summary_rows())
    assert not any(line.startswith("FAILED") for line in lines), lines
