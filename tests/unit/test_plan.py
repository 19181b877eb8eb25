"""`mtc plan`: Young/Daly intervals and goodput, against values computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mtc.head.tools.cli.main import main
from mtc.head.tools.plan import Costs, plan
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit


def test_two_tiers_by_hand():
    c = Costs(local_blocked_s=1, local_write_s=2, backup_s=50, restore_ram_s=10, restore_peer_s=20,
              restore_backup_s=100)
    p = plan(c, mtbf_s=3600, backup_fraction=0.5, peer_fraction=0.5, backup_overhead=0.1)
    # local: M = 3600 / 0.5 = 7200 s; tau = sqrt(2 * 1 * 7200) = 120 s; r = 0.5*10 + 0.5*20 = 15 s
    assert p.local.interval_s == pytest.approx(120.0)
    assert p.local.saving == pytest.approx(1 / 120) and p.local.failures == pytest.approx((60 + 15) / 7200)
    # backup: M = 7200 s; it costs training 0.1 x 50 = 5 s; tau = max(50, sqrt(2 * 5 * 7200)) = 268.33 s
    assert p.backup.interval_s == pytest.approx(math.sqrt(72000))
    assert p.backup.saving == pytest.approx(5 / math.sqrt(72000))
    assert p.backup.failures == pytest.approx((math.sqrt(72000) / 2 + 100) / 7200)
    # goodput = (1 - failures' share) / (1 + checkpoints' share)
    assert p.goodput == pytest.approx((1 - 75 / 7200 - (134.1641 + 100) / 7200) / (1 + 1 / 120 + 5 / 268.3282),
                                      abs=1e-6)
    # backup-only: every failure (M = 3600) restores from the bucket; cost 1 + 5 s; tau = sqrt(2*6*3600) = 207.8
    assert p.backup_only_interval_s == pytest.approx(math.sqrt(43200))
    assert p.backup_only_goodput == pytest.approx(
        (1 - (math.sqrt(43200) / 2 + 100) / 3600) / (1 + 6 / math.sqrt(43200)))
    # blocking: local tau = sqrt(2 * 2 * 7200) = 169.7; backup tau = 848.5 and it costs 50 s of training each
    assert p.blocking_local_interval_s == pytest.approx(math.sqrt(28800))
    assert p.blocking_goodput == pytest.approx(
        (1 - (math.sqrt(28800) / 2 + 15) / 7200 - (math.sqrt(720000) / 2 + 100) / 7200)
        / (1 + 2 / math.sqrt(28800) + 50 / math.sqrt(720000)))
    # to first order, the tiers' waste: the two differ by about C x (F + C), 0.2 points here
    first_order = 1 - p.local.waste - p.backup.waste
    assert 0 < p.goodput - first_order < 2.5e-3
    assert p.goodput > p.blocking_goodput and p.goodput > p.backup_only_goodput


def test_a_write_longer_than_youngs_interval_bounds_it():
    c = Costs(local_blocked_s=0.01, local_write_s=30, backup_s=600, restore_ram_s=1, restore_peer_s=2,
              restore_backup_s=60)
    p = plan(c, mtbf_s=36000, backup_fraction=0.0, peer_fraction=0.0)
    # sqrt(2 * 0.01 * 36000) = 26.8 s < 30 s: the next save cannot start before the last one is written
    assert p.local.interval_s == pytest.approx(30.0)
    assert p.local.waste == pytest.approx(0.01 / 30 + (15 + 1) / 36000)
    assert p.goodput == pytest.approx((1 - (15 + 1) / 36000) / (1 + 0.01 / 30))
    assert math.isinf(p.backup.interval_s) and p.backup.waste == 0  # no failure needs the backup


@pytest.mark.parametrize("kw,msg", [({"mtbf_s": 0}, "--mtbf"), ({"mtbf_s": -5}, "--mtbf"),
                                    ({"mtbf_s": 10, "backup_fraction": 2}, "--backup-fraction")])
def test_bad_input(kw, msg):
    c = Costs(1, 2, 3, 4, 5, 6)
    with pytest.raises(ConfigError, match=msg):
        plan(c, **kw)


def test_cli_needs_costs_or_measure(capsys):
    assert main(["plan", "--params", "70e9", "--hosts", "32", "--slices", "2", "--mtbf", "1h"]) == 2
    assert "--measure" in capsys.readouterr().err
    assert main(["plan", "--params", "70e9", "--hosts", "32", "--slices", "2", "--mtbf", "0",
                 "--rates", "10,2,0.2,3.5,2,0.3"]) == 2
    assert "--mtbf" in capsys.readouterr().err


def test_cli_seed_example(capsys):
    assert main(["plan", "--params", "70e9", "--hosts", "32", "--slices", "2", "--mtbf", "1h",
                 "--rates", "10,2,0.2,3.5,2,0.3", "--step-time", "2"]) == 0
    out = capsys.readouterr().out
    assert "local_checkpoint_period=" in out and "multi_tier_checkpointing_backup_interval_minutes=" in out
    assert "goodput" in out and "backup only" in out and "blocking saves" in out


def test_an_mtbf_too_short_for_any_progress_is_refused(capsys):
    from mtc.head.tools.cli.main import main

    assert main(["plan", "--params", "8e9", "--hosts", "8", "--mtbf", "1s", "--costs", "1,2,30,5,10,60"]) == 2
    err = capsys.readouterr().err
    assert "makes no progress" in err and "%" not in err and len(err.strip().splitlines()) == 1, err


def test_advice_with_local_checkpoints_rarer_than_backups_says_so(capsys):
    from mtc.head.tools.cli.main import main

    assert main(["plan", "--params", "8e9", "--hosts", "8", "--mtbf", "1h", "--costs", "30,32,10,5,10,60"]) == 0
    assert "local checkpoints would be rarer" in capsys.readouterr().err


def test_a_restart_cost_lowers_every_goodput_by_about_its_share_of_the_mtbf_and_moves_no_interval():
    base = Costs(local_blocked_s=0.1, local_write_s=1, backup_s=30, restore_ram_s=2, restore_peer_s=4,
                 restore_backup_s=40)
    p0 = plan(base, mtbf_s=3600)
    p1 = plan(dataclasses.replace(base, restart_s=36), mtbf_s=3600)
    assert p1.local.interval_s == p0.local.interval_s and p1.backup.interval_s == p0.backup.interval_s
    # 36 s a failure, one an hour: 1 % more of the wall time lost, of which the checkpoints' share trained
    saving = p1.local.saving + p1.backup.saving
    assert p1.goodput == pytest.approx((1 - p1.local.failures - p1.backup.failures - 0.01) / (1 + saving))
    for name in ("goodput", "backup_only_goodput", "blocking_goodput"):
        assert 0.0095 < getattr(p0, name) - getattr(p1, name) <= 0.01, name


def test_readme_plan_transcript_is_what_the_command_prints(capsys):
    """README shows `mtc plan`'s output for the guide's example: it must be what the command prints now."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```\n\$ (mtc plan [^\n]+)\n(.*?)```", readme, re.S)
    assert block, "README lost its mtc plan transcript"
    assert main(block.group(1).split()[1:]) == 0
    assert capsys.readouterr().out == block.group(2)
