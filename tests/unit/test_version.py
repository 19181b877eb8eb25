"""Version pinning: a mismatch between head and sidecar is refused, listing each one."""

from __future__ import annotations

import pytest

from mtc.shared import version
from mtc.shared.errors import VersionMismatchError

pytestmark = pytest.mark.unit


def test_same_fingerprint_passes():
    fp = version.fingerprint()
    version.check_fingerprints(fp, {"h0": dict(fp, host="h0"), "h1": dict(fp)})
    assert fp["jax"] and fp["jaxlib"] and fp["python"].count(".") == 1


def test_every_mismatch_is_listed_with_host():
    head = version.fingerprint()
    other = dict(head, jax="0.0.1", jaxlib="0.0.1", python="2.7", numpy="1.0.0")
    patch_only = dict(head, numpy=(head["numpy"] or "1.0") + ".99")  # same major.minor: compatible
    with pytest.raises(VersionMismatchError) as e:
        version.check_fingerprints(head, {"s0-h0": head, "s1-h1": other, "s1-h2": patch_only})
    msg = str(e.value)
    for pkg in ("jax:", "jaxlib:", "python:", "numpy:"):
        assert pkg in msg
    assert "(host s1-h1)" in msg and "s1-h2" not in msg and "s0-h0" not in msg
    assert f"head {head['jax']}, sidecar 0.0.1" in msg
    assert "same lock file" in msg
