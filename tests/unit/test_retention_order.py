"""Retention and choice follow step order, never clocks (docs/architecture.md, "What must never happen")."""

from __future__ import annotations

import time

import pytest

from mtc.shared import backup_layout as layout
from mtc.shared import format as fmt
from mtc.sidecar.backup.tier import BackupTier
from mtc.sidecar.ram import RamStore

pytestmark = pytest.mark.unit

YEAR = 365 * 24 * 3600.0


def test_backups_are_ordered_by_step_then_by_time():
    now = time.time()
    names = [layout.backup_name(1, now + YEAR), layout.backup_name(2, now), layout.backup_name(3, now - YEAR),
             layout.backup_name(2, now + 60)]
    listing = [f"{layout.BACKUPS}{n}.json" for n in names]
    assert layout.names_from_listing(listing) == [names[2], names[3], names[1], names[0]]


def test_a_backup_made_while_a_clock_ran_a_year_ahead_is_not_kept_over_newer_steps(tmp_path):
    ram = RamStore(tmp_path / "ram")
    tier = BackupTier(str(tmp_path / "bucket"), ram, "h0")
    now = time.time()
    for step, when in ((1, now + YEAR), (2, now), (3, now + 5)):  # step 1's head had its clock a year ahead
        m = fmt.StepManifest(step=step, arrays=(), tree=None)
        tier.finalize(layout.backup_name(step, when), m.to_json(), max_to_keep=2)
    kept = tier.list_names()
    assert [layout.parse_backup_name(n) for n in kept] == [3, 2]  # the two newest steps, whatever the clocks
