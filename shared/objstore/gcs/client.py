"""Google Cloud Storage clients for the gs:// store: ``make_client`` (default credentials, or an
emulator with anonymous ones), and which errors are worth retrying (``is_transient``, ``Redo``)."""

from __future__ import annotations

import http.client
import os
import urllib.parse

import requests
import urllib3
from google.api_core import exceptions as gexc
from google.auth import exceptions as gauth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption

from mtc.shared.errors import ConfigError
from mtc.shared.objstore.store import FatalStoreError

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_TYPES = (
    ConnectionError,  # builtin: refused, reset, aborted, broken pipe
    TimeoutError,
    http.client.HTTPException,  # IncompleteRead, RemoteDisconnected, BadStatusLine
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    urllib3.exceptions.NewConnectionError,
    gauth_exc.TransportError,
    DataCorruption,  # bytes damaged in flight: sending or fetching them again may work
)


class Redo(Exception):
    """The server holds something we must not keep (a truncated or corrupt finalized object, a
    lost session); start the object again. Retried like a transient error (``is_transient``)."""


def is_transient(exc: BaseException) -> bool:
    """Whether retrying `exc` may succeed (network trouble, throttling, server errors)."""
    if isinstance(exc, Redo):
        return True
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in _TRANSIENT_STATUS
    return isinstance(exc, _TRANSIENT_TYPES)


def make_client(endpoint: str | None = None) -> storage.Client:
    """A storage client. `endpoint` (or STORAGE_EMULATOR_HOST, as host:port or a URL) means
    an emulator: anonymous credentials and project "test". Otherwise default credentials."""
    source = "endpoint"
    if endpoint is None:
        endpoint, source = os.environ.get(EMULATOR_ENV) or None, EMULATOR_ENV
    if endpoint is None:
        try:
            return storage.Client()
        except gauth_exc.DefaultCredentialsError as e:
            raise FatalStoreError(
                f"no Google Cloud credentials for the gs:// backup store ({e}); run with a service "
                f"account (GOOGLE_APPLICATION_CREDENTIALS or workload identity), or set {EMULATOR_ENV} "
                "to use an emulator"
            ) from e
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is not None or parts.scheme == "https"
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.path not in ("", "/"):
        raise ConfigError(
            f"{source}={endpoint!r} is not an emulator address; use host:port or http://host:port"
        )
    return storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": url.rstrip("/")},
    )
