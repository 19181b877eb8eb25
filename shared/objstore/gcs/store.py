"""The gs:// store (``GCSStore``): every operation under the retry policy (see the package's
docstring); small objects in one request, large files through ``upload.ResumableUpload``."""

from __future__ import annotations

import copy
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import requests
from google.api_core import exceptions as gexc
from google.cloud import storage

from mtc.shared.errors import ConfigError
from mtc.shared.objstore.gcs.client import Redo, is_transient, make_client
from mtc.shared.objstore.gcs.upload import CONTENT_TYPE, ResumableUpload, crc32c_b64
from mtc.shared.objstore.retry import Backoff, retry_call
from mtc.shared.objstore.store import (
    DEFAULT_DEADLINE_S,
    MAX_SMALL_OBJECT_BYTES,
    FatalStoreError,
    ObjectNotFoundError,
    ObjectStore,
    StoreError,
    TransientStoreError,
    UntrustedObjectError,
    name_problem,
    validate_name,
    validate_prefix,
)

logger = logging.getLogger(__package__)  # the gs:// store logs as mtc.shared.objstore.gcs
T = TypeVar("T")

RESUMABLE_THRESHOLD = 8 << 20  # above this, resumable uploads (GCS's own multipart limit)
CHUNK_SIZE = 32 << 20  # resumable chunk; a multiple of 256 KiB
_CHUNK_GRANULE = 256 << 10


