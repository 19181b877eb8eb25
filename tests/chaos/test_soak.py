"""The soak's short variant (CI): fixed seeds, both topologies, both backup backends, every fault class;
and one of only the packet loss and latency classes (they need nftables: skipped without the nft command).

It fails on any violated invariant (``soak.Violation``, with the schedule up to it in the output);
the long run is ``python -m tests.chaos.soak --minutes 30`` (README, "Soak").
"""

from __future__ import annotations

import os
import shutil

import pytest

import soak

pytestmark = pytest.mark.chaos

# (seed, topology, backend, trials): enough trials that every class the segment can inject is drawn.
RUNS = [(11, (2, 2), "gcs", 26), (12, (1, 4), "local", 24)]


@pytest.mark.parametrize("seed,topology,backend,trials", RUNS, ids=[f"{t[0]}x{t[1]}-{b}" for _, t, b, _ in RUNS])
def test_soak_short(seed, topology, backend, trials, monkeypatch, capsys):
    monkeypatch.setenv("MTC_SOAK_LISTING_DEADLINE_S", "3")
    run = soak.run_soak(seed, trials=trials, trials_per_segment=trials, segments=[(topology, backend)])
    drawn = {c for c, st in run.stats.items() if st.injected or st.inject_failed}
    can = run.could_draw  # every class, less the bucket's with a directory, ramdisk_full/net_cut without root
    assert can >= set(soak.FAULT_CLASSES) - soak.GCS_ONLY - {"ramdisk_full"} - soak.NET_CLASSES
    assert drawn == can, f"classes not drawn: {sorted(can - drawn)}"
    for c, st in run.stats.items():
        assert st.survived == st.injected + st.inject_failed and st.wrong == 0 and st.lost == 0, (c, st)
    assert sum(st.restores for st in run.stats.values()) >= trials


def test_soak_packet_loss_and_latency(monkeypatch):
    """Only the two classes that need nftables, on both topologies: every restore bit for bit, no step lost."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2: the hosts are network namespaces")
    if not shutil.which("nft"):
        pytest.skip("needs nftables (the nft command: apt-get install nftables) for net_loss and net_latency")
    monkeypatch.setenv("MTC_SOAK_LISTING_DEADLINE_S", "3")
    new = ["net_loss", "net_latency"]
    run = soak.run_soak(13, trials=8, trials_per_segment=4, segments=[((2, 2), "local"), ((1, 4), "local")],
                        only=new)
    assert run.could_draw == set(new)
    for c in new:
        st = run.stats[c]
        assert (st.injected, st.inject_failed, st.survived, st.wrong, st.lost) == (4, 0, 4, 0, 0), (c, st)
