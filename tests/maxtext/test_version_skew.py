"""Version skew between two real environments: this one (the tests' Python and jax) and the
MaxText environment (another Python, another jax/jaxlib, the same mtc source).

A sidecar daemon started from the other environment is refused by a head from this one before
any byte moves, with the table of what differs; a colocated fingerprint produced by the other
environment is refused the same way.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time

import jax
import numpy as np
import pytest


from mtc.head import CheckpointManager, MTCConfig
from mtc.shared import protocol, version
from mtc.shared.config import ENV_TOKEN
from mtc.shared.errors import VersionMismatchError

pytestmark = [pytest.mark.maxtext, pytest.mark.integration]


def _other_fingerprint(py: str) -> dict:
    out = subprocess.run([py, "-c", "import json; from mtc.shared.version import fingerprint; "
                                    "print(json.dumps(fingerprint()))"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_two_environments_really_differ(maxtext_python):
    mine, other = version.fingerprint(), _other_fingerprint(maxtext_python)
    differ = {pkg for pkg, _, _ in version.mismatches(mine, other)}
    assert {"jax", "jaxlib", "python"} <= differ, differ
    assert mine["mtc"] == other["mtc"]  # the same mtc source in both


def test_colocated_fingerprint_from_the_other_environment_is_refused(maxtext_python):
    other = _other_fingerprint(maxtext_python)
    with pytest.raises(VersionMismatchError) as info:
        version.check_fingerprints(version.fingerprint(), {"s0-h0": other})
    msg = str(info.value)
    assert f"jax: head {jax.__version__}, sidecar {other['jax']} (host s0-h0)" in msg
    assert "images/build.py" in msg


def test_a_daemon_from_the_other_environment_is_refused_before_any_byte_moves(maxtext_python, tmp_path):
    root, ready = tmp_path / "ram", tmp_path / "ready.json"
    token = secrets.token_hex(32)  # the job's token: the daemon authenticates the head before the version check
    proc = subprocess.Popen([maxtext_python, "-m", "mtc.sidecar", "serve", "--root", str(root), "--host-id", "s0-h0",
                             "--ready-file", str(ready), "--log-file", str(tmp_path / "daemon.log")],
                            env={**os.environ, ENV_TOKEN: token})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        spec = tmp_path / "cluster.json"
        protocol.ClusterSpec((protocol.HostSpec("s0-h0", 0, json.loads(ready.read_text())["address"],
                                                len(jax.devices())),)).write(spec)
        cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(spec), local_checkpoint_period=1,
                        prefetch_on_start=False, peer_token=token)
        with CheckpointManager(cfg) as m:
            with pytest.raises(VersionMismatchError) as info:
                m.save(1, {"w": jax.numpy.asarray(np.arange(64, dtype=np.float32))})
        msg = str(info.value)
        assert "jax: head" in msg and "jaxlib: head" in msg and "python: head" in msg and "(host s0-h0)" in msg
        blobs = root / "mtc" / "blobs"
        assert not blobs.exists() or not [p for p in blobs.iterdir() if not p.name.startswith(".")]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
