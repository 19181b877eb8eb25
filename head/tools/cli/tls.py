"""``mtc tls generate DIR``: a job's CA and the certificate every process of the job presents.

It writes ``ca.crt``, ``tls.crt`` and ``tls.key`` (mode 0600), the keys of a Kubernetes TLS
Secret and what ``MTC_TLS_DIR`` / ``--tls-dir`` read (``mtc.shared.tls``). The whole job shares
one certificate: the head and every sidecar present it and accept only certificates the job's
CA signed, so a process without the Secret can neither serve nor dial. The CA's key is
discarded once it signed: nothing else can be signed into the job later (generate again for a
new job, or to rotate). The keys are EC P-256; ``cryptography`` makes them when it is installed
(``pip install 'mtc[tls]'``), else the ``openssl`` command.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from mtc.shared.errors import ConfigError
from mtc.shared.tls import CA_FILE, CERT_FILE, KEY_FILE, TLSFiles

DEFAULT_DAYS = 365
MAX_DAYS = 3650  # ten years: a job's CA is rotated by generating again, long before that
_NAME = "mtc"  # the certificate's subject; no host name is checked (hosts are reached by IP)


def generate(directory: str | os.PathLike, *, days: int = DEFAULT_DAYS, force: bool = False,
             backend: str | None = None) -> TLSFiles:
    """Write a new job CA and one certificate/key it signed into ``directory``; returns their paths.

    ``backend``: ``"cryptography"`` or ``"openssl"`` (default: the package when importable).
    Existing files are kept unless ``force``.
    """
    if type(days) is not int or not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days must be a whole number of days from 1 to {MAX_DAYS} (ten years), got {days!r}; "
                          "generate again to rotate the files")
    if not str(directory).strip():
        raise ConfigError("the folder to write ca.crt, tls.crt and tls.key into is empty; give one, e.g. ./tls")
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d} is not a folder; give a folder to write ca.crt, tls.crt and tls.key into")
    if d.is_dir() and (mode := d.stat().st_mode) & 0o002 and not mode & stat.S_ISVTX:
        raise ConfigError(f"{d} has mode {stat.S_IMODE(mode):04o}: every user could replace the files written there "
                          f"(and with {CA_FILE}, choose whom the job trusts); `chmod o-w {d}`, or choose a folder of "
                          "your own")
    names = (CA_FILE, CERT_FILE, KEY_FILE)
    there = [n for n in names if (d / n).exists()]
    if there and not force:
        raise ConfigError(f"{d} already holds {', '.join(there)}; pass --force to replace them (every process of "
                          "the job must then get the new files), or choose an empty folder")
    if backend is None:
        try:
            import cryptography  # noqa: F401
            backend = "cryptography"
        except ImportError:
            backend = "openssl"
    if backend == "cryptography":
        pems = _with_cryptography(days)
    elif backend == "openssl":
        pems = _with_openssl(days)
    else:
        raise ConfigError(f"unknown TLS backend {backend!r}; use 'cryptography' or 'openssl'")
    try:
        d.mkdir(parents=True, exist_ok=True)
        for name, data in zip(names, pems):
            _write_private(d / name, data)
    except OSError as e:
        raise ConfigError(f"cannot write the TLS files into {d}: {e.strerror or e}; choose a folder you can "
                          "write") from None
    return TLSFiles.in_dir(d).check()  # as every process of the job will check them


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600, whole or not at all."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _with_cryptography(days: int) -> tuple[bytes, bytes, bytes]:
    """(ca.crt, tls.crt, tls.key) as PEM, made with the ``cryptography`` package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)  # 5 min: clock skew
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{_NAME} job CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(_NAME)]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _with_openssl(days: int) -> tuple[bytes, bytes, bytes]:
    """(ca.crt, tls.crt, tls.key) as PEM, made with the ``openssl`` command (in a private temporary folder)."""
    exe = shutil.which("openssl")
    if exe is None:
        raise ConfigError("mtc tls generate needs the cryptography package (pip install 'mtc[tls]') or the "
                          "openssl command; neither is installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with tempfile.TemporaryDirectory(prefix="mtc-tls-") as tmp:  # 0700: the CA key never leaves it
        t = Path(tmp)
        (t / "leaf.ext").write_text("basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
                                    f"subjectAltName=DNS:{_NAME}\nsubjectKeyIdentifier=hash\n"
                                    "authorityKeyIdentifier=keyid\n")
        steps = [
            [exe, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
             "-subj", f"/CN={_NAME} job CA", "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            [exe, "req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={_NAME}"],
            [exe, "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial",
             str(int.from_bytes(os.urandom(16), "big") >> 1), "-days", str(days), "-sha256",
             "-extfile", "leaf.ext", "-out", "tls.crt"],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, cwd=t, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if r.returncode:
                raise ConfigError(f"openssl {cmd[1]} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
        return tuple((t / n).read_bytes() for n in ("ca.crt", "tls.crt", "tls.key"))  # type: ignore[return-value]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``mtc tls generate``."""
    t = sub.add_parser("tls", help="encryption in transit: make the job's TLS files")
    tsub = t.add_subparsers(dest="tls_action", metavar="ACTION", required=True)
    g = tsub.add_parser(
        "generate", help="write a job CA and the certificate and key the whole job shares",
        description="Write ca.crt, tls.crt and tls.key (mode 0600) into DIR: a new CA for this job and one "
                    "certificate and key it signed, which the head and every sidecar present (one certificate "
                    "shared by the job; the CA's key is not kept). Make the job's Secret from them: kubectl "
                    "create secret generic JOB-mtc-tls --from-file=ca.crt=DIR/ca.crt "
                    "--from-file=tls.crt=DIR/tls.crt --from-file=tls.key=DIR/tls.key")
    g.add_argument("dir", help="folder to write the three files into (made if missing)")
    g.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    g.add_argument("--force", action="store_true", help="replace files already there")
    g.set_defaults(func=cmd_tls_generate)


def cmd_tls_generate(args: argparse.Namespace) -> int:
    try:
        files = generate(args.dir, days=args.days, force=args.force)
    except ConfigError as e:
        print(f"mtc tls generate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {files.ca}, {files.cert} and {files.key} (one certificate for the whole job, valid "
          f"{args.days} days). Give every process of the job this folder as MTC_TLS_DIR, e.g. as a Secret:\n"
          f"  kubectl create secret generic JOB-mtc-tls --from-file=ca.crt={files.ca} "
          f"--from-file=tls.crt={files.cert} --from-file=tls.key={files.key}")
    return 0
