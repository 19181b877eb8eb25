"""Ramdisk sizing (the guide's rule of thumb) and the `mtc` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtc.head.tools.cli.main import build_parser, main
from mtc.shared.errors import ConfigError
from mtc.shared.sizing import GIB, MIB, format_bytes, ramdisk_size

pytestmark = pytest.mark.unit


def test_guide_example_70b_on_32_hosts():
    s = ramdisk_size(70e9, 32, buffer=0.15)
    assert s.checkpoint_bytes == 840e9  # "840 GB"
    assert s.shard_bytes == 26.25e9  # "26.25 GB per host"
    assert s.kept_bytes == 52.5e9  # "52.50 GB per host"
    # The guide says "≈ 60.3 GB"; 52.5 x 1.15 is exactly 60.375 GB.
    assert s.required_bytes == 60_375_000_000
    # Rounded up to whole GiB: 56.2 GiB -> 57Gi.
    assert s.size_limit == "57Gi"
    assert s.size_limit_bytes == 57 * GIB
    assert s.required_bytes <= s.size_limit_bytes < s.required_bytes + GIB


def test_buffer_is_exact_decimal_not_binary_float():
    # 0.15 as a binary float is slightly below 0.15; a naive ceil could be off by one byte.
    assert ramdisk_size(70e9, 32, buffer=0.15).required_bytes == 60_375_000_000
    assert ramdisk_size(1e9, 1, buffer=0.1).required_bytes == 26_400_000_000


def test_options_change_each_step():
    s = ramdisk_size(1_000_000_000, 4, buffer=0, bytes_per_param=2, steps_kept=3)
    assert (s.checkpoint_bytes, s.shard_bytes, s.kept_bytes, s.required_bytes) == \
        (2e9, 0.5e9, 1.5e9, 1_500_000_000)


def test_uneven_split_rounds_up():
    s = ramdisk_size(1, 3, buffer=0, bytes_per_param=1, steps_kept=1)
    assert s.required_bytes == 1  # 1/3 of a byte still needs a byte


def test_small_sizes_use_mebibytes():
    s = ramdisk_size(1e6, 1)
    assert s.required_bytes == 27_600_000
    assert s.size_limit == "27Mi"
    assert s.size_limit_bytes == 27 * MIB >= s.required_bytes


def test_explain_lists_the_steps():
    lines = ramdisk_size(70e9, 32).explain()
    assert len(lines) == 4
    text = "\n".join(lines)
    for part in ("70,000,000,000 params x 12 bytes = 840 GB", "840 GB / 32 hosts = 26.25 GB",
                 "26.25 GB x 2 = 52.5 GB", "52.5 GB x 1.15 = 60.38 GB", "15%"):
        assert part in text


@pytest.mark.parametrize("kwargs, name", [
    (dict(params=0, hosts=32), "params"),
    (dict(params=-1, hosts=32), "params"),
    (dict(params=float("nan"), hosts=32), "params"),
    (dict(params=float("inf"), hosts=32), "params"),
    (dict(params=70e9, hosts=0), "hosts"),
    (dict(params=70e9, hosts=1.5), "hosts"),
    (dict(params=70e9, hosts=True), "hosts"),
    (dict(params=70e9, hosts=32, buffer=-0.1), "buffer"),
    (dict(params=70e9, hosts=32, buffer=1.5), "buffer"),
    (dict(params=70e9, hosts=32, bytes_per_param=0), "bytes_per_param"),
    (dict(params=70e9, hosts=32, steps_kept=0), "steps_kept"),
])
def test_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        ramdisk_size(**kwargs)


@pytest.mark.parametrize("n, text", [
    (840e9, "840 GB"), (26.25e9, "26.25 GB"), (52.5e9, "52.5 GB"), (60.375e9, "60.38 GB"),
    (12e12, "12 TB"), (27.6e6, "27.6 MB"), (512, "512 B"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# ------------------------------------------------------------------ CLI


def test_cli_size_prints_the_steps(capsys):
    assert main(["size", "--params", "70e9", "--hosts", "32"]) == 0
    out = capsys.readouterr().out
    for part in ("840 GB", "26.25 GB", "52.5 GB", "60.38 GB", "60,375,000,000 bytes",
                 "sizeLimit: 57Gi", "x 2 steps kept", "+ 15% buffer"):
        assert part in out


def test_cli_size_json(capsys):
    assert main(["size", "--params", "70B", "--hosts", "32", "--buffer", "0.15", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["params"] == 70e9
    assert d["required_bytes"] == 60_375_000_000
    assert d["size_limit"] == "57Gi"


def test_cli_size_options(capsys):
    assert main(["size", "--params", "1e9", "--hosts", "4", "--buffer", "0",
                 "--bytes-per-param", "2", "--steps-kept", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["required_bytes"] == 1_500_000_000


@pytest.mark.parametrize("argv, needle", [
    (["size", "--params", "0", "--hosts", "32"], "params"),
    (["size", "--params", "-5", "--hosts", "32"], "params"),
    (["size", "--params", "70e9", "--hosts", "0"], "hosts"),
    (["size", "--params", "70e9", "--hosts", "32", "--buffer", "1.5"], "buffer"),
    (["size", "--params", "70e9", "--hosts", "32", "--buffer", "-0.1"], "buffer"),
    (["size", "--params", "lots", "--hosts", "32"], "--params"),
    (["size", "--params", "70e9", "--hosts", "2.5"], "--hosts"),
    (["size", "--params", "70e9"], "--hosts"),
])
def test_cli_size_bad_input_exits_2(capsys, argv, needle):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err


def test_cli_without_command_exits_2(capsys):
    assert main([]) == 2
    assert "size" in capsys.readouterr().err


def test_cli_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


def test_demo_subcommand_options():
    args = build_parser().parse_args(["demo"])
    assert (args.steps, args.period, args.workdir, args.quick, args.keep) == (None, 2, None, False, False)
    assert args.timeline is None  # demo-out/timeline.png, or timeline-quick.png with --quick (mtc.head.tools.demo)
    args = build_parser().parse_args(
        ["demo", "--steps", "24", "--period", "3", "--workdir", "/tmp/x", "--quick", "--keep", "--timeline", "t.png"])
    assert (args.steps, args.period, args.workdir, args.quick, args.keep) == (24, 3, Path("/tmp/x"), True, True)
    assert args.timeline == Path("t.png")


def test_python_dash_m_cli():
    ok = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "size", "--params", "70e9",
                         "--hosts", "32"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "57Gi" in ok.stdout and "26.25 GB" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "size", "--params", "0",
                          "--hosts", "32"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "params" in bad.stderr


def test_cli_size_checks_a_ramdisk_that_is_too_small(tmpfs16, capsys):
    # 1e6 params x 12 B / 1 host x 2 steps x 1.15 = 27.6 MB: more than the 16 MiB tmpfs
    assert main(["size", "--params", "1e6", "--hosts", "1", "--ramdisk", str(tmpfs16 / "job")]) == 1
    out, err = capsys.readouterr()
    assert f"Ramdisk {tmpfs16 / 'job'}: tmpfs at {tmpfs16}, huge=never" in out
    assert "mount -o remount,huge=within_size" in out
    assert "is too small: 27.6 MB needed per host" in err and "raise the tmpfs size=" in err


def test_cli_size_checks_a_ramdisk_that_fits(huge_tmpfs, capsys):
    assert main(["size", "--params", "1e6", "--hosts", "4", "--ramdisk", str(huge_tmpfs), "--json"]) == 0
    check = json.loads(capsys.readouterr().out)["ramdisk"]
    assert check["fstype"] == "tmpfs" and check["huge"] == "within_size" and check["fits"]
    assert check["advice"] is None and check["total_bytes"] == 2 * GIB


def test_peer_copies_a_host_keeps_are_sized_too(capsys):
    # One slice, replication_factor=2: each host also keeps a copy of a peer's shard per step.
    s = ramdisk_size(70e9, 32, buffer=0.15, peer_copies=1)
    assert s.kept_bytes == 105e9 and s.required_bytes == 120_750_000_000 and s.peer_copies == 1
    assert ramdisk_size(70e9, 32, peer_copies=0).required_bytes == 60_375_000_000  # the guide's rule
    assert main(["size", "--params", "70e9", "--hosts", "32", "--peer-copies", "1"]) == 0
    out = capsys.readouterr().out
    assert "x 2 steps x (1 + 1 peer copy)  26.25 GB x 2 x 2 = 105 GB" in out and "113Gi" in out
    assert main(["size", "--params", "70e9", "--hosts", "32", "--peer-copies", "-1"]) == 2
    assert "peer_copies=-1 must be a whole number >= 0" in capsys.readouterr().err
