"""``mtc status``'s table in a narrow terminal: a backup name is copied from it into `mtc restore-version
set`, so it is never cut (it was printed as ``…-step-000000…`` at 80 columns)."""

from __future__ import annotations

import io

from rich.console import Console

from mtc.head.tools.cli.status import Status, StepRow, render
from mtc.shared import backup_layout


def test_backup_names_are_whole_in_an_80_column_terminal():
    names = {s: [backup_layout.backup_name(s), backup_layout.backup_name(s)] for s in (4, 6)}
    rows = [StepRow(s, [f"s{i // 2}-h{i % 2}" for i in range(4)], [], 2, True, names[s], True,
                    why_not="blob 0123456789ab.. corrupt on s0-h1; more words to fill the notes column") for s in names]
    st = Status(hosts=["s0-h0", "s0-h1", "s1-h0", "s1-h1"], unreachable={}, steps=rows, backup_root="/b/run/mtc",
                backups=[], restore_version=None, choice=6, reason="step 6: newest whole step")
    out = io.StringIO()
    render(st, Console(file=out, width=80, record=False, color_system=None))
    text = out.getvalue()
    for bs in names.values():
        for name in bs:
            assert name in text, f"{name} is cut in:\n{text}"
    assert "…" not in text
