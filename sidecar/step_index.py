"""``StepIndex``: what a sidecar remembers per step beside its ramdisk, with one way to forget it.

The ramdisk is the truth (step files, blobs); these are parsed copies and in-flight state, so a
restore or an inventory does not re-read and re-check a manifest each time. ``forget`` drops a
step everywhere (abort, pruning); ``prune`` keeps only what a committed step still needs.
"""

from __future__ import annotations

import threading
from typing import Iterable

from mtc.shared import format as fmt


class StepIndex:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        # step -> (shards written so far, bytes written so far, seconds so far), across parts (phase 1).
        self.partial: dict[int, tuple[list[fmt.HostShard], int, float]] = {}
        # step -> (pending host manifest bytes, that manifest) as this sidecar wrote it in phase 1.
        self.parts: dict[int, tuple[bytes, fmt.HostManifest]] = {}
        # step -> its whole step manifest, parsed (a keeper's, fetched from a keeper, or a backup's).
        self.manifests: dict[int, fmt.StepManifest] = {}
        # step -> the bytes this sidecar committed (a manifest or a record): a step file damaged
        # under a live sidecar is rewritten from them (see inventory).
        self.committed: dict[int, bytes] = {}
        # step -> (local view of a step committed here as a record, {array key: its own boxes},
        # {array key: shape}): what a restore onto the same topology reads by.
        self.views: dict[int, tuple[fmt.StepManifest, dict[str, set], dict[str, tuple]]] = {}
        # step -> (step file bytes, its commit record or None, the record part's blob names): parsed once.
        self.records: dict[int, tuple[bytes, fmt.CommitRecord | None, frozenset | None]] = {}
        # (step, manifest digest) -> {host: digest of its share's blob names}, for inventories.
        self.share_digests: dict[tuple[int, str], dict[str, str]] = {}

    def forget(self, step: int) -> None:
        """Drop everything known of ``step`` (aborted, or pruned from the ramdisk)."""
        with self.lock:
            for table in (self.partial, self.parts, self.manifests, self.committed, self.views, self.records):
                table.pop(step, None)
            for key in [k for k in self.share_digests if k[0] == step]:
                del self.share_digests[key]

    def prune(self, committed: Iterable[int]) -> None:
        """Keep of the committed-step tables only the steps in ``committed`` (the ramdisk's now).
        In-flight saves (``partial``, ``parts``) and manifests fetched for a restore stay."""
        keep = set(committed)
        with self.lock:
            for table in (self.committed, self.views, self.records):
                for s in [s for s in table if s not in keep]:
                    del table[s]
            for key in [k for k in self.share_digests if k[0] not in self.manifests]:
                del self.share_digests[key]
