"""`mtc plan --measure`: mtc measured on this machine (a real save, restore and backup through the
manager, on tmpfs), twice, gives the same advice."""

from __future__ import annotations


def test_measure_gives_the_same_advice_twice(capsys):
    """The device-to-host figure is measured in steady state (the train step done, warm ramdisk files)
    until it is stable: three runs gave periods of 300, 585 and 662 before."""
    from mtc.head.tools.cli.main import main

    periods = []
    for _ in range(2):
        assert main(["plan", "--params", "8e9", "--hosts", "8", "--mtbf", "1h", "--measure"]) == 0
        out = capsys.readouterr().out
        periods.append(int(out.split("local_checkpoint_period=")[1].split()[0]))
    # Within 1.4x on a quiet machine; under the test run's other worker (a MaxText run beside it) the least
    # blocked time of a save still moves: 82 and 131 once (the period goes with its square root).
    assert max(periods) <= 2.0 * min(periods), periods
