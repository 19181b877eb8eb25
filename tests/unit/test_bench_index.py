"""bench/README.md maps each question to its script: every script in bench/ is in it, and every script
it names exists (15 scripts, of which README named 9, and nothing said which question each answers)."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_benchmark_is_in_the_index_and_the_index_names_no_missing_one():
    index = (BENCH / "README.md").read_text()
    named = set(re.findall(r"`([a-z_]+\.py)`", index))
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts - named == set(), f"scripts the index does not name: {sorted(scripts - named)}"
    assert named - scripts == set(), f"the index names scripts that do not exist: {sorted(named - scripts)}"
