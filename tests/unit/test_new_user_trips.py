"""What a new user tripped over, each pinned: the CLI says what is wrong and how to fix it."""

from __future__ import annotations

import pytest

from mtc.head.tools.cli.main import main

pytestmark = pytest.mark.unit


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mtc 0.")


def test_size_of_a_ramdisk_that_does_not_exist(capsys, tmp_path):
    assert main(["size", "--params", "70e9", "--hosts", "32", "--ramdisk", "/nonexistent-mtc-test/ramdisk"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "mount the ramdisk" in err and "fits" not in err


def test_size_with_a_negative_parameter_count(capsys):
    assert main(["size", "--params", "-70e9", "--hosts", "32"]) == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err and "params" in err, err


def test_restore_version_on_a_root_that_does_not_exist(capsys, tmp_path):
    assert main(["restore-version", "show", "--base-output-directory", str(tmp_path), "--run-name", "typo"]) == 1
    err = capsys.readouterr().err
    assert "does not exist or is empty" in err and "--run-name" in err


def test_restore_version_clear_when_nothing_is_pinned(capsys, tmp_path):
    root = tmp_path / "r" / "mtc"
    (root / "backups").mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "blobs" / "x").write_text("")
    assert main(["restore-version", "clear", "--backup-root", str(root)]) == 0
    assert "is not set" in capsys.readouterr().out


def test_restore_version_on_gcs_without_credentials_is_one_line(capsys, monkeypatch):
    pytest.importorskip("google.cloud.storage")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/credentials.json")
    rc = main(["restore-version", "show", "--backup-root", "gs://no-such-bucket-mtc/x"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "credentials" in err


@pytest.mark.parametrize("args,says", [
    (["--period", "0"], "--period 0"), (["--period", "-2"], "--period -2"), (["--steps", "3"], "--steps 3"),
    (["--timeline", "/proc/nope/x.png"], "cannot write in /proc/nope"),
    (["--timeline", "/tmp/timeline.svg"], "ending in .png"),
])
def test_demo_checks_its_arguments_before_it_runs(capsys, args, says):
    import glob

    before = set(glob.glob("/dev/shm/mtc-demo-*"))
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert set(glob.glob("/dev/shm/mtc-demo-*")) == before  # nothing left behind


def test_demo_keep_says_where_and_how_to_look(tmp_path):
    from mtc.head.tools.demo import kept_message

    for h in ("s0-h0", "s1-h0"):
        (tmp_path / "cluster" / h).mkdir(parents=True)
    text = kept_message(tmp_path)
    hosts = f"{tmp_path / 'cluster' / 's0-h0'} {tmp_path / 'cluster' / 's1-h0'}"
    assert f"mtc status --local-checkpoint-directory {hosts} --base-output-directory {tmp_path / 'backup'} " \
           "--run-name demo" in text
    assert "mtc restore-version show" in text and "run name demo" in text
    assert f"mtc verify --backup --local-checkpoint-directory {hosts} --base-output-directory" in text


def test_demo_timeline_draws_recoveries_narrow():
    from mtc.head.tools.demo_plot import _squeeze

    x = _squeeze([(10.0, 40.0, 4, ["ram"]), (50.0, 52.0, 8, ["peer"])], 1.0)
    assert x(5.0) == 5.0 and x(40.0) == 11.0 and x(45.0) == 16.0 and x(52.0) == 22.0 and x(60.0) == 30.0
    assert 10.0 < x(25.0) < 11.0


def test_restore_version_one_level_too_high_says_where_the_backups_are(capsys, tmp_path):
    root = tmp_path / "run" / "mtc"
    (root / "backups" / "20260101T000000Z-step-000000000004").mkdir(parents=True)
    (root / "backups" / "20260101T000000Z-step-000000000004" / "manifest.json").write_text("{}")
    assert main(["restore-version", "show", "--backup-root", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "holds no backups" in err and f"--backup-root {root}" in err and "(none)" not in err, err


def _timeline(faults_close: bool):
    """A demo timeline: 40 steps, five faults (two close together when ``faults_close``), recoveries."""
    from mtc.head.tools.demo import Timeline

    tl = Timeline()
    t, step, slices = 0.0, 0, 2
    faults = {8: "kill_mid_save", 14: "replace_host", 20: "lose_slice", 22 if faults_close else 27: "slice_back",
              34: "lose_all_ramdisks"}
    while step < 40:
        step += 1
        if step in faults:
            tl.faults.append((t, faults[step]))
            tl.recoveries.append((t, t + 2.5, step - 1, ["ram", "peer"] if step % 2 else ["ram"]))
            t += 2.5 + (3.0 if faults[step] in ("lose_slice", "slice_back") else 0.0)  # a new mesh compiles
            slices = 1 if faults[step] == "lose_slice" else 2 if faults[step] == "slice_back" else slices
        t += 0.3
        tl.steps.append((t, step, slices))
        if step % 2 == 0:
            tl.saves.append((t, step))
        if step % 6 == 0:
            tl.backups.append((t + 0.1, step))
    return tl


@pytest.mark.parametrize("faults_close", [False, True])
def test_demo_picture_labels_cover_no_other_label_and_no_step(tmp_path, faults_close):
    """Labels overlapped the dots and each other ("every ramdisk lost", "4.4 s"); the gap after a slice
    came or went was unexplained; the backups did not say how often they come."""
    from mtc.head.tools.demo import FAULT_SHORT
    from mtc.head.tools.demo_plot import plot, stalls

    tl = _timeline(faults_close)
    texts, boxes, points = plot(tl, tmp_path / "t.png", 40, FAULT_SHORT, backup_every=6)
    assert (tmp_path / "t.png").stat().st_size > 10_000 and len(texts) == 5 + 5
    for i, a in enumerate(boxes):
        for j, b in enumerate(boxes[:i]):
            assert not a.overlaps(b), f"{texts[i]!r} covers {texts[j]!r}"
        inside = [(px, py) for px, py in points if a.x0 <= px <= a.x1 and a.y0 <= py <= a.y1]
        assert not inside, f"{texts[i]!r} covers {len(inside)} training steps"
    assert len(stalls(tl)) == 2  # the slice lost and back: drawn and in the legend

