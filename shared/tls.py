"""Encryption in transit: mutual TLS on the control and peer connections (optional).

A job that turns it on gives the head and every sidecar one folder (``MTC_TLS_DIR``, the
daemon's ``--tls-dir``, config ``tls_dir``) with the keys of a Kubernetes TLS Secret:

- ``ca.crt``: the job's certificate authority;
- ``tls.crt``, ``tls.key``: a certificate signed by it, and its key (``mtc tls generate`` makes
  one certificate the whole job shares).

Both ends verify the other against the job's CA: a server accepts only clients that present a
certificate the CA signed (mutual TLS), a client accepts only such a server. Host names are not
checked (hosts are addressed by IP); the CA is. The job token's checks (``mtc.shared.auth``, the
peer token) run inside the encrypted connection as before.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
from pathlib import Path
from typing import Mapping

from mtc.shared.errors import ConfigError

ENV_TLS_DIR = "MTC_TLS_DIR"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"

# Small buffers of one message are sent as one TLS record; larger ones on their own.
_COALESCE_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """The paths of this process's certificate, its key and the job's CA certificate."""

    cert: str
    key: str
    ca: str

    @classmethod
    def in_dir(cls, directory: str | os.PathLike) -> "TLSFiles":
        """The files of a TLS folder (``ca.crt``, ``tls.crt``, ``tls.key``); ConfigError names a missing one."""
        d = Path(directory)
        if not d.is_dir():
            raise ConfigError(f"TLS folder {d} does not exist (MTC_TLS_DIR / --tls-dir / tls_dir): mount the job's "
                              f"TLS Secret there, or make one with `mtc tls generate {d}`")
        files = cls(cert=str(d / CERT_FILE), key=str(d / KEY_FILE), ca=str(d / CA_FILE))
        missing = [n for n, p in ((CA_FILE, files.ca), (CERT_FILE, files.cert), (KEY_FILE, files.key))
                   if not os.path.isfile(p)]
        if missing:
            raise ConfigError(f"TLS folder {d} lacks {', '.join(missing)}: it needs {CA_FILE}, {CERT_FILE} and "
                              f"{KEY_FILE} (the keys of the job's TLS Secret; `mtc tls generate DIR` writes them)")
        return files


def resolve(tls_dir: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> TLSFiles | None:
    """The TLS files of ``tls_dir`` when given, else of ``MTC_TLS_DIR``; None when neither is set (clear text)."""
    env = os.environ if environ is None else environ
    d = os.fspath(tls_dir) if tls_dir else env.get(ENV_TLS_DIR, "").strip()
    return TLSFiles.in_dir(d) if d else None


def from_env(environ: Mapping[str, str] | None = None) -> TLSFiles | None:
    """The TLS files of ``MTC_TLS_DIR``; None when it is unset or empty."""
    return resolve(None, environ)


class _TLSSocket(ssl.SSLSocket):
    """An SSL socket that also takes ``sendmsg`` (the frame writer's scatter send; SSL has none),
    and whose ``shutdown`` keeps the TLS state: servers shut a connection down from another thread
    to wake its reader, which must then fail with an OSError, not find the state gone."""

    def shutdown(self, how: int) -> None:
        socket.socket.shutdown(self, how)

    def sendmsg(self, buffers, ancdata=(), flags=0, address=None):  # noqa: D401 - socket API
        if ancdata or flags or address is not None:
            raise NotImplementedError("sendmsg with ancillary data, flags or an address on a TLS socket")
        total, pending = 0, bytearray()
        for b in buffers:
            with memoryview(b) as v:
                v = v.cast("B")
                total += v.nbytes
                if v.nbytes < _COALESCE_BYTES:
                    pending += v
                    if len(pending) < _COALESCE_BYTES:
                        continue
                    self.sendall(pending)
                    pending.clear()
                    continue
                if pending:
                    self.sendall(pending)
                    pending.clear()
                self.sendall(v)
        if pending:
            self.sendall(pending)
        return total


def _load(ctx: ssl.SSLContext, files: TLSFiles) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=files.ca)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"cannot load the job's CA certificate {files.ca}: {e}; it must be a PEM certificate "
                          "(the ca.crt of the job's TLS Secret)") from None
    try:
        ctx.load_cert_chain(certfile=files.cert, keyfile=files.key)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"cannot load the TLS certificate {files.cert} with key {files.key}: {e}; they must be "
                          "a PEM certificate and its matching private key (tls.crt, tls.key)") from None
    ctx.sslsocket_class = _TLSSocket
    return ctx


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """A server's context: presents ``files.cert``, requires a client certificate signed by the job's CA."""
    ctx = _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), files)
    ctx.num_tickets = 0  # no resumption: every connection is verified afresh, and nothing arrives unasked
    return ctx


def client_context(files: TLSFiles) -> ssl.SSLContext:
    """A client's context: presents ``files.cert``, accepts only a server certificate the job's CA signed.

    Host names are not checked: hosts are reached by IP, and every certificate of the job is its CA's."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    return _load(ctx, files)


def client_context_for(tls_dir: str | os.PathLike | None = None) -> ssl.SSLContext | None:
    """``client_context`` of ``resolve(tls_dir)``; None for clear text."""
    files = resolve(tls_dir)
    return None if files is None else client_context(files)


def describe(e: BaseException) -> str:
    """Why a TLS handshake failed, and what to check."""
    return (f"TLS handshake failed ({getattr(e, 'reason', None) or e}): the head and every sidecar of a job need "
            "TLS on or off together, with certificates from the job's CA (MTC_TLS_DIR / --tls-dir)")
