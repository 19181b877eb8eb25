"""The README's first command: the demo goes through every fault and recovers bit for bit."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

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
    recovered = [line for line in r.stdout.splitlines() if "recovered:" in line]
    assert len(recovered) == 5 and all(re.search(r"training goes on from step \d+$", line) for line in recovered), \
        r.stdout  # not a pipe's 120 columns cutting the sentence
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 300 and img.shape[1] > 800 and png.stat().st_size > 20_000
    assert sorted(p.name for p in work.iterdir()) == []  # no ramdisk or backup folder left behind
    # A second run in the same work directory, with the head's metrics on MTC_METRICS_PORT: read while it runs.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    again = subprocess.Popen([sys.executable, "-m", "mtc.head.tools.cli", "demo", "--quick", "--workdir", str(work),
                              "--timeline", str(png)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "MTC_METRICS_PORT": str(port)})
    scraped = ""
    deadline = time.monotonic() + 300
    saved = re.compile(r"^mtc_saves_total [1-9]", re.M)  # a save committed, as the head counts it
    while again.poll() is None and time.monotonic() < deadline and not saved.search(scraped):
        try:
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            pass
        time.sleep(0.2)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and '"bitwise_equal": true' in out, err[-3000:]
    assert saved.search(scraped), scraped[-2000:]
    assert f"curl -s localhost:{port}/metrics" in out


def test_demo_keep_and_bad_options(tmp_path):
    work = tmp_path / "w"
    r = _demo(work, tmp_path / "t.png", "--keep")
    assert r.returncode == 0
    assert (work / "cluster").is_dir() and (work / "backup").is_dir()
    # The hints run as written, in a shell where only README's install put mtc (not on PATH).
    hint = next(line for line in r.stdout.splitlines() if " status --local-checkpoint-directory" in line)
    shown = subprocess.run(hint, shell=True, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PATH": os.defpath})
    assert shown.returncode == 0 and "restore would choose: step" in shown.stdout, hint + shown.stderr[-2000:]
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