class GCSStore(ObjectStore):
    """Objects under `gs://bucket/prefix/`.

    `client`: a google.cloud.storage.Client (default: `make_client()`, which honours
    STORAGE_EMULATOR_HOST); a client passed in is not closed by close().
    `deadline`: seconds one operation may keep failing transiently; restarts on progress.
    `timeout`: (connect, read) seconds of each HTTP request.

    Create-only writes (`if_absent=True`) check first and then write with
    if_generation_match=0: atomic between concurrent writers wherever the server enforces
    that precondition (GCS: always; fake-gcs-server: single-request uploads, i.e. up to
    `resumable_threshold`; gcp-storage-emulator: never). Commit markers are small objects.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: storage.Client | None = None,
        deadline: float = DEFAULT_DEADLINE_S,
        resumable_threshold: int = RESUMABLE_THRESHOLD,
        chunk_size: int = CHUNK_SIZE,
        timeout: tuple[float, float] = (10.0, 60.0),
        backoff: Backoff = Backoff(),
    ):
        if not bucket or "/" in bucket:
            raise ConfigError(f"GCS bucket name {bucket!r} is not valid")
        prefix = prefix.strip("/")
        if prefix:
            validate_name(prefix)
        if chunk_size <= 0 or chunk_size % _CHUNK_GRANULE:
            raise ConfigError(f"chunk_size {chunk_size} must be a positive multiple of 256 KiB")
        if deadline < 0:
            raise ConfigError(f"deadline {deadline} must be >= 0 seconds")
        self.bucket_name = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.url = f"gs://{bucket}/{self.prefix}"
        self.deadline = float(deadline)
        self.resumable_threshold = resumable_threshold
        self.chunk_size = chunk_size
        self.timeout = timeout
        self.backoff = backoff
        self._own_client = client is None
        self._client = client if client is not None else make_client()
        self._bucket = self._client.bucket(bucket)
        # Resumable session URLs authenticate by themselves: a plain session suffices.
        self._http = requests.Session()
        self._closed = threading.Event()

    # -- plumbing -----------------------------------------------------------------------
    def with_deadline(self, seconds: float) -> "GCSStore":
        if seconds < 0:
            raise ConfigError(f"deadline {seconds} must be >= 0 seconds")
        other = copy.copy(self)  # the same client and settings; only the patience differs
        other.deadline = float(seconds)
        return other

    def _full(self, name: str) -> str:
        return self.prefix + validate_name(name)

    def _call(self, what: str, name: str, fn: Callable[[], T], progress: Callable[[], object] | None = None) -> T:
        """Run `fn` under the retry policy; turn what escapes into our errors."""
        tries = 0

        def policy(attempt: int, exc: Exception) -> bool:
            nonlocal tries
            tries += 1
            return is_transient(exc)

        if self._guard is not None:  # before every try: an operation may wait out a long outage
            unguarded = fn

            def fn() -> T:
                self._check_guard()
                return unguarded()

        start = time.monotonic()
        try:
            return retry_call(
                fn,
                policy=policy,
                deadline=self.deadline,
                backoff=self.backoff,
                progress=progress,
                what=f"{what} {self.url}{name}",
            )
        except StoreError:
            raise
        except Exception as e:
            if is_transient(e):
                raise TransientStoreError(
                    f"{what} {self.url}{name}: still failing after {tries} tries in "
                    f"{time.monotonic() - start:.1f} s (deadline {self.deadline:g} s without progress): "
                    f"{_brief(e)}; the store may be unreachable, try again later"
                ) from e
            if isinstance(e, gexc.GoogleAPICallError):
                raise self._fatal(what, name, e) from e
            raise

    def _fatal(self, what: str, name: str, e: gexc.GoogleAPICallError) -> FatalStoreError:
        if isinstance(e, gexc.NotFound):
            if not self._bucket_exists():
                return FatalStoreError(
                    f"{what} {self.url}{name}: bucket {self.bucket_name!r} does not exist (or these "
                    "credentials cannot see it); create it or fix the backup URL"
                )
            return ObjectNotFoundError(f"{what}: object {self.url}{name} does not exist")
        hint = {
            401: "check the credentials",
            403: "grant these credentials access to the bucket",
            400: "the request was refused as malformed",
        }.get(e.code or 0, "retrying will not help")
        return FatalStoreError(f"{what} {self.url}{name}: {e.code} {_brief(e)}; {hint}")

    def _bucket_exists(self) -> bool:
        try:
            return self._bucket.exists(retry=None, timeout=self.timeout)
        except Exception:  # noqa: BLE001 - only refines an error message
            return True

    def _stat(self, full: str) -> storage.Blob | None:
        return self._bucket.get_blob(full, retry=None, timeout=self.timeout)

    # -- writes -------------------------------------------------------------------------

    def put_bytes(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        full = self._full(name)
        data = bytes(data)
        return self._put_small(name, full, lambda: data, if_absent)

    def put_file(self, name: str, path: str, *, if_absent: bool = False) -> bool:
        full = self._full(name)
        size = os.stat(path).st_size
        if size <= self.resumable_threshold:

            def read() -> bytes:
                with open(path, "rb") as f:
                    return f.read()

            return self._put_small(name, full, read, if_absent)
        if if_absent and self._call("stat", name, lambda: self._stat(full)) is not None:
            return False
        upload = ResumableUpload(bucket=self._bucket, session=self._http, check_landed=self._check_landed,
                                 url=self.url, name=name, full=full, path=path, size=size, if_absent=if_absent,
                                 chunk_size=self.chunk_size, timeout=self.timeout)
        return self._call("upload", name, upload.attempt, progress=upload.progress)

    def _put_small(self, name: str, full: str, read: Callable[[], bytes], if_absent: bool) -> bool:
        # The pre-check keeps create-only writes honest on servers that ignore
        # preconditions; if_generation_match=0 makes them atomic where it is enforced.
        if if_absent and self._call("stat", name, lambda: self._stat(full)) is not None:
            return False
        tries = 0

        def attempt() -> bool:
            nonlocal tries
            tries += 1
            data = read()
            crc = crc32c_b64(data)
            blob = self._bucket.blob(full)
            blob.crc32c = crc  # the server refuses the object if the bytes do not match
            try:
                blob.upload_from_file(
                    io.BytesIO(data),
                    size=len(data),
                    content_type=CONTENT_TYPE,
                    if_generation_match=0 if if_absent else None,
                    checksum=None,
                    retry=None,
                    timeout=self.timeout,
                )
            except gexc.PreconditionFailed:
                if tries > 1:
                    # An earlier try may have landed with only its answer lost: then the
                    # object is ours (same bytes) and this call did create it.
                    current = self._stat(full)
                    return current is not None and current.crc32c == crc and current.size == len(data)
                return False
            self._check_landed(full, blob.generation, blob.size, blob.crc32c, len(data), crc)
            return True

        return self._call("upload", name, attempt)

    def _check_landed(self, full: str, generation, got_size, got_crc, size: int, crc: str | None) -> None:
        """Raise Redo (after deleting that generation) if the finalized object is not ours."""
        wrong_size = got_size is not None and int(got_size) != size
        wrong_crc = crc is not None and got_crc is not None and got_crc != crc
        if wrong_size or wrong_crc:
            logger.warning(
                "%s%s: server stored %s bytes (crc32c %s), expected %d (crc32c %s); uploading again",
                self.url, full[len(self.prefix):], got_size, got_crc, size, crc,
            )
            self._delete_generation(full, generation)
            raise Redo(f"the server finalized {got_size} bytes of {size}")

    def _delete_generation(self, full: str, generation) -> None:
        try:
            self._bucket.blob(full).delete(
                if_generation_match=int(generation) if generation else None, retry=None, timeout=self.timeout
            )
        except (gexc.NotFound, gexc.PreconditionFailed):
            pass

    # -- reads --------------------------------------------------------------------------

    def get_to_file(self, name: str, path: str) -> int:
        full = self._full(name)
        meta = self._call("download", name, lambda: self._stat(full))
        if meta is None:
            raise self._fatal("download", name, gexc.NotFound("no such object"))
        size = int(meta.size or 0)
        # Pin the generation: a resumed download must not splice two versions.
        blob = self._bucket.blob(full, generation=meta.generation)
        with open(path, "wb") as f:

            def attempt() -> int:
                done = f.tell()
                f.truncate()
                if done < size or size == 0:
                    blob.download_to_file(
                        f,
                        start=done or None,
                        raw_download=True,
                        checksum=None,  # ranged resumes cannot be checksummed; the caller hashes
                        retry=None,
                        timeout=self.timeout,
                    )
                if f.tell() < size:
                    raise Redo(f"download stopped at {f.tell()} of {size} bytes")
                if f.tell() > size:
                    raise FatalStoreError(f"download {self.url}{name}: got {f.tell()} bytes, expected {size}")
                return size

            return self._call("download", name, attempt, progress=f.tell)

    def get_bytes(self, name: str, *, max_bytes: int = MAX_SMALL_OBJECT_BYTES) -> bytes:
        full = self._full(name)

        def attempt() -> bytes:
            # At most max_bytes + 1 bytes come: an object larger than its kind is refused, not read whole. A
            # range is not checksummed by the client; the object's crc32c (sent with it) is checked here.
            blob = self._bucket.blob(full)
            try:
                data = blob.download_as_bytes(start=0, end=max_bytes, raw_download=True, checksum=None, retry=None,
                                              timeout=self.timeout)
            except gexc.RequestRangeNotSatisfiable:  # an empty object has no byte 0
                return b""
            if len(data) > max_bytes:
                raise UntrustedObjectError(f"object {name!r} in {self.url} is larger than {max_bytes} bytes, more than "
                                           "mtc writes there; it was not read")
            if blob.crc32c and crc32c_b64(data) != blob.crc32c:
                raise Redo(f"download {self.url}{name}: the crc32c of the {len(data)} bytes received does not match "
                           "the object's")
            return data

        return self._call("download", name, attempt)

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"a range of {name!r} starts at {offset} and has {length} bytes: neither may be negative")
        if length == 0:
            return b""
        full = self._full(name)

        def attempt() -> bytes:
            # A range has no checksum of its own (the object's crc32c covers all of it): the caller checks
            # the bytes against the hash it expects.
            try:
                return self._bucket.blob(full).download_as_bytes(start=offset, end=offset + length - 1,
                                                                 raw_download=True, checksum=None, retry=None,
                                                                 timeout=self.timeout)
            except gexc.RequestRangeNotSatisfiable:  # starts at or past the end
                return b""

        return self._call("download", name, attempt)

    def exists(self, name: str) -> bool:
        full = self._full(name)
        return self._call("stat", name, lambda: self._stat(full)) is not None

    def size(self, name: str) -> int | None:
        full = self._full(name)
        meta = self._call("stat", name, lambda: self._stat(full))
        return None if meta is None else int(meta.size or 0)

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)

        def attempt() -> list[str]:
            blobs = self._client.list_blobs(
                self.bucket_name, prefix=self.prefix + prefix, retry=None, timeout=self.timeout
            )
            return [b.name for b in blobs]

        names = self._call("list", prefix, attempt)
        n = len(self.prefix)
        # Objects written by other tools under our prefix may not be valid names: skip them.
        return sorted(name[n:] for name in names if name_problem(name[n:]) is None)

    def delete(self, name: str) -> None:
        full = self._full(name)

        def attempt() -> None:
            try:
                self._bucket.blob(full).delete(retry=None, timeout=self.timeout)
            except gexc.NotFound:
                pass  # missing, or deleted by an earlier try whose answer was lost

        self._call("delete", name, attempt)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._http.close()
        if self._own_client:
            self._client.close()


def _brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
