"""More of what a new user tripped over, each pinned: one line that names the thing and the fix, no traceback."""

from __future__ import annotations

import pytest

from mtc.head.tools.cli import main

pytestmark = pytest.mark.unit

PLAN = ["plan", "--hosts", "4", "--mtbf", "1h", "--costs", "1,2,3,4,5,6"]


def one_line(err: str) -> bool:
    return "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra,says", [
    (["--params", "nan"], "--params"), (["--params", "inf"], "--params"),
    (["--params", "1e9", "--step-time", "nan"], "--step-time"),
    (["--params", "1e9", "--bytes-per-param", "nan"], "--bytes-per-param"),
    (["--params", "1e9", "--bytes-per-param", "-1"], "--bytes-per-param"),
])
def test_plan_with_a_number_that_is_not_finite_or_positive(capsys, extra, says):
    assert main([*PLAN, *extra]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and says in err and "positive, finite" in err, err


def test_plan_with_a_cost_that_is_not_a_number(capsys):
    assert main(["plan", "--hosts", "4", "--mtbf", "1h", "--params", "1e9", "--costs", "1,2,3,4,5,x"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--costs" in err, err


def test_tls_generate_into_a_file_or_an_unwritable_place(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    assert main(["tls", "generate", str(f)]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "is not a folder" in err, err
    assert f.read_text() == "keep me"
    assert main(["tls", "generate", "/proc/nope"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "/proc/nope" in err and "choose a folder" in err, err


def test_tls_generate_days_is_bounded(capsys, tmp_path):
    assert main(["tls", "generate", str(tmp_path / "t"), "--days", "1000000"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--days" in err and "3650" in err, err
    assert not (tmp_path / "t").exists()
