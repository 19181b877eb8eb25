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

A folder is used only when its files are safe (``TLSFiles.check``, run by ``resolve``), as ssh and
PostgreSQL require of a private key: ``tls.key`` readable by this user only (0600, 0400), or, when
root owns it, by its group too (0640, 0440: a Kubernetes Secret volume, whose files root owns, with
``defaultMode: 0400`` as ``mtc manifests render`` writes it, which a pod's ``fsGroup`` makes 0440);
no file writable by every user, and no folder on their paths that every user may write unless it
is sticky (a Secret mount is ``1777``), since whoever replaces ``ca.crt`` chooses whom the job
trusts. Then the three files must load: a certificate, its key, the CA.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
import stat
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

    def check(self) -> "TLSFiles":
        """These files, when they are safe to use and load (see the module's text); else ConfigError
        naming the file or folder and the fix."""
        euid = os.geteuid()
        for path in (self.key, self.ca, self.cert):
            real = os.path.realpath(path)  # a Secret mount's names are links into a folder of its own
            st = os.stat(real)
            mode = stat.S_IMODE(st.st_mode)
            shown = path if real == path else f"{path} (the file {real})"
            if mode & 0o002:
                raise ConfigError(f"TLS file {shown} has mode {mode:04o}: every user can change it; "
                                  f"`chmod 600 {real}` (a Kubernetes Secret: defaultMode: 0400 on its volume)")
            if path == self.key:
                loose = (mode & 0o037) if st.st_uid == 0 else (mode & 0o077) if st.st_uid == euid else None
                if loose is None:
                    raise ConfigError(f"TLS key {shown} is owned by user {st.st_uid}, not by this user ({euid}) "
                                      f"or root: `chown {euid} {real} && chmod 600 {real}`")
                if loose:
                    who = "its group and other users" if mode & 0o070 and mode & 0o007 else (
                        "its group" if mode & 0o070 else "other users")
                    raise ConfigError(f"TLS key {shown} has mode {mode:04o}: {who} can read this job's private "
                                      f"key; `chmod 600 {real}` (a Kubernetes Secret: defaultMode: 0400 on its "
                                      "volume, as `mtc manifests render` writes it)")
            for folder in _folders(path, real):
                fmode = os.stat(folder).st_mode
                if fmode & 0o002 and not fmode & stat.S_ISVTX:
                    raise ConfigError(f"TLS folder {folder} has mode {stat.S_IMODE(fmode):04o}: every user can "
                                      f"replace {shown} (and so choose, with {CA_FILE}, whom this process "
                                      f"trusts); `chmod o-w {folder}`, or keep the TLS files in a folder of "
                                      "your own")
        client_context(self)  # the files load (ConfigError naming the one that does not)
        return self


def _folders(path: str, real: str) -> list[str]:
    """The folders of ``path`` as named and of the file it resolves to, up to the root."""
    out: list[str] = []
    for p in (os.path.abspath(path), real):
        d = os.path.dirname(p)
        while d not in out:
            out.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return out


def resolve(tls_dir: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> TLSFiles | None:
    """The TLS files of ``tls_dir`` when given, else of ``MTC_TLS_DIR``, checked (``TLSFiles.check``);
    None when neither is set (clear text)."""
    env = os.environ if environ is None else environ
    d = os.fspath(tls_dir) if tls_dir else env.get(ENV_TLS_DIR, "").strip()
    return TLSFiles.in_dir(d).check() if d else None


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
