"""The README's first command: the demo goes through every fault and recovers bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _demo(workdir, timeline, *extra):
    return subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "demo", "--quick", "--workdir", str(workdir),
                           "--timeline", str(timeline), *extra], capture_output=True, text=True, timeout=300)


def test_demo_shows_every_tier_and_recovers_bit_for_bit(tmp_path):
    work, png = tmp_path / "work", tmp_path / "out" / "timeline.png"
    r = _demo(work, png)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    assert result["bitwise_equal"] is True and result["recoveries"] == 5
    assert result["tiers"] == ["backup", "peer", "ram"]  # every tier served a restore
    for text in ("killed mid-save", "host replaced", "slice lost", "slice back", "every ramdisk lost",
                 "final parameters equal the uninterrupted run bit for bit"):
        assert text in r.stdout, text
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 300 and img.shape[1] > 800 and png.stat().st_size > 20_000
    assert sorted(p.name for p in work.iterdir()) == []  # no ramdisk or backup folder left behind
    again = _demo(work, png)  # a second run in the same work directory
    assert again.returncode == 0 and '"bitwise_equal": true' in again.stdout, again.stderr[-3000:]


def test_demo_keep_and_bad_options(tmp_path):
    work = tmp_path / "w"
    r = _demo(work, tmp_path / "t.png", "--keep")
    assert r.returncode == 0
    assert (work / "cluster").is_dir() and (work / "backup").is_dir()
    import glob
    import tempfile

    tmp_root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    before = set(glob.glob(os.path.join(tmp_root, "mtc-demo-*")))
    bad = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "demo", "--steps", "5"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--steps >= 16" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert set(glob.glob(os.path.join(tmp_root, "mtc-demo-*"))) == before  # no empty folder left
    proc = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "demo", "--workdir", "/proc/nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--workdir /proc/nope" in proc.stderr and "Traceback" not in proc.stderr
