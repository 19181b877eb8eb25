"""``StepIndex``: what a sidecar remembers per step beside its ramdisk, with one way to forget it.

The ramdisk is the truth (step files, blobs); these are parsed copies and in-flight state, so a
restore or an inventory does not re-read and re-check a manifest each time. The save
(``mtc.sidecar.saves``) and the committed steps (``mtc.sidecar.committed``) share one index, and
change it only through its methods, under its one lock. ``forget`` drops a step everywhere (abort,
pruning); ``prune`` keeps only what a committed step still needs.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from mtc.shared import format as fmt
from mtc.shared.errors import ManifestError

# step -> (local view of a step committed here as a record, {array key: its own boxes}, {array key: shape})
View = tuple[fmt.StepManifest, dict[str, set], dict[str, tuple]]


class StepIndex:
    """Per-step memory of one sidecar.

    Attributes (read them; only the methods change them):
        partial: step -> (shards written so far, bytes written so far, seconds so far), across the
            parts of a save (phase 1).
        parts: step -> (pending host manifest bytes, that manifest) as this sidecar wrote it in phase 1.
        manifests: step -> its whole step manifest, parsed (a keeper's, fetched from a keeper, or a
            backup's).
        committed: step -> the bytes this sidecar committed (a manifest or a record): a step file
            damaged under a live sidecar is rewritten from them.
        views: step -> the local view of a step committed here as a record, with its own boxes and
            the arrays' shapes: what a restore onto the same topology reads by.
        records: step -> (step file bytes, its commit record or None, the record part's blob names):
            parsed once.
        share_digests: (step, manifest digest) -> {host: digest of its share's blob names}, for
            inventories.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.partial: dict[int, tuple[list[fmt.HostShard], int, float]] = {}
        self.parts: dict[int, tuple[bytes, fmt.HostManifest]] = {}
        self.manifests: dict[int, fmt.StepManifest] = {}
        self.committed: dict[int, bytes] = {}
        self.views: dict[int, View] = {}
        self.records: dict[int, tuple[bytes, fmt.CommitRecord | None, frozenset | None]] = {}
        self.share_digests: dict[tuple[int, str], dict[str, str]] = {}

    # --- a save in flight (phase 1) -------------------------------------------------------

    def start_part(self, step: int, part: int) -> None:
        """Part ``part`` of the save of ``step`` begins: part 0 starts the save afresh; a later part
        adds to it (ManifestError when part 0 did not come first)."""
        with self._lock:
            if part == 0:
                self.partial[step] = ([], 0, 0.0)
            elif step not in self.partial:
                raise ManifestError(f"step {step}: part {part} of a save arrived before part 0")

    def add_to_part(self, step: int, entries: Iterable[fmt.HostShard], written: int,
                    seconds: float) -> tuple[tuple[fmt.HostShard, ...], int, float]:
        """Add ``entries`` (``written`` bytes in ``seconds``) to the save of ``step``; returns every
        shard of it so far, with its bytes and seconds."""
        with self._lock:
            done, done_bytes, done_s = self.partial[step]
            done.extend(entries)
            self.partial[step] = (done, done_bytes + written, done_s + seconds)
            return tuple(done), done_bytes + written, done_s + seconds

    def end_part(self, step: int) -> None:
        """The save of ``step`` is over here (its commit): no part adds to it any more."""
        with self._lock:
            self.partial.pop(step, None)

    def drop_written(self, step: int) -> None:
        """Forget the pending host manifest of ``step`` (it is being replaced)."""
        with self._lock:
            self.parts.pop(step, None)

    def keep_written(self, step: int, data: bytes, manifest: fmt.HostManifest) -> None:
        """The pending host manifest of ``step`` as written: its bytes and the manifest."""
        with self._lock:
            self.parts[step] = (data, manifest)

    def take_written(self, step: int) -> tuple[bytes, fmt.HostManifest] | None:
        """The pending host manifest of ``step`` as written (or None), dropped with those of every
        older step (committed now, or abandoned before it)."""
        with self._lock:
            out = self.parts.get(step)
            for s in [s for s in self.parts if s <= step]:
                del self.parts[s]
            return out

    # --- committed steps ------------------------------------------------------------------

    def note_commit(self, step: int, data: bytes, kept: Iterable[int],
                    manifest: fmt.StepManifest | None = None) -> None:
        """``step`` was committed here with ``data`` (and its parsed ``manifest`` on a keeper); the
        committed steps are now ``kept``: every other step this index knows as committed is forgotten."""
        kept = set(kept)
        with self._lock:
            self.committed[step] = data
            gone = [s for s in self.committed if s not in kept]
        for s in gone:
            self.forget(s)
        if manifest is not None:
            self.keep_manifest(step, manifest)

    def committed_bytes(self, step: int) -> bytes | None:
        """What this sidecar committed for ``step`` (None: not this process, or no longer kept)."""
        with self._lock:
            return self.committed.get(step)

    def known_steps(self) -> set[int]:
        """The steps with a parsed manifest or committed bytes here."""
        with self._lock:
            return set(self.manifests) | set(self.committed)

    def manifest(self, step: int) -> fmt.StepManifest | None:
        with self._lock:
            return self.manifests.get(step)

    def keep_manifest(self, step: int, manifest: fmt.StepManifest) -> None:
        with self._lock:
            self.manifests[step] = manifest

    def drop_manifest(self, step: int) -> None:
        with self._lock:
            self.manifests.pop(step, None)

    def record(self, step: int, data: bytes) -> tuple[fmt.CommitRecord | None, frozenset | None] | None:
        """The parse of ``step``'s file if it was parsed from these same ``data`` (else None)."""
        with self._lock:
            hit = self.records.get(step)
        return (hit[1], hit[2]) if hit is not None and hit[0] == data else None

    def keep_record(self, step: int, data: bytes, rec: fmt.CommitRecord | None, own: frozenset | None) -> None:
        with self._lock:
            self.records[step] = (data, rec, own)

    def view(self, step: int) -> View | None:
        with self._lock:
            return self.views.get(step)

    def keep_view(self, step: int, view: View) -> None:
        with self._lock:
            self.views[step] = view

    def share_digests_of(self, step: int, digest: str, compute: Callable[[], dict[str, str]]) -> dict[str, str]:
        """The share digests of the manifest ``digest`` of ``step``: kept, or ``compute()``d once."""
        key = (step, digest)
        with self._lock:  # inventories may run on several threads at once
            digests = self.share_digests.get(key)
        if digests is None:
            digests = compute()
            with self._lock:
                self.share_digests[key] = digests
        return digests

    # --- forgetting -----------------------------------------------------------------------

    def forget(self, step: int) -> None:
        """Drop everything known of ``step`` (aborted, or pruned from the ramdisk)."""
        with self._lock:
            for table in (self.partial, self.parts, self.manifests, self.committed, self.views, self.records):
                table.pop(step, None)
            for key in [k for k in self.share_digests if k[0] == step]:
                del self.share_digests[key]

    def prune(self, committed: Iterable[int]) -> None:
        """Keep of the committed-step tables only the steps in ``committed`` (the ramdisk's now).
        In-flight saves (``partial``, ``parts``) and manifests fetched for a restore stay."""
        keep = set(committed)
        with self._lock:
            for table in (self.committed, self.views, self.records):
                for s in [s for s in table if s not in keep]:
                    del table[s]
            for key in [k for k in self.share_digests if k[0] not in self.manifests]:
                del self.share_digests[key]
