"""The backup root a head sends its hosts: a local one absolute, since a sidecar refuses a relative
root (it would name a folder under the sidecar's own working directory)."""

from __future__ import annotations

import os

import pytest

from mtc.head import MTCConfig
from mtc.shared.host_settings import HostSettings
from mtc.shared.errors import ProtocolError
from mtc.sidecar import ops

pytestmark = pytest.mark.unit


def test_a_relative_local_root_is_sent_absolute_and_urls_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = dict(local_checkpoint_directory=str(tmp_path / "ram"), run_name="r")
    sent = HostSettings.from_config(MTCConfig(base_output_directory="out", **local)).backup_url
    assert sent == os.path.join(str(tmp_path), "out", "r", "mtc")
    assert ops.root_arg(sent, "configure") == sent
    for url in ("gs://bucket/ckpt", "file:///data/ckpt"):
        assert HostSettings.from_config(MTCConfig(base_output_directory=url, **local)).backup_url.startswith(url)
    with pytest.raises(ProtocolError, match="is not absolute"):
        ops.root_arg("out/r/mtc", "configure")
