"""The job token and the control plane's handshake (docs/architecture.md, "Who may talk to a sidecar").

Every sidecar and the head of one job share one secret, the job token (``MTC_PEER_TOKEN`` or
``peer_token``; a Kubernetes Secret in production, never on disk or a command line). The
peer port checks it on every request; the control port checks it once per connection with a
challenge-response, under a key of its own derived from the token (``control_key``), so the
secret itself never crosses the wire:

1. the client sends ``hello {nonce: c}``; the server answers ``{nonce: s, host}``;
2. the client sends ``auth {proof: HMAC(k, "client" | s | c)}``; the server checks it
   (constant time) and answers ``{proof: HMAC(k, "server" | s | c)}``, which the client
   checks: each side knows the other holds the token, and a recorded exchange replays nowhere
   (both nonces are fresh).

Before that, a connection may send nothing else, no payload, and headers of at most
``PRE_AUTH_HEADER_BYTES``; it has ``HANDSHAKE_TIMEOUT_S`` per read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Mapping

from mtc.shared.config import ENV_TOKEN, MIN_TOKEN_CHARS
from mtc.shared.errors import ConfigError

PRE_AUTH_HEADER_BYTES = 4096
HANDSHAKE_TIMEOUT_S = 10.0
NONCE_HEX = 32


def resolve_token(token: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The job token: ``token`` when given (config ``peer_token``), else ``MTC_PEER_TOKEN``.

    Returns "" when neither is set. A token shorter than 16 characters is refused: it would be
    guessable (``secrets.token_hex(32)`` makes a good one).
    """
    env = os.environ if environ is None else environ
    value = token if token else env.get(ENV_TOKEN, "")
    value = value.strip()
    if value and len(value) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the job token (peer_token or {ENV_TOKEN}) has {len(value)} characters; use at least "
                          f"{MIN_TOKEN_CHARS} random ones, e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return value


def control_key(token: str) -> bytes:
    """The control plane's key: derived from the job token, distinct from it."""
    return hmac.new(token.encode(), b"mtc control plane v1", hashlib.sha256).digest()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def valid_nonce(x) -> bool:
    return isinstance(x, str) and len(x) == NONCE_HEX and all(c in "0123456789abcdef" for c in x)


def proof(key: bytes, side: str, server_nonce: str, client_nonce: str) -> str:
    msg = f"{side}|{server_nonce}|{client_nonce}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def check(expected: str, got) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())
