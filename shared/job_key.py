"""The job key: a MAC over what mtc writes to shared storage and trusts when it reads it back.

A backup root (a bucket) and the ramdisks can be written by more principals than the job. What mtc
later relies on from there (a backup's step manifest, a finalize's fence marker, a compilation cache
entry, which is native code) carries a tag: an HMAC-SHA256, under a key only the job holds, over the
object's kind, its name and the SHA-256 of its content. Whoever cannot compute the tag cannot make
mtc load, choose or wait for anything: an object whose tag does not check is treated as absent, with
one warning naming it and a count (``rejected``).

The key is derived from the job's secret: ``MTC_JOB_KEY`` when set (a key of its own, kept in the
same Kubernetes Secret as the token), else the job token (``MTC_PEER_TOKEN`` / ``peer_token``), which
head and sidecars already share. The derived key is distinct from the token and from the control
plane's key. A tag names the key that made it (``<key id>-<mac>``, the id a hash of the key, nothing
of it): to rotate, set the new key and list the old ones in ``MTC_JOB_KEYS_ACCEPTED`` (comma
separated) while what they signed is still read; drop them once it has aged out.

With no secret at all (a single-process run without a token) nothing is signed and nothing signed
can be checked: callers decide what that means for them (the compilation cache then shares nothing).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import re
import threading
from typing import Mapping

from mtc.shared.config import ENV_TOKEN, MIN_TOKEN_CHARS
from mtc.shared.errors import ConfigError

log = logging.getLogger(__name__)

ENV_KEY = "MTC_JOB_KEY"
ENV_ACCEPTED = "MTC_JOB_KEYS_ACCEPTED"
_ID_HEX, _MAC_HEX = 12, 64
_TAG_RE = re.compile(rf"([0-9a-f]{{{_ID_HEX}}})-([0-9a-f]{{{_MAC_HEX}}})")

# Verdicts of ``JobKey.check``.
OK, UNSIGNED, BAD, UNKNOWN_KEY, NO_KEY = "ok", "unsigned", "bad", "unknown key", "no key"

_lock = threading.Lock()
rejected: collections.Counter[str] = collections.Counter()  # kind -> objects refused (metrics)
_warned: set[tuple[str, str]] = set()


def _derive(material: str) -> bytes:
    return hmac.new(material.encode(), b"mtc job key v1", hashlib.sha256).digest()


def _key_id(key: bytes) -> str:
    return hmac.new(key, b"mtc key id", hashlib.sha256).hexdigest()[:_ID_HEX]


def _material(value: str, name: str) -> str:
    value = value.strip()
    if len(value) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{name} has a key of {len(value)} characters; use at least {MIN_TOKEN_CHARS} random ones, "
                          "e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return value


class JobKey:
    """Signs and checks tags (see the module docstring). ``JobKey.none()`` signs nothing."""

    def __init__(self, key: bytes | None, accepted: tuple[bytes, ...] = ()):
        self._key = key
        self._keys = {_key_id(k): k for k in (*accepted, *((key,) if key else ()))}
        self.key_id = _key_id(key) if key else None

    @classmethod
    def none(cls) -> "JobKey":
        return cls(None)

    @classmethod
    def from_secret(cls, token: str | None = None, environ: Mapping[str, str] | None = None) -> "JobKey":
        """The job's key: ``MTC_JOB_KEY``, else ``token`` (or ``MTC_PEER_TOKEN``); older keys from
        ``MTC_JOB_KEYS_ACCEPTED``. No secret: a key that signs nothing."""
        env = os.environ if environ is None else environ
        own = env.get(ENV_KEY, "").strip()
        material = _material(own, ENV_KEY) if own else (token or env.get(ENV_TOKEN, "")).strip()
        accepted = tuple(_derive(_material(a, ENV_ACCEPTED)) for a in env.get(ENV_ACCEPTED, "").split(",") if a.strip())
        return cls(_derive(material) if material else None, accepted)

    @staticmethod
    def for_child(environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a process started with a job token of its own (a tool's temporary daemons)
        needs to keep this job's key: ``MTC_JOB_KEY`` set to the job's secret ({} with none)."""
        env = os.environ if environ is None else environ
        material = env.get(ENV_KEY, "").strip() or env.get(ENV_TOKEN, "").strip()
        return {ENV_KEY: material} if material else {}

    @property
    def enabled(self) -> bool:
        return self._key is not None

    @staticmethod
    def _message(kind: str, name: str, digest: bytes) -> bytes:
        return b"\0".join((b"mtc/1", kind.encode(), name.encode(), digest))

    def sign(self, kind: str, name: str, content: bytes) -> str | None:
        """The tag of ``content`` stored as ``name`` (a ``kind`` of object), or None with no key."""
        return self.sign_digest(kind, name, hashlib.sha256(content).digest())

    def sign_digest(self, kind: str, name: str, digest: bytes) -> str | None:
        if self._key is None:
            return None
        return f"{self.key_id}-{hmac.new(self._key, self._message(kind, name, digest), hashlib.sha256).hexdigest()}"

    def check(self, kind: str, name: str, content: bytes, tag: str | None) -> str:
        return self.check_digest(kind, name, hashlib.sha256(content).digest(), tag)

    def check_digest(self, kind: str, name: str, digest: bytes, tag: str | None) -> str:
        """``OK``, or why not: ``UNSIGNED`` (no tag), ``NO_KEY`` (this process has none),
        ``UNKNOWN_KEY`` (signed by a key not accepted here), ``BAD`` (the tag does not match)."""
        if not tag:
            return UNSIGNED
        if not self._keys:
            return NO_KEY
        m = _TAG_RE.fullmatch(tag) if isinstance(tag, str) else None
        if m is None:
            return BAD
        key = self._keys.get(m.group(1))
        if key is None:
            return UNKNOWN_KEY
        want = hmac.new(key, self._message(kind, name, digest), hashlib.sha256).hexdigest()
        return OK if hmac.compare_digest(want, m.group(2)) else BAD


def is_tag(text: str) -> bool:
    return isinstance(text, str) and _TAG_RE.fullmatch(text) is not None


def refuse(kind: str, name: str, verdict: str, where: str = "", what_happens: str = "ignored as if absent") -> None:
    """Count an object that failed its check and warn once for it."""
    with _lock:
        rejected[kind] += 1
        first = (kind, name) not in _warned
        _warned.add((kind, name))
    if first:
        why = {UNSIGNED: "it carries no tag of this job's key", UNKNOWN_KEY: "it was signed by a key this job does not "
               f"accept (list an older key in {ENV_ACCEPTED})", BAD: "its tag does not match its name and content "
               "(it was changed, copied or renamed, or written by someone without this job's key)",
               NO_KEY: f"this process has no job key to check it with (set {ENV_TOKEN} or {ENV_KEY})"}.get(verdict, verdict)
        log.warning("mtc: %s %s%s failed the job key's check: %s; %s", kind, name, f" in {where}" if where else "", why,
                    what_happens)


def rejected_counts() -> dict[str, int]:
    with _lock:
        return dict(rejected)
