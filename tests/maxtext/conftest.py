"""The MaxText environment's interpreter, built once per session (tests/maxtext/env.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import env as mx_env  # noqa: E402


@pytest.fixture(scope="session")
def maxtext_python():
    try:
        return str(mx_env.ensure())
    except mx_env.EnvUnavailable as e:
        pytest.skip(str(e))
