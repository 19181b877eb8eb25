"""shared/tls.py and `mtc tls generate`: the files, the contexts, and handshakes over real sockets."""

from __future__ import annotations

import os
import socket
import ssl
import stat
import threading

import numpy as np
import pytest

from mtc.head.tools.cli.main import main
from mtc.head.tools.cli.tls import generate
from mtc.shared import protocol, tls
from mtc.shared.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("job"), backend="cryptography")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("other"), backend="openssl")


def _serve_one(server_ctx: ssl.SSLContext, handler):
    """A listener on loopback that runs ``handler(conn)`` on one TLS connection; (address, thread, errors)."""
    srv = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def run():
        conn, _ = srv.accept()
        srv.close()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                handler(s)
        except (OSError, ssl.SSLError) as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname(), t, errors


def test_frames_with_many_payloads_cross_a_mutual_tls_connection_intact(job):
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 7, 70_000, 3 << 20, 5)]
    got = []

    def echo(s):
        req = protocol.recv_request(s)
        got.append(req)
        protocol.send_reply(s, protocol.Reply(req.id, {"n": len(req.payloads)}))

    addr, t, errors = _serve_one(tls.server_context(job), echo)
    with socket.create_connection(addr, timeout=10) as raw, tls.client_context(job).wrap_socket(raw) as s:
        assert s.version() == "TLSv1.3"
        protocol.send_request(s, protocol.Request("put", 7, {"x": 1}, tuple(payloads)))  # sendmsg on TLS
        reply = protocol.recv_reply(s)
    t.join(10)
    assert not errors and reply.result == {"n": len(payloads)}
    assert [bytes(p) for p in got[0].payloads] == [p.tobytes() for p in payloads]


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_the_server_refuses_a_client_without_a_certificate_of_the_jobs_ca(job, other, who):
    served = []
    addr, t, errors = _serve_one(tls.server_context(job), lambda s: served.append(protocol.recv_request(s)))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(job.ca)
    if who != "no certificate":
        ctx.load_cert_chain(other.cert, other.key)
    with socket.create_connection(addr, timeout=10) as raw, ctx.wrap_socket(raw) as s:
        with pytest.raises((OSError, protocol.ProtocolError)):
            s.sendall(protocol.frame_head(protocol.Request("ping", 1).header(), []))
            protocol.recv_reply(s)
    t.join(10)
    assert not served and errors and isinstance(errors[0], ssl.SSLError)


def test_the_client_refuses_a_server_of_another_ca(job, other):
    addr, t, errors = _serve_one(tls.server_context(other), lambda s: None)
    with socket.create_connection(addr, timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            tls.client_context(job).wrap_socket(raw)
    t.join(10)


def test_tls_folder_errors_name_the_folder_the_file_and_the_fix(tmp_path, job):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope'} does not exist.*mtc tls generate"):
        tls.TLSFiles.in_dir(tmp_path / "nope")
    (tmp_path / "ca.crt").write_text("x")
    with pytest.raises(ConfigError, match="lacks tls.crt, tls.key"):
        tls.TLSFiles.in_dir(tmp_path)
    (tmp_path / "tls.crt").write_bytes(open(job.cert, "rb").read())
    (tmp_path / "tls.key").write_bytes(open(job.key, "rb").read())
    with pytest.raises(ConfigError, match="cannot load the job's CA certificate .*ca.crt"):
        tls.server_context(tls.TLSFiles.in_dir(tmp_path))
    (tmp_path / "ca.crt").write_bytes(open(job.ca, "rb").read())
    (tmp_path / "tls.key").write_text("not a key")
    with pytest.raises(ConfigError, match="cannot load the TLS certificate .*tls.crt with key .*tls.key"):
        tls.client_context(tls.TLSFiles.in_dir(tmp_path))


def test_resolve_takes_the_argument_then_the_environment(tmp_path, job):
    d = os.path.dirname(job.ca)
    assert tls.resolve(None, {}) is None
    assert tls.resolve("", {"MTC_TLS_DIR": "  "}) is None
    assert tls.from_env({"MTC_TLS_DIR": d}) == job
    assert tls.resolve(d, {"MTC_TLS_DIR": str(tmp_path / "missing")}) == job
    with pytest.raises(ConfigError, match="missing"):
        tls.from_env({"MTC_TLS_DIR": str(tmp_path / "missing")})


@pytest.mark.parametrize("backend", ["cryptography", "openssl"])
def test_generate_writes_private_files_that_verify_and_keeps_existing_ones(tmp_path, backend):
    files = generate(tmp_path / "t", backend=backend, days=2)
    for p in (files.ca, files.cert, files.key):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    # Only these three: the CA's key is not kept, nothing half-written is left.
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    tls.server_context(files), tls.client_context(files)  # the certificate and key load, as a pair
    before = open(files.cert, "rb").read()
    with pytest.raises(ConfigError, match="already holds ca.crt, tls.crt, tls.key; pass --force"):
        generate(tmp_path / "t", backend=backend)
    assert open(files.cert, "rb").read() == before
    assert open(generate(tmp_path / "t", backend=backend, force=True).cert, "rb").read() != before


def test_mtc_tls_generate_command(tmp_path, capsys):
    assert main(["tls", "generate", str(tmp_path / "d")]) == 0
    assert "kubectl create secret generic" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert main(["tls", "generate", str(tmp_path / "d")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["tls", "generate", str(tmp_path / "e"), "--days", "0"]) == 2
