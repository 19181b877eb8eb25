"""Uploads to GCS: the content type and crc32c of what is sent (``CONTENT_TYPE``, ``crc32c_b64``),
and ``ResumableUpload``, one resumable upload of a local file driven chunk by chunk over the JSON API."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable

import google_crc32c
import requests
from google.api_core import exceptions as gexc
from google.cloud import storage

from mtc.shared.objstore.gcs.client import Redo
from mtc.shared.objstore.store import FatalStoreError

CONTENT_TYPE = "application/octet-stream"

# check_landed(full, generation, got_size, got_crc, size, crc): raises Redo (after deleting that
# generation) when the finalized object is not the bytes that were sent.
LandedCheck = Callable[[str, object, object, object, int, "str | None"], None]


class ResumableUpload:
    """One resumable upload of a local file, driven chunk by chunk (the JSON API protocol:
    PUT Content-Range chunks, 308 + Range while incomplete, 200/201 with metadata at the
    end, `bytes */size` to ask where a session stands).

    The store runs ``attempt`` under its retry policy, with ``progress`` as what restarts its
    deadline. What the upload needs of the store comes in here: the ``bucket`` that opens
    sessions, the HTTP ``session`` that sends the chunks and ``check_landed``; ``url`` and ``name``
    are for messages, ``full`` is the object's name in the bucket.
    """

    def __init__(self, *, bucket: storage.Bucket, session: requests.Session, check_landed: LandedCheck,
                 url: str, name: str, full: str, path: str, size: int, if_absent: bool, chunk_size: int,
                 timeout: tuple[float, float]):
        self.bucket, self.http, self.check_landed = bucket, session, check_landed
        self.url, self.name, self.full, self.path, self.size, self.if_absent = url, name, full, path, size, if_absent
        self.chunk_size, self.timeout = chunk_size, timeout
        self.session: str | None = None  # the resumable session's URL
        self.offset = 0  # bytes the server confirmed
        self.high_water = 0  # most bytes any session confirmed: the progress that resets the deadline
        self.in_doubt = False  # a request failed: the server's offset is unknown
        # crc32c of the file's first `crc_end` bytes, extended as chunks are first read.
        self.crc = google_crc32c.Checksum()
        self.crc_end = 0

    def progress(self) -> int:
        # The high-water mark, so that uploads started again from zero (a lost session, an early
        # finalize) do not count as progress until they get further.
        return self.high_water

    def attempt(self) -> bool:
        if self.session is None:
            if not self._start():
                return False
        elif self.in_doubt:
            done = self._query()
            if done is not None:
                return done
        with open(self.path, "rb") as f:
            while True:
                f.seek(self.offset)
                data = f.read(min(self.chunk_size, self.size - self.offset))
                if len(data) != min(self.chunk_size, self.size - self.offset):
                    raise OSError(f"{self.path} changed size during the upload to {self.url}{self.name}")
                end = self.offset + len(data)
                if end > self.crc_end:
                    skip = self.crc_end - self.offset  # > 0 only when resending after a resume
                    self.crc.update(data[skip:] if skip else data)
                    self.crc_end = end
                headers = {"Content-Range": f"bytes {self.offset}-{end - 1}/{self.size}"}
                if end == self.size:
                    headers["X-Goog-Hash"] = f"crc32c={self._crc()}"
                self.in_doubt = True
                r = self.http.put(self.session, data=data, headers=headers, timeout=self.timeout)
                done = self._answer(r)
                if done is not None:
                    return done

    def _start(self) -> bool:
        """Open a session; False when a create-only upload finds the object there."""
        blob = self.bucket.blob(self.full)
        try:
            self.session = blob.create_resumable_upload_session(
                content_type=CONTENT_TYPE,
                size=self.size,
                if_generation_match=0 if self.if_absent else None,
                checksum=None,
                retry=None,
                timeout=self.timeout,
            )
        except gexc.PreconditionFailed:
            return False
        self.offset, self.in_doubt = 0, False
        return True

    def _query(self) -> bool | None:
        r = self.http.put(
            self.session, data=b"", headers={"Content-Range": f"bytes */{self.size}"}, timeout=self.timeout
        )
        return self._answer(r)

    def _answer(self, r: requests.Response) -> bool | None:
        """Act on a response: None to go on from self.offset, True/False when finished."""
        if r.status_code == 308:
            m = re.fullmatch(r"bytes=0-(\d+)", r.headers.get("Range", ""))
            self.offset = int(m.group(1)) + 1 if m else 0
            self.high_water = max(self.high_water, self.offset)
            self.in_doubt = False
            return None
        if r.status_code in (200, 201):
            try:
                meta = r.json()
            except ValueError:
                raise FatalStoreError(
                    f"upload {self.url}{self.name}: the server finished the upload without object "
                    f"metadata ({r.text[:200]!r}); cannot verify what it stored"
                ) from None
            self.in_doubt = False
            # A server that finalized early (fake-gcs-server on a status query) holds fewer
            # bytes than we have read: the size check alone catches it.
            crc = self._crc() if self.crc_end == self.size else None
            try:
                self.check_landed(
                    self.full, meta.get("generation"), meta.get("size"), meta.get("crc32c"), self.size, crc
                )
            except Redo:
                self.session, self.offset = None, 0
                raise
            return True
        if r.status_code == 412:
            return False
        if r.status_code in (404, 410):
            # The session is gone (expired, or finalized and forgotten): start again.
            self.session, self.offset = None, 0
            raise Redo(f"resumable session lost ({r.status_code})")
        raise gexc.from_http_response(r)

    def _crc(self) -> str:
        return base64.b64encode(self.crc.digest()).decode()


def crc32c_b64(data: bytes) -> str:
    """The crc32c of ``data`` as GCS names it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
