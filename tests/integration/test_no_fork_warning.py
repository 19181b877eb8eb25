"""Starting a server from this threaded (JAX) process does not fork it with a Python preexec_fn,
which JAX warns may deadlock (it used to print 12 such warnings per test run)."""

from __future__ import annotations

import warnings

import jax
import pytest

from gcs_emulators import FAKE_GCS, EmulatorServer

pytestmark = pytest.mark.integration


def test_emulator_start_forks_no_threaded_python(tmp_path):
    jax.devices()  # JAX's threads are up, as in every test session
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server = EmulatorServer(FAKE_GCS, tmp_path).start()
        try:
            assert server.proc.poll() is None
        finally:
            server.stop()
    forks = [w for w in caught if "fork" in str(w.message)]
    assert not forks, [str(w.message) for w in forks]
