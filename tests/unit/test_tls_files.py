"""TLS folders that must not be used (``mtc.shared.tls``): a private key others can read, files or
folders every user can change, a CA that is not a certificate. Each is refused by name with the
fix, by ``resolve`` and by a real sidecar daemon (one line, exit 2, no traceback); a Kubernetes
Secret mount as ``mtc manifests render`` writes it (links into a folder of its own, mode 0400) is used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtc.head.tools.cli.main import main
from mtc.head.tools.cli.tls import generate
from mtc.shared import tls
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("job"), backend="cryptography")


def _copy(job: tls.TLSFiles, d: Path, *, key_mode: int = 0o600, dir_mode: int = 0o700) -> Path:
    d.mkdir()
    for src in (job.ca, job.cert, job.key):
        shutil.copyfile(src, d / os.path.basename(src))
        os.chmod(d / os.path.basename(src), 0o600)
    os.chmod(d / tls.KEY_FILE, key_mode)
    os.chmod(d, dir_mode)
    return d


def _daemon(tls_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MTC_PEER_TOKEN": "tls-files-test-token-0123456789"}
    return subprocess.run([sys.executable, "-m", "mtc.sidecar", "serve", "--root", str(tmp_path / "ram"),
                           "--host-id", "s0-h0", "--tls-dir", str(tls_dir)],
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_key_others_can_read_in_a_folder_everyone_can_write_is_refused_by_name(tmp_path, job):
    d = _copy(job, tmp_path / "t", key_mode=0o644, dir_mode=0o777)
    with pytest.raises(ConfigError, match=rf"TLS key {d / 'tls.key'} has mode 0644: its group and other users can "
                                          rf"read .*`chmod 600 {d / 'tls.key'}`.*defaultMode: 0400"):
        tls.resolve(d)
    os.chmod(d / tls.KEY_FILE, 0o600)
    with pytest.raises(ConfigError, match=rf"TLS folder {d} has mode 0777: every user can replace .*`chmod o-w {d}`"):
        tls.resolve(d)
    os.chmod(d, 0o1777)  # sticky: nobody replaces another's files
    assert tls.resolve(d) == tls.TLSFiles.in_dir(d)
    os.chmod(d, 0o755)
    os.chmod(d / tls.CA_FILE, 0o666)
    with pytest.raises(ConfigError, match=rf"TLS file {d / 'ca.crt'} has mode 0666: every user can change it"):
        tls.resolve(d)
    os.chmod(d / tls.CA_FILE, 0o644)  # a certificate is public: readable is fine
    assert tls.resolve(d) == tls.TLSFiles.in_dir(d)


def test_the_daemon_refuses_a_loose_key_with_one_line(tmp_path, job):
    d = _copy(job, tmp_path / "t", key_mode=0o644, dir_mode=0o777)
    r = _daemon(d, tmp_path)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert f"TLS key {d / 'tls.key'} has mode 0644" in r.stderr and "chmod 600" in r.stderr


def test_a_garbage_ca_is_one_line_and_exit_2_like_the_other_bad_folders(tmp_path, job):
    d = _copy(job, tmp_path / "t")
    (d / tls.CA_FILE).write_text("garbage\n")
    with pytest.raises(ConfigError, match=rf"cannot load the job's CA certificate {d / 'ca.crt'}"):
        tls.resolve(d)
    r = _daemon(d, tmp_path)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert f"cannot load the job's CA certificate {d / 'ca.crt'}" in r.stderr
    missing = _daemon(tmp_path / "no-such-folder", tmp_path)  # the other bad folders, for comparison
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing


def test_a_kubernetes_secret_mount_is_used_and_its_default_mode_refused(tmp_path, job):
    """A Secret volume: a sticky world-writable mount whose names link into ..data, a folder of its own."""
    mount = tmp_path / "mount"
    data = mount / "..2026_12_03_12_00_00.000000000"
    data.mkdir(parents=True)
    for src in (job.ca, job.cert, job.key):
        shutil.copyfile(src, data / os.path.basename(src))
        os.chmod(data / os.path.basename(src), 0o400)  # defaultMode: 0400, as mtc manifests render writes it
    (mount / "..data").symlink_to(data.name)
    for name in (tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE):
        (mount / name).symlink_to(f"..data/{name}")
    os.chmod(data, 0o755)
    os.chmod(mount, 0o1777)
    assert tls.resolve(mount) == tls.TLSFiles.in_dir(mount)
    tls.server_context(tls.resolve(mount))
    os.chmod(data / tls.KEY_FILE, 0o644)  # a Secret volume without defaultMode
    with pytest.raises(ConfigError, match=rf"TLS key {mount / 'tls.key'} \(the file {data / 'tls.key'}\) has mode "
                                          r"0644.*defaultMode: 0400"):
        tls.resolve(mount)


def test_generate_refuses_a_folder_everyone_can_write(tmp_path, capsys):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    assert main(["tls", "generate", str(d)]) == 2
    assert f"{d} has mode 0777" in capsys.readouterr().err
    assert list(d.iterdir()) == []
