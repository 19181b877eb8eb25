"""``mtc export`` writes through orbax-checkpoint's private partial-save modules: it takes only the
versions it was tested with, and refuses others before anything is written, naming the fix."""

from __future__ import annotations

import pytest

from mtc.head.orbax import export


@pytest.mark.parametrize("version", ["0.12.8", "0.12.10", "0.12.99"])
def test_the_tested_orbax_versions_are_taken(version):
    assert export._orbax_version_problem(version) is None


@pytest.mark.parametrize("version", ["0.13.0", "1.0.0", "0.12.7", "0.11.40", "nightly"])
def test_other_orbax_versions_are_refused_with_the_fix(version):
    problem = export._orbax_version_problem(version)
    assert problem and f"this is {version}" in problem and "pip install 'orbax-checkpoint>=0.12.8,<0.13'" in problem
