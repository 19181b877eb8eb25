"""Uploads to GCS: the content type and crc32c of what is sent, and ``_ResumableUpload``, one
resumable upload of a local file driven chunk by chunk over the JSON API.

Imported through ``mtc.shared.objstore.gcs``, which says what to install when google-cloud-storage
is missing."""

from __future__ import annotations

import base64
import re
from typing import TYPE_CHECKING

import google_crc32c
import requests
from google.api_core import exceptions as gexc

from mtc.shared.objstore.gcs_client import _Redo
from mtc.shared.objstore.store import FatalStoreError

if TYPE_CHECKING:
    from mtc.shared.objstore.gcs import GCSStore

_CONTENT_TYPE = "application/octet-stream"


class _ResumableUpload:
    """One resumable upload of a local file, driven chunk by chunk (the JSON API protocol:
    PUT Content-Range chunks, 308 + Range while incomplete, 200/201 with metadata at the
    end, `bytes */size` to ask where a session stands)."""

    def __init__(self, store: GCSStore, name: str, full: str, path: str, size: int, if_absent: bool):
        self.s, self.name, self.full, self.path, self.size, self.if_absent = store, name, full, path, size, if_absent
        self.session: str | None = None
        self.offset = 0  # bytes the server confirmed
        self.high_water = 0  # most bytes any session confirmed: the progress that resets the deadline
        self.in_doubt = False  # a request failed: the server's offset is unknown
        # crc32c of the file's first `crc_end` bytes, extended as chunks are first read.
        self.crc = google_crc32c.Checksum()
        self.crc_end = 0

    def run(self) -> bool:
        # Progress is the high-water mark, so that uploads started again from zero (a lost
        # session, an early finalize) do not count as progress until they get further.
        return self.s._call("upload", self.name, self._attempt, progress=lambda: self.high_water)

    def _attempt(self) -> bool:
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
                data = f.read(min(self.s.chunk_size, self.size - self.offset))
                if len(data) != min(self.s.chunk_size, self.size - self.offset):
                    raise OSError(f"{self.path} changed size during the upload to {self.s.url}{self.name}")
                end = self.offset + len(data)
                if end > self.crc_end:
                    skip = self.crc_end - self.offset  # > 0 only when resending after a resume
                    self.crc.update(data[skip:] if skip else data)
                    self.crc_end = end
                headers = {"Content-Range": f"bytes {self.offset}-{end - 1}/{self.size}"}
                if end == self.size:
                    headers["X-Goog-Hash"] = f"crc32c={self._crc()}"
                self.in_doubt = True
                r = self.s._http.put(self.session, data=data, headers=headers, timeout=self.s.timeout)
                done = self._answer(r)
                if done is not None:
                    return done

    def _start(self) -> bool:
        """Open a session; False when a create-only upload finds the object there."""
        blob = self.s._bucket.blob(self.full)
        try:
            self.session = blob.create_resumable_upload_session(
                content_type=_CONTENT_TYPE,
                size=self.size,
                if_generation_match=0 if self.if_absent else None,
                checksum=None,
                retry=None,
                timeout=self.s.timeout,
            )
        except gexc.PreconditionFailed:
            return False
        self.offset, self.in_doubt = 0, False
        return True

    def _query(self) -> bool | None:
        r = self.s._http.put(
            self.session, data=b"", headers={"Content-Range": f"bytes */{self.size}"}, timeout=self.s.timeout
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
                    f"upload {self.s.url}{self.name}: the server finished the upload without object "
                    f"metadata ({r.text[:200]!r}); cannot verify what it stored"
                ) from None
            self.in_doubt = False
            # A server that finalized early (fake-gcs-server on a status query) holds fewer
            # bytes than we have read: the size check alone catches it.
            crc = self._crc() if self.crc_end == self.size else None
            try:
                self.s._check_landed(
                    self.full, meta.get("generation"), meta.get("size"), meta.get("crc32c"), self.size, crc
                )
            except _Redo:
                self.session, self.offset = None, 0
                raise
            return True
        if r.status_code == 412:
            return False
        if r.status_code in (404, 410):
            # The session is gone (expired, or finalized and forgotten): start again.
            self.session, self.offset = None, 0
            raise _Redo(f"resumable session lost ({r.status_code})")
        raise gexc.from_http_response(r)

    def _crc(self) -> str:
        return base64.b64encode(self.crc.digest()).decode()


def _crc_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
