"""bench/bench_scale.py drives mtc's own format and commit code for synthetic topologies: a small
run must show what issue 15 asks of the control plane, head bytes per host per save constant in
the number of hosts (for a fixed per-host share). Bytes are counted, not timed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_head_bytes_per_host_do_not_grow_with_hosts():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_scale.py"), "--hosts", "8,64", "--layers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"^- \d+x the hosts: head bytes sent per host ([\d.]+)x, received per host ([\d.]+)x", proc.stdout,
                  re.M)
    assert m, proc.stdout
    sent, received = float(m.group(1)), float(m.group(2))
    assert 0.9 <= sent <= 1.1 and 0.9 <= received <= 1.1, proc.stdout
    # A restore onto the saving topology: what each host gets is constant, what the head reads per host
    # does not grow (the header line is O(arrays + hosts), shared by all).
    r = re.search(r"^- restore, \d+x the hosts: head bytes sent per host ([\d.]+)x, received per host ([\d.]+)x",
                  proc.stdout, re.M)
    assert r and 0.9 <= float(r.group(1)) <= 1.1 and float(r.group(2)) <= 1.1, proc.stdout
    # The design before sent every host the whole manifest: that would be ~8x here.
    before = re.search(r"head sends [\d,.]+ \w+ per save at 64 hosts, [\d,.]+ \w+ per host \((\d+)x\)", proc.stdout)
    assert before and int(before.group(1)) >= 4, proc.stdout
    # From the backup onto half as many slices, twice as wide: a host downloads the half of a writer's
    # part it loads, no more (before: the whole part, twice that).
    regroup = re.findall(r"^\| (\d+) \| \d+ -> \d+ \| [\d,]+ ms \| [\d,.]+ \w+ \| (\d+) \| ([\d,.]+) MiB \| ([\d,.]+) MiB "
                         r"\| ([\d,.]+) MiB \| ([\d.]+)x \|", proc.stdout, re.M)
    assert [int(h) for h, *_ in regroup] == [8, 64], proc.stdout
    for _, parts, before, now, least, ratio in regroup:
        assert int(parts) >= 1 and float(ratio) == 1.0 and now == least, proc.stdout
        assert float(before.replace(",", "")) >= 1.9 * float(now.replace(",", "")), proc.stdout
    # A lost host's blobs looked for in a backup: the head receives their names (32 bytes each), not the
    # backup's manifest.
    among = re.findall(r"^\| (\d+) \| ([\d,]+) \| [\d,]+ ms \| ([\d,]+) B \| ([\d,.]+) (KiB|MiB) \|", proc.stdout, re.M)
    assert [int(h) for h, *_ in among] == [8, 64], proc.stdout
    for _, asked, got, whole, unit in among:
        assert int(got.replace(",", "")) == 32 * int(asked.replace(",", "")), proc.stdout
        assert float(whole.replace(",", "")) * (1024 if unit == "KiB" else 2**20) > 4 * 32 * int(asked.replace(",", "")), proc.stdout
    # The backup scrub by parts: what the head sends a host is one backup's name and its own part, whatever
    # the hosts; a host hashes no more than its part's blobs.
    scrub = re.findall(r"^\| (\d+) \| [\d,]+ ms \| (\d+) B \| [\d,]+ ms \| ([\d,]+) \| [\d.]+ s \| ([\d,]+) \|", proc.stdout,
                       re.M)
    assert [int(h) for h, *_ in scrub] == [8, 64], proc.stdout
    assert all(int(sent) < 100 and 0 < int(mine.replace(",", "")) < int(blobs.replace(",", ""))
               for _, sent, mine, blobs in scrub), proc.stdout
